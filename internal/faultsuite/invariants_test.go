package faultsuite

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/testhost"
)

// invariants watches the run and checks the end state.
type invariants struct {
	pool       *pgxpool.Pool
	mu         sync.Mutex
	cursors    map[string]int64 // project/consumer -> highest cursor seen
	violations []string
	pruned     int64
	losses     []pendingLoss
}

type pendingLoss struct {
	p      *proc
	owner  string
	before int
}

func newInvariants(pool *pgxpool.Pool) *invariants {
	return &invariants{pool: pool, cursors: map[string]int64{}}
}

func (inv *invariants) violate(format string, args ...any) {
	inv.mu.Lock()
	defer inv.mu.Unlock()
	inv.violations = append(inv.violations, fmt.Sprintf(format, args...))
}

// sampleCursors checks that no cursor ever moves backwards: a stale lease holder's late
// acknowledgement must never win.
func (inv *invariants) sampleCursors(ctx context.Context) error {
	rows, err := inv.pool.Query(ctx, `SELECT project_id, consumer_id, last_acked_sequence FROM lifecycle_consumer_cursors WHERE last_acked_sequence IS NOT NULL`)
	if err != nil {
		return nil // the server may be restarting; the next sample checks again
	}
	defer rows.Close()
	for rows.Next() {
		var p, c string
		var seq int64
		if err := rows.Scan(&p, &c, &seq); err != nil {
			return err
		}
		key := p + "/" + c
		inv.mu.Lock()
		prev, seen := inv.cursors[key]
		if !seen || seq > prev {
			inv.cursors[key] = seq
		}
		inv.mu.Unlock()
		if seen && seq < prev {
			inv.violate("cursor %s moved back from %d to %d", key, prev, seq)
		}
	}
	return nil
}

// checkPruneFloor checks, after a sweep, that no project's pruned floor is above the slowest
// cursor of a consumer that is not retired.
func (inv *invariants) checkPruneFloor(ctx context.Context, res outbox.RetentionResult) error {
	inv.mu.Lock()
	inv.pruned += res.Pruned()
	inv.mu.Unlock()
	rows, err := inv.pool.Query(ctx, `SELECT h.project_id, h.pruned_through, min(coalesce(c.last_acked_sequence, 0))
		FROM lifecycle_outbox_heads h JOIN lifecycle_consumer_cursors c ON c.project_id = h.project_id AND c.retired_at IS NULL
		GROUP BY h.project_id, h.pruned_through`)
	if err != nil {
		return nil
	}
	defer rows.Close()
	for rows.Next() {
		var p string
		var floor, slowest int64
		if err := rows.Scan(&p, &floor, &slowest); err != nil {
			return err
		}
		if floor > slowest {
			return fmt.Errorf("project %s pruned through %d, but a live consumer is at %d", p, floor, slowest)
		}
	}
	return nil
}

// expectLeaseLoss waits for a process thawed after its lease expired to report the loss: its
// renewal or its late acknowledgement was rejected.
func (inv *invariants) expectLeaseLoss(p *proc, before int) {
	p.mu.Lock()
	owner := p.owner
	p.mu.Unlock()
	inv.mu.Lock()
	inv.losses = append(inv.losses, pendingLoss{p: p, owner: owner, before: before})
	inv.mu.Unlock()
}

func (inv *invariants) awaitLeaseLosses(t *testing.T) {
	inv.mu.Lock()
	pending := inv.losses
	inv.mu.Unlock()
	for _, l := range pending {
		deadline := time.Now().Add(2 * time.Minute) // only where it gives up: generous for a busy machine
		for {
			l.p.mu.Lock()
			got, current := l.p.lossesAt[l.owner], l.p.owner
			l.p.mu.Unlock()
			if got > l.before {
				break
			}
			if current != l.owner {
				break // that incarnation was killed before it could report; its writes are checked by the cursors
			}
			if time.Now().After(deadline) {
				inv.violate("%s (%s) resumed after its lease expired but never saw the lease as lost", l.p.name, l.owner)
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

type summary struct {
	written    int
	observed   string
	pruned     int64
	parked     int
	duplicates int
	lost       int
}

type processLog struct {
	applied    map[string]bool
	duplicates int
	refused    int
	violated   int
}

// readProcessLog reads one observer's log and checks it: no deletion applied twice, first
// applications in sequence order per project.
func (inv *invariants) readProcessLog(p *proc) processLog {
	out := processLog{applied: map[string]bool{}}
	f, err := os.Open(p.args.Log)
	if err != nil {
		inv.violate("%s: %v", p.name, err)
		return out
	}
	defer f.Close()
	last := map[string]int64{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var r testhost.ApplyRecord
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			inv.violate("%s: bad log line %q", p.name, sc.Text())
			continue
		}
		switch r.Kind {
		case "duplicate":
			out.duplicates++
		case "fence-refused":
			out.refused++
		case "fence-violated":
			out.violated++
		case "applied":
			if out.applied[r.EventID] {
				inv.violate("%s applied %s twice", p.name, r.EventID)
			}
			out.applied[r.EventID] = true
			if r.Sequence <= last[r.Project] {
				inv.violate("%s applied %s sequence %d after %d", p.name, r.Project, r.Sequence, last[r.Project])
			}
			last[r.Project] = r.Sequence
		}
	}
	return out
}

func (inv *invariants) verify(ctx context.Context, t *testing.T, observers []*proc, live, failing []string, retired map[string]bool) summary {
	var s summary
	// Every committed deletion, from the database: the tasks table is never pruned.
	rows, err := inv.pool.Query(ctx, `SELECT id, deleted_at FROM tasks WHERE deleted_at IS NOT NULL`)
	require.NoError(t, err)
	written := map[string]bool{}
	for rows.Next() {
		var id string
		var at time.Time
		require.NoError(t, rows.Scan(&id, &at))
		written[outbox.TaskDeletedEventID(id, at)] = true
	}
	require.NoError(t, rows.Err())
	s.written = len(written)
	// The writers record each event once, in the log (schema 18): none without its deletion.
	var unknown int
	require.NoError(t, inv.pool.QueryRow(ctx, `SELECT count(*) FILTER (WHERE NOT EXISTS (
			SELECT 1 FROM tasks t WHERE t.project_id = e.project_id AND t.id = e.task_id AND t.deleted_at = e.deleted_at))
		FROM lifecycle_event_log e`).Scan(&unknown))
	if unknown > 0 {
		inv.violate("%d logged events have no committed deletion", unknown)
	}

	// Per identity: the union of its processes' applications plus its parked events.
	logs := map[string]processLog{}
	for _, p := range observers {
		l := inv.readProcessLog(p)
		logs[p.name] = l
		s.duplicates += l.duplicates
		if l.violated > 0 {
			inv.violate("%s performed a writer-owned side effect %d times", p.name, l.violated)
		}
		if l.refused == 0 && len(l.applied) > 0 {
			inv.violate("%s never exercised the fence", p.name)
		}
	}
	var observed []string
	for _, id := range live {
		got := map[string]bool{}
		for _, p := range observers {
			if strings.HasPrefix(p.name, id) {
				for e := range logs[p.name].applied {
					got[e] = true
				}
			}
		}
		parked := deadLetters(ctx, t, inv.pool, id)
		for e := range parked {
			got[e] = true
		}
		lost := 0
		for e := range written {
			if !got[e] {
				lost++
			}
		}
		for e := range got {
			if !written[e] {
				inv.violate("%s applied %s, which was never committed", id, e)
			}
		}
		if lost > 0 {
			inv.violate("%s lost %d deletions", id, lost)
		}
		s.lost += lost
		observed = append(observed, fmt.Sprintf("%s:%d", id, len(got)-len(parked)))
	}
	s.observed = strings.Join(observed, ",")

	// Poison events: exactly ten attempts, parked, one audit row each.
	for e, attempts := range deadLetters(ctx, t, inv.pool, "obs-b") {
		task, _, err := outbox.ParseEventID(e)
		require.NoError(t, err)
		if !contains(failing, task) {
			inv.violate("obs-b parked %s, which was not chosen to fail", e)
		}
		if attempts != 10 {
			inv.violate("obs-b parked %s after %d attempts", e, attempts)
		}
		var audits int
		require.NoError(t, inv.pool.QueryRow(ctx, `SELECT count(*) FROM run_audit WHERE action = $1 AND metadata->>'eventId' = $2
			AND metadata->>'consumerId' = 'obs-b'`, outbox.AuditConsumerPoisoned, e).Scan(&audits))
		if audits != 1 {
			inv.violate("obs-b parked %s with %d audit rows", e, audits)
		}
		s.parked++
	}
	for e := range written {
		task, _, _ := outbox.ParseEventID(e)
		if contains(failing, task) && !retired["node-b"] {
			if _, ok := deadLetters(ctx, t, inv.pool, "obs-b")[e]; !ok {
				inv.violate("obs-b did not park %s", e)
			}
		}
	}
	for _, id := range []string{"obs-a", "obs-c"} {
		if n := len(deadLetters(ctx, t, inv.pool, id)); n > 0 {
			inv.violate("%s parked %d events though its listener never fails", id, n)
		}
	}

	// The writer's side effects were the writers' alone.
	var deleteAudits, foreign, notices, foreignNotices int
	require.NoError(t, inv.pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE actor NOT LIKE 'writer-%') FROM run_audit WHERE action = 'task:deleted'`).Scan(&deleteAudits, &foreign))
	require.NoError(t, inv.pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE body NOT LIKE '%by writer-%') FROM mailbox_notices`).Scan(&notices, &foreignNotices))
	if deleteAudits != len(written) || foreign > 0 {
		inv.violate("%d task:deleted audit rows for %d deletions, %d not by a writer", deleteAudits, len(written), foreign)
	}
	if foreignNotices > 0 || notices > len(written) {
		inv.violate("%d mailbox notices for %d deletions, %d not by a writer", notices, len(written), foreignNotices)
	}

	inv.mu.Lock()
	s.pruned = inv.pruned
	violations := append([]string(nil), inv.violations...)
	inv.mu.Unlock()
	sort.Strings(violations)
	for _, v := range violations {
		t.Error(v)
	}
	return s
}

// deadLetters returns a consumer's parked events and their attempts.
func deadLetters(ctx context.Context, t *testing.T, pool *pgxpool.Pool, consumer string) map[string]int {
	rows, err := pool.Query(ctx, `SELECT event_id, attempts FROM lifecycle_consumer_deliveries WHERE consumer_id = $1 AND state = 'dead'`, consumer)
	require.NoError(t, err)
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var e string
		var a int
		require.NoError(t, rows.Scan(&e, &a))
		out[e] = a
	}
	return out
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

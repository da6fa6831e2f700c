package faultsuite

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgcluster"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
)

// TestFaultSuiteStandby runs the suite's world on a primary and a streaming hot standby of its
// own (pgtest.StartPair, not the shared server: the failover destroys the primary), with two
// observer identities reading from the standby (Config.ReadDSN): obs-a, whose two processes
// compete for its leases, and obs-c; obs-b, whose listener fails on chosen tasks, reads from
// the primary. For half a minute, seeded faults hit the processes and both servers: the
// standby killed and started again, its replay paused past ReadMaxLag, its readers' sessions
// terminated, the primary restarted. Then a failover while everything runs: the primary is
// stopped, the standby promoted, every process restarted against the promoted server. obs-a's
// processes read from a fresh standby of it; obs-c's still name the old standby, now a
// primary, which a consumer refuses to read from, so obs-c reads from the primary. The
// writers go on for a while, and the suite's invariants must hold on the promoted server:
// nothing lost, no cursor ever moved back, order per project, duplicates only as at-least-once
// allows, poison events parked once.
func TestFaultSuiteStandby(t *testing.T) {
	runStandbySuite(t, 30*time.Second)
}

// standbyReaders are the identities that read from a standby.
var standbyReaders = map[string]bool{"obs-a": true, "obs-c": true}

func runStandbySuite(t *testing.T, duration time.Duration) {
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("OUTBOX_FAULT_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		require.NoError(t, err, "OUTBOX_FAULT_SEED")
		seed = v
	}
	t.Logf("fault seed %d (OUTBOX_FAULT_SEED=%d reproduces the schedule), %s of faults, then a failover", seed, seed, duration)
	rng := rand.New(rand.NewPCG(seed, seed^0x5eed))

	ctx, cancel := context.WithTimeout(context.Background(), duration+6*time.Minute)
	defer cancel()
	pair := pgtest.StartPair(t)
	db := pair.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	dir := t.TempDir()

	projects := []string{"alpha", "beta", "gamma", "delta"}
	after := 5 * time.Second // the writers' time on the promoted server
	perProject := int((duration+after).Seconds()*25) + 50
	host := testhost.New(pool, testhost.Options{})
	var all []string
	for _, p := range projects {
		ids, err := host.CreateMany(ctx, p, "t", perProject)
		require.NoError(t, err)
		for _, id := range ids {
			all = append(all, p+"/"+id)
		}
	}
	shuffle(rng, all)
	failing := []string{"t-13", "t-77"}
	identities := map[string]string{"obs-a": "node-a", "obs-b": "node-b", "obs-c": "node-c"}
	for id, scope := range identities {
		require.NoError(t, testhost.NewSettings(pool, scope).Set(ctx, "outbox.consumer_id", id))
	}
	// The settings and tasks are on the standby before any reader starts.
	require.NoError(t, pair.WaitReplayed(t))

	var writers, observers []*proc
	for i := range 3 {
		share := all[i*len(all)/3 : (i+1)*len(all)/3]
		extra := all[((i+1)%3)*len(all)/3:][:len(all)/30]
		tasks := append(append([]string(nil), share...), extra...)
		writers = append(writers, &proc{name: fmt.Sprintf("writer-%d", i+1), role: "writer", args: roleArgs{
			Name: fmt.Sprintf("writer-%d", i+1), DSN: db.URL, Scope: "writers", Projects: projects,
			Tasks: tasks, Rate: 30, Log: filepath.Join(dir, fmt.Sprintf("writer-%d.log", i+1))}})
	}
	for _, spec := range []struct {
		name, identity string
		failing        []string
	}{{"obs-a1", "obs-a", nil}, {"obs-a2", "obs-a", nil}, {"obs-b1", "obs-b", failing}, {"obs-c1", "obs-c", nil}} {
		a := roleArgs{Name: spec.name, DSN: db.URL, Scope: identities[spec.identity], Projects: projects,
			Log: filepath.Join(dir, spec.name+".log"), Failing: spec.failing}
		if standbyReaders[spec.identity] {
			a.ReadDSN = db.StandbyURL
		}
		observers = append(observers, &proc{name: spec.name, role: "observer", args: a})
	}
	everyone := func() []*proc { return append(append([]*proc(nil), observers...), writers...) }
	for _, p := range everyone() {
		p.start(t)
	}
	t.Cleanup(func() {
		for _, p := range everyone() {
			p.signal(syscall.SIGCONT)
			p.signal(syscall.SIGKILL)
		}
	})

	inv := newInvariants(pool)
	var c counts
	var sc standbyCounts
	retention, err := outbox.NewRetention(pool, outbox.Config{Clock: aheadClock(), RetentionBatchSize: 500}, nil, nil)
	require.NoError(t, err)
	readers := []*proc{observers[0], observers[1], observers[3]}

	inject := func(kind string) {
		switch kind {
		case "kill-observer", "kill-writer": // SIGKILL, then restart
			group := observers
			if kind == "kill-writer" {
				group = writers
			}
			p := group[rng.IntN(len(group))]
			if p.isDone() {
				return
			}
			p.kill(t)
			c.kills++
			sleepRand(rng, 100, 1500)
			p.start(t)
			c.restarts++
		case "terminate": // an observer's backends on the primary, its LISTEN connection among them
			p := observers[rng.IntN(len(observers))]
			var n int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
				WHERE datname = current_database() AND application_name = $1`, p.name).Scan(&n))
			c.terminations += n
		case "terminate-standby": // a reader's sessions on the standby
			p := readers[rng.IntN(len(readers))]
			sc.standbyTerminations += standbyExecCount(ctx, t, db.StandbyURL, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
				WHERE datname = current_database() AND application_name = $1`, p.name)
		case "freeze": // a lease holder of obs-a, stopped past its lease, then resumed
			p := leaseHolder(ctx, t, pool, observers[:2])
			if p == nil {
				return
			}
			before := p.leaseLosses()
			p.signal(syscall.SIGSTOP)
			time.Sleep(4 * time.Second) // two lease TTLs: the other obs-a process takes over
			p.signal(syscall.SIGCONT)
			c.freezes++
			inv.expectLeaseLoss(p, before)
		case "kill-standby": // immediate stop while the readers read, then started again
			require.NoError(t, pair.Standby.Kill(ctx))
			sc.standbyKills++
			sleepRand(rng, 300, 3000)
			require.NoError(t, pair.Standby.StartServer(ctx))
		case "pause-replay": // the standby falls behind by more than ReadMaxLag, then catches up
			standbyExecCount(ctx, t, db.StandbyURL, `SELECT count(pg_wal_replay_pause())`)
			sc.replayPauses++
			sleepRand(rng, 1500, 3000)
			standbyExecCount(ctx, t, db.StandbyURL, `SELECT count(pg_wal_replay_resume())`)
		case "pg-restart": // the primary, once: the standby reconnects and streams on
			if c.pgRestarts > 0 {
				return
			}
			require.NoError(t, pair.Primary.Restart(ctx))
			c.pgRestarts++
		case "open-tx":
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			_, err = tx.Exec(ctx, `INSERT INTO settings (scope, key, value) VALUES ('faults', $1, 'open')`, fmt.Sprint(c.openTxs))
			require.NoError(t, err)
			c.openTxs++
			time.AfterFunc(time.Duration(3+rng.IntN(5))*time.Second, func() { _ = tx.Rollback(context.Background()) })
		case "sweep": // pruning on the primary while readers read its rows on the standby
			res, err := retention.Sweep(ctx)
			if err == nil {
				c.sweeps++
				require.NoError(t, inv.checkPruneFloor(ctx, res), "retention pruned past a live cursor")
			}
		}
	}
	begin := time.Now()
	mandatory := map[string]time.Duration{}
	for _, kind := range []string{"kill-observer", "kill-writer", "terminate", "terminate-standby", "freeze", "kill-standby", "pause-replay", "pg-restart", "open-tx", "sweep"} {
		mandatory[kind] = duration/10 + time.Duration(rng.Int64N(int64(duration*7/10)))
	}
	random := []string{"kill-observer", "kill-writer", "terminate-standby", "kill-standby", "pause-replay", "terminate", "sweep", "sweep"}
	for time.Since(begin) < duration {
		for _, p := range everyone() {
			p.checkAlive(t)
		}
		require.NoError(t, inv.sampleCursors(ctx))
		due := ""
		for kind, at := range mandatory {
			if time.Since(begin) >= at && (due == "" || at < mandatory[due]) {
				due = kind
			}
		}
		switch {
		case due != "":
			delete(mandatory, due)
			inject(due)
		case rng.IntN(3) == 0:
			inject(random[rng.IntN(len(random))])
		default:
			sleepRand(rng, 100, 600)
		}
	}
	for _, p := range everyone() {
		p.signal(syscall.SIGCONT)
		p.checkAlive(t)
	}
	require.NoError(t, inv.sampleCursors(ctx))
	// What the readers did on the standby before the failover: each left it (killed, paused,
	// terminated) and came back once it had caught up.
	before := readStats(readers)

	// The failover, with every process running: the primary stops (fast shutdown: it sends
	// the standby all its WAL first), the standby is checked to have replayed it, then
	// promoted.
	// The standby streams (a standby started again, or a primary restarted, reconnects within
	// wal_retrieve_retry_interval): a fast shutdown sends WAL only to a connected standby.
	require.NoError(t, awaitStreaming(ctx, pool), "harness: the standby is not streaming from the primary")
	t.Log("failover: stopping the primary")
	require.NoError(t, pair.Primary.StopServer(ctx))
	last := shutdownCheckpoint(ctx, t, pair.Primary)
	require.NoError(t, awaitReplayed(ctx, db.StandbyURL, last), "harness: the standby did not replay the stopped primary's last checkpoint")
	require.NoError(t, pair.Standby.Promote(ctx))
	promoted := db.StandbyURL
	newPool := pgtest.Pool(t, promoted)
	fresh, err := pgcluster.StartStandby(ctx, pair.Standby)
	require.NoError(t, err, "a standby of the promoted server")
	t.Cleanup(fresh.Stop) // before the pair's: its slot is dropped on the promoted server
	freshURL := fresh.URL(db.Name)
	inv.pool = newPool
	promotedOwner := map[*proc]string{} // each process's incarnation on the promoted server
	for _, p := range everyone() {
		p.kill(t)
		p.args.DSN = promoted
		if p.args.ReadDSN != "" && p.args.Scope == identities["obs-a"] {
			p.args.ReadDSN = freshURL
		}
		p.start(t)
		p.mu.Lock()
		promotedOwner[p] = p.owner
		p.mu.Unlock()
	}
	t.Logf("failover: every process restarted against the promoted server; obs-a reads from a fresh standby of it, obs-c from a promoted one")
	for end := time.Now().Add(after); time.Now().Before(end); time.Sleep(250 * time.Millisecond) {
		for _, p := range everyone() {
			p.checkAlive(t)
		}
		require.NoError(t, inv.sampleCursors(ctx))
	}

	// Calm: the writers stop, every identity catches up on the promoted server.
	for _, w := range writers {
		w.stop(t)
	}
	inv.awaitLeaseLosses(t)
	live := []string{"obs-a", "obs-b", "obs-c"}
	require.NoError(t, waitCaughtUp(ctx, newPool, live, len(projects)))
	final := readStats(readers)
	// Where the readers' incarnations on the promoted server read, as they last reported.
	onPromoted := func(p *proc) outbox.Stats {
		p.mu.Lock()
		defer p.mu.Unlock()
		return p.statsAt[promotedOwner[p]]
	}
	aFresh := []outbox.Stats{onPromoted(observers[0]), onPromoted(observers[1])}
	cPromoted := onPromoted(observers[3])
	for _, p := range observers {
		p.stop(t)
	}
	require.NoError(t, inv.sampleCursors(ctx))

	sum := inv.verify(ctx, t, observers, live, failing, map[string]bool{})
	fmt.Printf("faultsuite standby: seed=%d duration=%s written=%d observed=%s kills=%d restarts=%d terminations=%d freezes=%d pg_restarts=%d open_txs=%d sweeps=%d pruned=%d parked=%d duplicates_suppressed=%d lost=%d\n",
		seed, duration, sum.written, sum.observed, c.kills, c.restarts, c.terminations, c.freezes, c.pgRestarts, c.openTxs, c.sweeps,
		sum.pruned, sum.parked, sum.duplicates, sum.lost)
	fmt.Printf("faultsuite standby: standby_kills=%d replay_pauses=%d standby_terminations=%d; readers before the failover: %s; at the end: %s\n",
		sc.standbyKills, sc.replayPauses, sc.standbyTerminations, before, final)
	fmt.Printf("faultsuite standby: on the promoted server, obs-a1 scans=%d on_standby=%t, obs-a2 scans=%d on_standby=%t, obs-c1 scans=%d fallbacks=%d on_standby=%t\n",
		aFresh[0].Scans, aFresh[0].ReadingFromStandby, aFresh[1].Scans, aFresh[1].ReadingFromStandby, cPromoted.Scans, cPromoted.ReadFallbacks, cPromoted.ReadingFromStandby)
	require.Zero(t, sum.lost, "deletions lost")
	require.Positive(t, before.returns, "no reader ever went back to the standby: the standby was never read from after a fault")
	require.Positive(t, before.fallbacks, "no reader ever left the standby")
	// After the failover: obs-a's processes read from the fresh standby (at least one scanned
	// and still read there at the end), obs-c's refused its ReadDSN, the promoted server.
	require.True(t, (aFresh[0].Scans > 0 && aFresh[0].ReadingFromStandby) || (aFresh[1].Scans > 0 && aFresh[1].ReadingFromStandby),
		"obs-a did not read from the promoted server's fresh standby: %+v", aFresh)
	require.Positive(t, cPromoted.ReadFallbacks, "obs-c, whose ReadDSN names the promoted server, never refused it: %+v", cPromoted)
	require.False(t, cPromoted.ReadingFromStandby, "obs-c read from a promoted server as from a standby")
}

type standbyCounts struct {
	standbyKills, replayPauses, standbyTerminations int
}

// readerStats sums the readers' Stats over every incarnation that reported.
type readerStats struct {
	scans, fallbacks, returns, waits, conflicts int64
}

func (r readerStats) String() string {
	return fmt.Sprintf("scans=%d fallbacks=%d returns=%d standby_waits=%d recovery_conflicts=%d", r.scans, r.fallbacks, r.returns, r.waits, r.conflicts)
}

func readStats(ps []*proc) readerStats {
	var r readerStats
	for _, p := range ps {
		p.mu.Lock()
		for _, s := range p.statsAt {
			r.scans += s.Scans
			r.fallbacks += s.ReadFallbacks
			r.returns += s.ReadReturns
			r.waits += s.StandbyWaits
			r.conflicts += s.ReadConflicts
		}
		p.mu.Unlock()
	}
	return r
}

// standbyExecCount runs a statement returning one count on the server url names.
func standbyExecCount(ctx context.Context, t *testing.T, url, sql string, args ...any) int {
	t.Helper()
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(cctx, url)
	require.NoError(t, err)
	defer conn.Close(cctx)
	var n int
	require.NoError(t, conn.QueryRow(cctx, sql, args...).Scan(&n))
	return n
}

// shutdownCheckpoint reads a stopped cluster's last checkpoint location (pg_controldata): after
// a clean stop, the last record it wrote.
func shutdownCheckpoint(ctx context.Context, t *testing.T, c *pgcluster.Cluster) string {
	t.Helper()
	cmd := c.Command(ctx, "pg_controldata", "-D", c.DataDir())
	out, err := cmd.Output()
	require.NoError(t, err, "pg_controldata")
	for _, line := range strings.Split(string(out), "\n") {
		if v, ok := strings.CutPrefix(line, "Latest checkpoint location:"); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("pg_controldata printed no checkpoint location:\n%s", out)
	return ""
}

// awaitStreaming waits (a minute at most) until the primary pool is on has a standby streaming
// from it.
func awaitStreaming(ctx context.Context, pool *pgxpool.Pool) error {
	deadline := time.Now().Add(time.Minute)
	for {
		var n int
		err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'`).Scan(&n)
		if err == nil && n > 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("no standby streaming after a minute (last error: %v)", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// awaitReplayed waits (a minute at most) until the standby url names has replayed WAL up to lsn.
func awaitReplayed(ctx context.Context, url, lsn string) error {
	cctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	conn, err := pgx.Connect(cctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(cctx)
	for {
		var done bool
		if err := conn.QueryRow(cctx, `SELECT coalesce(pg_last_wal_replay_lsn() >= $1::text::pg_lsn, false)`, lsn).Scan(&done); err != nil {
			return err
		}
		if done {
			return nil
		}
		select {
		case <-cctx.Done():
			return fmt.Errorf("the standby did not replay %s within a minute", lsn)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

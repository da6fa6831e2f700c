// Package faultsuite is the multi-process fault suite: real OS processes (writers and
// observers built like engine binaries) share one real PostgreSQL while faults are injected at
// random, seeded and bounded; at the end the invariants are checked from the database and from
// every observer's own log. `make test` runs it for a minute; `make soak` for ten.
// TestFaultSuiteStandby (standby_test.go) runs it on a primary and a streaming hot standby of
// its own, observers reading from the standby, and ends with a failover.
package faultsuite

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
	"fusion/outbox/outboxtest"
)

func TestMain(m *testing.M) {
	if role := os.Getenv("FAULTSUITE_ROLE"); role != "" {
		os.Exit(runRole(role))
	}
	pgtest.Main(m)
}

// proc is one child process and what it reported.
type proc struct {
	name, role string
	args       roleArgs
	mu         sync.Mutex
	cmd        *exec.Cmd
	exited     chan error
	owner      string                  // lease owner token of the current incarnation
	stats      outbox.Stats            // latest stats line of the current incarnation
	lossesAt   map[string]int          // owner token -> lease losses reported by that incarnation
	statsAt    map[string]outbox.Stats // owner token -> latest stats of that incarnation
	done       bool                    // writer finished its list
	stopping   bool
	stdin      io.WriteCloser // the runtimes role's commands
	answers    chan string    // the runtimes role's answers ("added p", "removed p")
}

func (p *proc) start(t *testing.T) {
	t.Helper()
	// The arguments go through a file: a long run's task list is larger than the kernel lets
	// one environment string be.
	b, err := json.Marshal(p.args)
	require.NoError(t, err)
	argsFile := filepath.Join(filepath.Dir(p.args.Log), p.name+".args.json")
	require.NoError(t, os.WriteFile(argsFile, b, 0o644))
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "FAULTSUITE_ROLE="+p.role, "FAULTSUITE_ARGS_FILE="+argsFile)
	logFile, err := os.OpenFile(filepath.Join(filepath.Dir(p.args.Log), p.name+".stderr"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	require.NoError(t, err)
	cmd.Stderr = logFile
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	var stdin io.WriteCloser
	if p.role == "runtimes" {
		stdin, err = cmd.StdinPipe()
		require.NoError(t, err)
	}
	answers := make(chan string, 16)
	require.NoError(t, cmd.Start())
	ready := make(chan struct{})
	exited := make(chan error, 1)
	p.mu.Lock()
	p.cmd, p.exited, p.owner, p.stopping, p.stdin, p.answers = cmd, exited, "", false, stdin, answers
	p.mu.Unlock()
	go func() {
		sc := bufio.NewScanner(out)
		var once sync.Once
		for sc.Scan() {
			line := sc.Text()
			switch {
			case strings.HasPrefix(line, "ready"):
				p.mu.Lock()
				p.owner = strings.TrimSpace(strings.TrimPrefix(line, "ready"))
				p.mu.Unlock()
				once.Do(func() { close(ready) })
			case strings.HasPrefix(line, "stats "):
				var s outbox.Stats
				if json.Unmarshal([]byte(line[6:]), &s) == nil {
					p.mu.Lock()
					p.stats = s
					if p.lossesAt == nil {
						p.lossesAt = map[string]int{}
					}
					p.lossesAt[p.owner] = int(s.LeaseLosses)
					if p.statsAt == nil {
						p.statsAt = map[string]outbox.Stats{}
					}
					p.statsAt[p.owner] = s
					p.mu.Unlock()
				}
			case strings.HasPrefix(line, "added ") || strings.HasPrefix(line, "removed "):
				answers <- line
			case line == "done":
				p.mu.Lock()
				p.done = true
				p.mu.Unlock()
			}
		}
		exited <- cmd.Wait()
		_ = logFile.Close()
	}()
	select {
	case <-ready:
	case err := <-exited:
		exited <- err
		t.Fatalf("%s exited before it was ready: %v\n%s", p.name, err, p.stderrTail())
	case <-time.After(90 * time.Second):
		t.Fatalf("%s not ready", p.name)
	}
}

// stderrTail is the end of the child's stderr, or its data race report when there is one (the
// race detector exits with status 66).
func (p *proc) stderrTail() string {
	b, _ := os.ReadFile(filepath.Join(filepath.Dir(p.args.Log), p.name+".stderr"))
	if i := strings.Index(string(b), "WARNING: DATA RACE"); i >= 0 {
		b = b[i:]
	}
	if len(b) > 6000 {
		b = b[:6000]
	}
	return string(b)
}

func (p *proc) signal(sig syscall.Signal) {
	p.mu.Lock()
	defer p.mu.Unlock()
	_ = p.cmd.Process.Signal(sig)
}

func (p *proc) kill(t *testing.T) {
	p.mu.Lock()
	p.stopping = true
	p.mu.Unlock()
	p.signal(syscall.SIGKILL)
	<-p.exited
}

func (p *proc) stop(t *testing.T) {
	p.mu.Lock()
	p.stopping = true
	p.mu.Unlock()
	p.signal(syscall.SIGCONT)
	p.signal(syscall.SIGTERM)
	select {
	case err := <-p.exited:
		require.NoError(t, err, "%s did not stop cleanly:\n%s", p.name, p.stderrTail())
	case <-time.After(2 * time.Minute): // above the child's own minute to stop (stopApp)
		p.signal(syscall.SIGKILL)
		t.Fatalf("%s did not stop in time", p.name)
	}
}

// checkAlive fails the suite when a child died without being told to.
func (p *proc) checkAlive(t *testing.T) {
	p.mu.Lock()
	stopping := p.stopping
	p.mu.Unlock()
	select {
	case err := <-p.exited:
		if !stopping {
			t.Fatalf("%s died on its own: %v\n%s", p.name, err, p.stderrTail())
		}
		p.exited <- err
	default:
	}
}

type counts struct {
	kills, terminations, restarts, freezes, pgRestarts, openTxs, sweeps, childKills int
}

func TestFaultSuite(t *testing.T) {
	duration := time.Minute
	if s := os.Getenv("OUTBOX_SOAK"); s != "" {
		d, err := time.ParseDuration(s)
		require.NoError(t, err, "OUTBOX_SOAK")
		duration = d
	}
	runFaultSuite(t, duration, false)
}

// TestFaultSuiteThroughPgBouncer runs the suite once more, for half a minute, with every writer
// and observer going through PgBouncer in transaction mode (pgtest.Bouncer: two server
// connections for them all) and each observer's LISTEN connection straight to PostgreSQL
// (ListenDSN). The suite's own checks and faults use the server directly.
func TestFaultSuiteThroughPgBouncer(t *testing.T) {
	runFaultSuite(t, 30*time.Second, true)
}

// runFaultSuite runs the faults for duration; pooled sends the children through PgBouncer.
func runFaultSuite(t *testing.T, duration time.Duration, pooled bool) {
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("OUTBOX_FAULT_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		require.NoError(t, err, "OUTBOX_FAULT_SEED")
		seed = v
	}
	t.Logf("fault seed %d (OUTBOX_FAULT_SEED=%d reproduces the schedule), %s of faults", seed, seed, duration)
	rng := rand.New(rand.NewPCG(seed, seed^0x5eed))

	ctx, cancel := context.WithTimeout(context.Background(), duration+5*time.Minute)
	defer cancel()
	db := pgtest.NewDB(t)
	cluster := pgtest.Cluster(t)
	pool := pgtest.Pool(t, db.URL)
	dir := t.TempDir()
	childDSN, listenDSN := db.URL, ""
	if pooled {
		childDSN, listenDSN = pgtest.PooledURL(t, db), db.URL
		t.Logf("writers and observers go through PgBouncer at %s; observers LISTEN on PostgreSQL directly", childDSN)
	}

	// The world: four projects of tasks; three identities, one of them run by two processes
	// competing for its leases; one identity whose listener always fails on chosen tasks.
	projects := []string{"alpha", "beta", "gamma", "delta"}
	// More tasks than the writers (3 x 30/s) can delete in the window; they delete until the
	// window ends, and the database says what was committed.
	perProject := int(duration.Seconds()*25) + 50
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

	var writers, observers []*proc
	for i := range 3 {
		// Each writer gets its share plus a slice of another's, so some deletes race.
		share := all[i*len(all)/3 : (i+1)*len(all)/3]
		extra := all[((i+1)%3)*len(all)/3:][:len(all)/30]
		tasks := append(append([]string(nil), share...), extra...)
		writers = append(writers, &proc{name: fmt.Sprintf("writer-%d", i+1), role: "writer", args: roleArgs{
			Name: fmt.Sprintf("writer-%d", i+1), DSN: childDSN, Pooled: pooled, Scope: "writers", Projects: projects,
			Tasks: tasks, Rate: 30, Log: filepath.Join(dir, fmt.Sprintf("writer-%d.log", i+1))}})
	}
	for _, spec := range []struct {
		name, identity string
		failing        []string
	}{{"obs-a1", "obs-a", nil}, {"obs-a2", "obs-a", nil}, {"obs-b1", "obs-b", failing}, {"obs-c1", "obs-c", nil}} {
		observers = append(observers, &proc{name: spec.name, role: "observer", args: roleArgs{
			Name: spec.name, DSN: childDSN, ListenDSN: listenDSN, Pooled: pooled, Scope: identities[spec.identity], Projects: projects,
			Log: filepath.Join(dir, spec.name+".log"), Failing: spec.failing}})
	}
	// A child worker of obs-b1, fed over obs-b1's unix socket: the schedule kills and restarts
	// it, and kills obs-b1 under it.
	worker := &proc{name: "worker-b1", role: "child", args: roleArgs{Name: "worker-b1", Socket: filepath.Join(dir, "b1.sock"),
		Positions: filepath.Join(dir, "worker-b1.pos"), Log: filepath.Join(dir, "worker-b1.log")}}
	observers[2].args.ChildSocket = worker.args.Socket
	everyone := func() []*proc { return append(append([]*proc{worker}, observers...), writers...) }
	for _, p := range append(append(append([]*proc(nil), observers...), worker), writers...) {
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
	retention, err := outbox.NewRetention(pool, outbox.Config{Clock: aheadClock(), RetentionBatchSize: 500}, nil, nil)
	require.NoError(t, err)
	retired := map[string]bool{}

	// The fault loop: every kind of fault at least once, at a seeded time, and random faults
	// in between.
	inject := func(kind string) {
		switch kind {
		case "kill-observer", "kill-writer": // SIGKILL, then restart
			group := observers
			if kind == "kill-writer" {
				group = writers
			}
			p := group[rng.IntN(len(group))]
			if retired[p.args.Scope] || p.isDone() {
				return
			}
			p.kill(t)
			c.kills++
			sleepRand(rng, 100, 1500)
			p.start(t)
			c.restarts++
		case "kill-parent": // obs-b1 under its live worker, which reconnects to the new process
			p := observers[2]
			p.kill(t)
			c.kills++
			sleepRand(rng, 100, 1500)
			p.start(t)
			c.restarts++
		case "kill-child": // the worker, SIGKILLed mid-stream, then restarted
			worker.kill(t)
			c.childKills++
			sleepRand(rng, 100, 1500)
			worker.start(t)
		case "terminate": // an observer's backends, its LISTEN connection among them
			p := observers[rng.IntN(len(observers))]
			var n int
			require.NoError(t, pool.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
				WHERE datname = current_database() AND application_name = $1`, p.name).Scan(&n))
			c.terminations += n
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
		case "pg-restart":
			if c.pgRestarts > int(duration/(2*time.Minute)) {
				return // at most one every two minutes of faults, beyond the first
			}
			if cluster == nil {
				t.Log("not a throwaway cluster: the PostgreSQL restart fault is not available")
				return
			}
			require.NoError(t, cluster.Restart(ctx))
			c.pgRestarts++
		case "open-tx": // a long unrelated open write must not hold delivery back
			tx, err := pool.Begin(ctx)
			require.NoError(t, err)
			_, err = tx.Exec(ctx, `INSERT INTO settings (scope, key, value) VALUES ('faults', $1, 'open')`, fmt.Sprint(c.openTxs))
			require.NoError(t, err)
			c.openTxs++
			time.AfterFunc(time.Duration(5+rng.IntN(10))*time.Second, func() { _ = tx.Rollback(context.Background()) })
		case "sweep":
			res, err := retention.Sweep(ctx)
			if err == nil {
				c.sweeps++
				require.NoError(t, inv.checkPruneFloor(ctx, res), "retention pruned past a live cursor")
			}
		case "retire": // obs-c, for good and audited: it stops holding back pruning
			if retired["node-c"] {
				return
			}
			observers[3].stop(t)
			_, err := outbox.NewAdmin(pool, outbox.AdminOptions{}).RetireConsumer(ctx, outbox.RetireRequest{ConsumerID: "obs-c",
				Operator: outbox.Operator{Actor: "faultsuite", Reason: "FAULT-1"}})
			require.NoError(t, err)
			retired["node-c"] = true
		}
	}
	begin := time.Now()
	mandatory := map[string]time.Duration{}
	for _, kind := range []string{"kill-observer", "kill-writer", "kill-parent", "kill-child", "terminate", "freeze", "pg-restart", "open-tx", "sweep", "retire"} {
		mandatory[kind] = duration/10 + time.Duration(rng.Int64N(int64(duration*7/10)))
	}
	random := []string{"kill-observer", "kill-observer", "kill-writer", "kill-child", "terminate", "terminate", "freeze", "sweep", "sweep", "open-tx", "pg-restart"}
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

	// Calm: the writers stop, every process runs, every live identity catches up.
	for _, p := range everyone() {
		p.signal(syscall.SIGCONT)
		p.checkAlive(t)
	}
	for _, w := range writers {
		w.stop(t)
	}
	inv.awaitLeaseLosses(t)
	live := []string{"obs-a", "obs-b"}
	if !retired["node-c"] {
		live = append(live, "obs-c")
	}
	require.NoError(t, waitCaughtUp(ctx, pool, live, len(projects)))
	require.NoError(t, waitWorkerCaughtUp(ctx, pool, worker.args.Positions, "obs-b", projects))
	worker.stop(t)
	for _, p := range observers {
		if !retired[p.args.Scope] {
			p.stop(t)
		}
	}
	require.NoError(t, inv.sampleCursors(ctx))

	sum := inv.verify(ctx, t, observers, live, failing, retired)
	ws, err := readWorkerLog(worker.args.Log)
	require.NoError(t, err)
	fmt.Printf("faultsuite: seed=%d duration=%s written=%d observed=%s kills=%d restarts=%d terminations=%d freezes=%d pg_restarts=%d open_txs=%d sweeps=%d pruned=%d parked=%d duplicates_suppressed=%d lost=%d\n",
		seed, duration, sum.written, sum.observed, c.kills, c.restarts, c.terminations, c.freezes, c.pgRestarts, c.openTxs, c.sweeps,
		sum.pruned, sum.parked, sum.duplicates, sum.lost)
	fmt.Printf("faultsuite: worker-b1 (child of obs-b1 over its unix socket) kills=%d applied=%d redelivered=%d resets=%d gaps_without_reset=%d fence_violations=%d\n",
		c.childKills, ws.applied, ws.redelivered, ws.resets, ws.gaps, ws.fenceViolations)
	require.Zero(t, sum.lost, "deletions lost")
	require.Zero(t, ws.gaps, "the child worker skipped events without a reset")
	require.Zero(t, ws.fenceViolations, "the child worker performed a writer-owned side effect")
	require.Positive(t, ws.applied, "the child worker applied nothing")
}

func sleepRand(rng *rand.Rand, minMs, maxMs int) {
	time.Sleep(time.Duration(minMs+rng.IntN(maxMs-minMs)) * time.Millisecond)
}

func (p *proc) isDone() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.done
}

func (p *proc) leaseLosses() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.lossesAt[p.owner]
}

// aheadClock makes retention see every row as older than the window, so the suite prunes
// whatever every live consumer has acknowledged.
func aheadClock() *outboxtest.FakeClock {
	c := outboxtest.NewFakeClock()
	c.Advance(365 * 24 * time.Hour)
	return c
}

// leaseHolder returns a process of obs-a that holds at least one lease now.
func leaseHolder(ctx context.Context, t *testing.T, pool *pgxpool.Pool, candidates []*proc) *proc {
	rows, err := pool.Query(ctx, `SELECT DISTINCT lease_owner FROM lifecycle_consumer_cursors
		WHERE consumer_id = 'obs-a' AND lease_owner IS NOT NULL AND lease_expires_at > now()`)
	require.NoError(t, err)
	defer rows.Close()
	owners := map[string]bool{}
	for rows.Next() {
		var o string
		require.NoError(t, rows.Scan(&o))
		owners[o] = true
	}
	for _, p := range candidates {
		p.mu.Lock()
		owner := p.owner
		p.mu.Unlock()
		if owners[owner] {
			return p
		}
	}
	return nil
}

// waitCaughtUp waits until every live identity has a cursor at the head of every project and
// no retry is pending.
func waitCaughtUp(ctx context.Context, pool *pgxpool.Pool, live []string, projects int) error {
	admin := outbox.NewAdmin(pool, outbox.AdminOptions{})
	deadline := time.Now().Add(3 * time.Minute)
	for {
		// A tick numbers whatever committed since the consumers' ticker last ticked.
		if _, err := outbox.Tick(ctx, pool); err != nil {
			return err
		}
		st, err := admin.Status(ctx, outbox.StatusFilter{})
		if err != nil {
			return err
		}
		caught := 0
		for _, s := range st {
			for _, id := range live {
				if s.ConsumerID == id && s.LagEvents == 0 && s.Retrying == 0 && s.Cursor != nil {
					caught++
				}
			}
		}
		if caught == len(live)*projects {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("consumers did not catch up: %+v", st)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

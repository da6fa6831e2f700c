package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"fusion/outbox"
)

func init() {
	register(benchCase{name: "standby", usage: "the primary's server CPU per delete at a steady delete rate while K consumers read from the primary or from a streaming standby, beside the hook and ticker with no consumer; delivery and replay lag",
		flags: func(fs *flag.FlagSet) runner {
			o := defaultStandbyOpts()
			fs.StringVar(&o.consumers, "consumers", o.consumers, "consumer counts K; each is run reading from the primary and from the standby")
			fs.IntVar(&o.rate, "rate", o.rate, "deletes per second asked of the writers")
			fs.IntVar(&o.writers, "writers", o.writers, "writer goroutines sharing the schedule")
			fs.IntVar(&o.projects, "projects", o.projects, "projects the deletes spread over")
			fs.Float64Var(&o.seconds, "seconds", o.seconds, "length of each run at the rate asked (rate x seconds deletes; longer when the writers fall behind)")
			fs.IntVar(&o.rounds, "rounds", o.rounds, "times the whole set of runs is repeated, interleaved (the machine is noisy)")
			fs.BoolVar(&o.oneProcess, "one-process", o.oneProcess, "run the K consumers as one process would: on one shared pool, so that they share one LISTEN connection, one standby pool and their reads")
			return func(ctx context.Context, env *Env, emit func(any) error) error {
				return runStandbyCurve(ctx, env, o, emit)
			}
		}})
}

// Where the consumers of a standby run read.
const (
	readFromPrimary = "primary"
	readFromStandby = "standby"
	// readFromNone is the run without consumers: the writers with the hook and one process
	// that only ticks (a consumer of no project), the reference of issue 33's 1.1x goal.
	readFromNone = "none"
)

type standbyOpts struct {
	consumers                       string
	rate, writers, projects, rounds int
	seconds                         float64
	oneProcess                      bool
}

func defaultStandbyOpts() standbyOpts {
	return standbyOpts{consumers: "1,4,16", rate: 1000, writers: 16, projects: 16, seconds: 15, rounds: 1}
}

// standbyResult is one run of the standby case: one K, one source.
type standbyResult struct {
	Header
	Round     int     `json:"round"`
	Consumers int     `json:"consumers"`
	ReadFrom  string  `json:"read_from"`
	Rate      int     `json:"rate"`
	Writers   int     `json:"writers"`
	Projects  int     `json:"projects"`
	Seconds   float64 `json:"seconds"`
	// OneProcess: the K consumers shared one pool, as consumers of one process do (one LISTEN
	// connection, one standby pool, shared reads); SharedReads counts what they shared.
	OneProcess  bool  `json:"one_process,omitempty"`
	SharedReads int64 `json:"shared_reads,omitempty"`
	Tx          int64 `json:"tx"`
	Errors      int64 `json:"errors"`
	// AchievedRate is tx over the sending time: below Rate, the writers could not keep up.
	AchievedRate float64 `json:"achieved_rate"`
	// Server CPU per delete over the run (postmaster and children, from /proc): the primary's
	// (its WAL sender included) and the standby's; client_cpu_us_per_tx is this process's
	// (writers, consumers, driver).
	ServerCPUPerTx        float64 `json:"server_cpu_us_per_tx"`
	StandbyServerCPUPerTx float64 `json:"standby_server_cpu_us_per_tx"`
	ClientCPUPerTx        float64 `json:"client_cpu_us_per_tx"`
	// CPUVsNoConsumers is server_cpu_us_per_tx over that of the same round's run without
	// consumers (issue 33's goal: at most 1.1 with 16 consumers on the standby).
	CPUVsNoConsumers float64 `json:"cpu_vs_no_consumers,omitempty"`
	// Commit-to-delivery lag at the last of the K consumers (as in sustained), and what they
	// received.
	LagP50MS   float64 `json:"lag_p50_ms"`
	LagP99MS   float64 `json:"lag_p99_ms"`
	LagMaxMS   float64 `json:"lag_max_ms"`
	Received   int     `json:"received"`
	Duplicates int     `json:"duplicates"`
	Missing    int     `json:"missing"`
	// The standby's replay lag, sampled every 50 ms on the standby as the age of the last
	// commit it replayed (now() - pg_last_xact_replay_timestamp(), one clock): at a steady
	// rate, how far replay runs behind the primary's commits, plus up to one commit gap.
	ReplayLagP50MS float64 `json:"replay_lag_p50_ms"`
	ReplayLagP99MS float64 `json:"replay_lag_p99_ms"`
	ReplayLagMaxMS float64 `json:"replay_lag_max_ms"`
	// What the consumers sent the primary over the run (pg_stat_statements, top-level
	// statements of the consumer role: ticks, heads, open deliveries, reads, acknowledgements,
	// leases), their scans (Stats), and the reads of open deliveries among those statements.
	Scans                     int64   `json:"scans"`
	PrimaryConsumerStatements int64   `json:"primary_consumer_statements"`
	PrimaryStatementsPerScan  float64 `json:"primary_statements_per_scan"`
	PrimaryOpenReads          int64   `json:"primary_open_reads"`
	// Their executor time (pg_stat_statements total_exec_time): all of them, and the reads of
	// open deliveries.
	PrimaryConsumerExecMS  float64 `json:"primary_consumer_exec_ms"`
	PrimaryOpenReadsExecMS float64 `json:"primary_open_reads_exec_ms"`
	StatementsSource       string  `json:"statements_source"`
	ReadFallbacks          int64   `json:"read_fallbacks,omitempty"`
	ReadReturns            int64   `json:"read_returns,omitempty"`
	StandbyWaits           int64   `json:"standby_waits,omitempty"`
	ReadConflicts          int64   `json:"read_conflicts,omitempty"`
	TimedOut               bool    `json:"timed_out,omitempty"`
}

// standbyRun is one run's place in the schedule.
type standbyRun struct {
	k    int
	from string
}

// standbySchedule is the order of one round: the run without consumers first, then each K
// from the primary and from the standby, which of the two goes first alternating by K and by
// round, so that a drift of the machine's load weighs on both.
func standbySchedule(ks []int, round int) []standbyRun {
	out := []standbyRun{{0, readFromNone}}
	for i, k := range ks {
		pair := []standbyRun{{k, readFromPrimary}, {k, readFromStandby}}
		if (i+round)%2 == 1 {
			pair[0], pair[1] = pair[1], pair[0]
		}
		out = append(out, pair...)
	}
	return out
}

// runStandbyCurve starts one streaming hot standby of the throwaway cluster and runs the
// schedule on it, rounds times, a fresh database per run; the standby replicates every run,
// whoever reads from it, so the primary's WAL sender is in every figure.
func runStandbyCurve(ctx context.Context, env *Env, o standbyOpts, emit func(any) error) error {
	var ks []int
	for _, s := range splitList(o.consumers) {
		k, err := strconv.Atoi(s)
		if err != nil || k < 1 {
			return fmt.Errorf("standby: -consumers: %q is not a count >= 1", s)
		}
		ks = append(ks, k)
	}
	if len(ks) == 0 || o.rate < 1 || o.writers < 1 || o.projects < 1 || o.seconds <= 0 || o.rounds < 1 {
		return errors.New("standby: need consumers, rate, writers, projects, rounds >= 1 and seconds > 0")
	}
	sb, err := env.StartStandby(ctx)
	if err != nil {
		return err
	}
	defer sb.Stop()
	for round := 1; round <= o.rounds; round++ {
		var none float64
		for _, r := range standbySchedule(ks, round) {
			res, err := runStandbyPoint(ctx, env, o, sb.SocketDir(), r)
			if err != nil {
				return err
			}
			res.Round = round
			if r.from == readFromNone {
				none = res.ServerCPUPerTx
			} else if none > 0 {
				res.CPUVsNoConsumers = round3(res.ServerCPUPerTx / none)
			}
			if err := emit(res); err != nil {
				return err
			}
		}
	}
	return nil
}

// runStandbyPoint runs one K and source: a fresh database with the host's tasks (replicated to
// the standby before anything starts), the consumers (or the ticking process alone), then the
// writers at the rate for the run's length while the servers' CPU and the replay lag are
// measured, then the catch-up.
func runStandbyPoint(ctx context.Context, env *Env, o standbyOpts, standbyHost string, r standbyRun) (standbyResult, error) {
	res := standbyResult{Header: env.Header("standby"), Consumers: r.k, ReadFrom: r.from, Rate: o.rate, Writers: o.writers,
		Projects: o.projects, Seconds: o.seconds}
	tasks := int(float64(o.rate)*o.seconds) + o.projects
	ob, err := newSustainedDB(ctx, env, "standby_"+r.from, sustainedOpts{writers: o.writers, projects: o.projects, tasks: tasks,
		mailbox: mailboxIncluded}, true)
	if err != nil {
		return res, err
	}
	defer ob.Close()
	sbPool, err := ob.db.SuperuserPoolOn(ctx, standbyHost, 2)
	if err != nil {
		return res, err
	}
	defer sbPool.Close()
	if err := awaitReplay(ctx, ob.admin, sbPool, time.Minute); err != nil {
		return res, err
	}
	standbyServer := findServer(ctx, sbPool)

	projects := make([]string, o.projects)
	for p := range projects {
		projects[p] = projectName(p)
	}
	var specs []consumerSpec
	var trackers []*indexTracker
	var ids []string
	if r.k == 0 {
		// One process that only ticks: a consumer of no project elects itself ticker and
		// numbers what the writers commit, scanning nothing.
		specs = []consumerSpec{{id: "bench-standby-ticker", projects: []string{}}}
	}
	for k := range r.k {
		tr := newTimedTracker("t", tasks)
		trackers = append(trackers, tr)
		ids = append(ids, fmt.Sprintf("bench-standby-%d", k))
		spec := consumerSpec{id: ids[k], projects: projects, listeners: []outbox.Listener{tr.listener()}}
		if r.from == readFromStandby {
			spec.cfg.ReadDSN = ob.db.ConsumerDSNOn(standbyHost)
		}
		specs = append(specs, spec)
	}
	if o.oneProcess && r.k > 0 {
		shared, err := onOnePool(ctx, ob.db, specs)
		if err != nil {
			return res, err
		}
		defer shared.Close()
		res.OneProcess = true
	}
	env.Logf("standby: %d consumers reading from %s, %d deletes/s for %gs", r.k, r.from, o.rate, o.seconds)
	consumers, err := startConsumers(ctx, ob.db, specs)
	if err != nil {
		return res, err
	}
	stopped := false
	stopConsumers := func() {
		if !stopped {
			stopped = true
			closeConsumers(consumers)
		}
	}
	defer stopConsumers()
	if len(ids) > 0 {
		if err := waitPositioned(ctx, outbox.NewAdmin(ob.admin, outbox.AdminOptions{}), ids, len(ids)*o.projects, time.Minute); err != nil {
			return res, fmt.Errorf("standby: %w", err)
		}
	}
	stats := openStatStatements(ctx, ob.admin)
	if _, err := ob.admin.Exec(ctx, "CHECKPOINT"); err != nil {
		return res, fmt.Errorf("checkpoint: %w", err)
	}
	before := sumStats(consumers)
	if stats.ok {
		if err := stats.reset(ctx); err != nil {
			return res, err
		}
	}
	replay := sampleReplayLag(ctx, sbPool, 50*time.Millisecond, time.Now())
	cpu, sbCPU := startCPU(ob.server), startCPU(standbyServer)
	run := ob.queue.runPaced(ctx, ob.del, o.writers, o.rate, time.Duration(o.seconds*float64(time.Second)))
	client, server := cpu.Stop()
	_, sbServer := sbCPU.Stop()
	lags := replay.stop()
	after := sumStats(consumers)
	if run.firstEr != nil {
		env.Logf("standby: first error: %v", run.firstEr)
	}
	res.Tx, res.Errors, res.AchievedRate = run.tx, run.errors, perSecond(run.tx, run.elapsed)
	if run.tx > 0 {
		res.ServerCPUPerTx = round1(float64(server/time.Microsecond) / float64(run.tx))
		res.StandbyServerCPUPerTx = round1(float64(sbServer/time.Microsecond) / float64(run.tx))
		res.ClientCPUPerTx = round1(float64(client/time.Microsecond) / float64(run.tx))
	}
	rl := summarize(lags)
	res.ReplayLagP50MS, res.ReplayLagP99MS, res.ReplayLagMaxMS = rl.P50, rl.P99, rl.Max
	res.Scans = after.Scans - before.Scans
	res.ReadFallbacks, res.ReadReturns = after.ReadFallbacks-before.ReadFallbacks, after.ReadReturns-before.ReadReturns
	res.StandbyWaits, res.ReadConflicts = after.StandbyWaits-before.StandbyWaits, after.ReadConflicts-before.ReadConflicts
	res.SharedReads = after.SharedReads - before.SharedReads
	if stats.ok {
		cc, err := consumerCalls(ctx, ob.admin, ob.db.consumer.name)
		if err != nil {
			return res, err
		}
		calls := cc.calls
		res.PrimaryConsumerStatements, res.PrimaryOpenReads = cc.calls, cc.opens
		res.PrimaryConsumerExecMS, res.PrimaryOpenReadsExecMS = round3(cc.execMS), round3(cc.openExecMS)
		res.StatementsSource = "pg_stat_statements, the consumer role's top-level statements"
		if res.Scans > 0 {
			res.PrimaryStatementsPerScan = round3(float64(calls) / float64(res.Scans))
		}
	} else {
		res.StatementsSource = "unavailable: pg_stat_statements: " + stats.why
	}

	// Catch-up, then each event's latest arrival across the consumers.
	committed := ob.queue.commits
	deadline := time.Now().Add(drainTimeout(int(run.tx) * max(r.k, 1)))
	for len(trackers) > 0 {
		missing := 0
		for _, tr := range trackers {
			missing += tr.missingOf(committed)
		}
		if missing == 0 {
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			res.TimedOut = true
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	stopConsumers()
	latest := make([]int64, len(committed))
	reached := make([]int, len(committed))
	for _, tr := range trackers {
		received, dups, _, _ := tr.Counts()
		res.Received += received
		res.Duplicates += dups
		res.Missing += tr.missingOf(committed)
		for i, at := range tr.arrivals() {
			if i < len(committed) && at != 0 && committed[i] != 0 {
				latest[i] = max(latest[i], at)
				reached[i]++
			}
		}
	}
	var delivery []time.Duration
	for i, c := range committed {
		if c != 0 && r.k > 0 && reached[i] == r.k {
			delivery = append(delivery, time.Duration(latest[i]-c))
		}
	}
	l := summarize(delivery)
	res.LagP50MS, res.LagP99MS, res.LagMaxMS = l.P50, l.P99, l.Max
	return res, ctx.Err()
}

// sumStats adds up the consumers' Stats fields the standby case reports.
func sumStats(cs []*runningConsumer) outbox.Stats {
	var s outbox.Stats
	for _, c := range cs {
		st := c.Stats()
		s.Scans += st.Scans
		s.ReadFallbacks += st.ReadFallbacks
		s.ReadReturns += st.ReadReturns
		s.StandbyWaits += st.StandbyWaits
		s.ReadConflicts += st.ReadConflicts
		s.SharedReads += st.SharedReads
	}
	return s
}

// consumerCallsSQL counts the consumer role's top-level statements in this database since the
// last reset, and among them the reads of open deliveries (openDeliveriesSQL, alone or with
// the primary's newest tick), with their executor time. Those reads are matched by a part of
// their text that pg_stat_statements' normalising (constants become $n) leaves alone.
const consumerCallsSQL = `
SELECT coalesce(sum(s.calls) FILTER (WHERE s.toplevel), 0)::bigint,
       coalesce(sum(s.calls) FILTER (WHERE s.toplevel AND s.query LIKE '%least(next_attempt_at, last_failed_at%'), 0)::bigint,
       coalesce(sum(s.total_exec_time) FILTER (WHERE s.toplevel), 0),
       coalesce(sum(s.total_exec_time) FILTER (WHERE s.toplevel AND s.query LIKE '%least(next_attempt_at, last_failed_at%'), 0)
FROM pg_stat_statements s
WHERE s.dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND s.userid = (SELECT r.oid FROM pg_roles r WHERE r.rolname = $1)`

// consumerStatements is what consumerCallsSQL returns.
type consumerStatements struct {
	calls, opens       int64
	execMS, openExecMS float64
}

func consumerCalls(ctx context.Context, pool *pgxpool.Pool, role string) (consumerStatements, error) {
	var c consumerStatements
	if err := pool.QueryRow(ctx, consumerCallsSQL, role).Scan(&c.calls, &c.opens, &c.execMS, &c.openExecMS); err != nil {
		return c, fmt.Errorf("read pg_stat_statements: %w", err)
	}
	return c, nil
}

// awaitReplay waits until the standby (sb) has replayed all the WAL the primary had written
// when it was called: the database and its tasks are there before the consumers start.
func awaitReplay(ctx context.Context, primary, sb *pgxpool.Pool, timeout time.Duration) error {
	var lsn string
	if err := primary.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn()::text`).Scan(&lsn); err != nil {
		return fmt.Errorf("read the primary's WAL position: %w", err)
	}
	deadline := time.Now().Add(timeout)
	for {
		var done bool
		err := sb.QueryRow(ctx, `SELECT coalesce(pg_last_wal_replay_lsn() >= $1::text::pg_lsn, false)`, lsn).Scan(&done)
		if err == nil && done {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("the standby did not replay %s within %s (last error: %v)", lsn, timeout, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// replaySampler samples the standby's replay lag until stopped.
type replaySampler struct {
	stopCh  chan struct{}
	done    chan struct{}
	samples []time.Duration
}

// sampleReplayLag takes a sample every period, counting only commits replayed that were made
// after since (before the writers start, the last commit replayed may be seconds old).
func sampleReplayLag(ctx context.Context, sb *pgxpool.Pool, every time.Duration, since time.Time) *replaySampler {
	s := &replaySampler{stopCh: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-s.stopCh:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			var us *int64
			err := sb.QueryRow(ctx, `SELECT (extract(epoch FROM now() - t) * 1e6)::bigint
FROM (SELECT pg_last_xact_replay_timestamp() AS t) r WHERE t >= $1`, since).Scan(&us)
			if err == nil && us != nil {
				s.samples = append(s.samples, time.Duration(max(*us, 0))*time.Microsecond)
			}
		}
	}()
	return s
}

func (s *replaySampler) stop() []time.Duration {
	close(s.stopCh)
	<-s.done
	out := append([]time.Duration(nil), s.samples...)
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// runPaced deletes at rate per second on writers goroutines sharing one schedule (task i is
// due i/rate after the start): every task due within d, or until the tasks run out. Writers
// that fall behind take the next due task at once, so the run then lasts longer than d, and
// the achieved rate says whether they kept up.
func (q *taskQueue) runPaced(ctx context.Context, del deleteFunc, writers, rate int, d time.Duration) deleteRun {
	type part struct {
		calls []time.Duration
		errs  int64
		first error
	}
	parts := make([]part, writers)
	jobs := make(chan int, writers)
	started := time.Now()
	deadline := started.Add(d)
	period := time.Duration(float64(time.Second) / float64(rate))
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := &parts[w]
			for i := range jobs {
				sctx, st := withStamps(ctx)
				t0 := time.Now()
				_, err := del(sctx, q.jobs[i])
				end := time.Now()
				if err != nil {
					p.errs++
					if p.first == nil {
						p.first = err
					}
					continue
				}
				p.calls = append(p.calls, end.Sub(t0))
				c := st.commit
				if c.IsZero() {
					c = end
				}
				q.commits[i] = c.UnixNano()
			}
		}()
	}
	for n := 0; ctx.Err() == nil; n++ {
		due := started.Add(time.Duration(n) * period)
		if !due.Before(deadline) {
			break
		}
		if wait := time.Until(due); wait > 0 {
			time.Sleep(wait)
		}
		i := int(q.next.Add(1))
		if i >= len(q.jobs) {
			q.exhausted.Store(true)
			break
		}
		jobs <- i
	}
	close(jobs)
	wg.Wait()
	r := deleteRun{elapsed: time.Since(started)}
	for _, p := range parts {
		r.tx += int64(len(p.calls))
		r.errors += p.errs
		r.calls = append(r.calls, p.calls...)
		if r.firstEr == nil {
			r.firstEr = p.first
		}
	}
	return r
}

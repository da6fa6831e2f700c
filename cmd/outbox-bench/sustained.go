package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"fusion/outbox"
)

func init() {
	register(benchCase{name: "sustained", usage: "host deletes at full speed while K consumers observe, against the same writers without the outbox",
		flags: func(fs *flag.FlagSet) runner {
			o := sustainedOpts{writers: 16, consumers: 2, projects: 16, seconds: 20, tasks: 400000, mailbox: mailboxIncluded}
			fs.IntVar(&o.writers, "writers", o.writers, "writer goroutines deleting through the reference host")
			fs.IntVar(&o.consumers, "consumers", o.consumers, "durable consumers (distinct identities, one pool each) observing every project")
			fs.IntVar(&o.projects, "projects", o.projects, "projects the deletes spread over")
			fs.Float64Var(&o.seconds, "seconds", o.seconds, "length of the measured phase with the outbox; the baseline runs as long, in two halves around it")
			fs.IntVar(&o.tasks, "tasks", o.tasks, "live tasks created in each database (the writers stop early, and the line says so, if they run out)")
			fs.StringVar(&o.mailbox, "mailbox", o.mailbox, `"included": the host's post-commit mailbox notice as it writes it; "excluded": it commits nothing on either side`)
			fs.BoolVar(&o.oneProcess, "one-process", o.oneProcess, "run the consumers as one process would: on one shared pool, so that they share their reads of heads and first batches (Stats.SharedReads)")
			fs.DurationVar(&o.tickBusyWait, "tick-busy-wait", 0, "the consumers' Config.TickBusyWait (0: the default); the line says it when set")
			fs.DurationVar(&o.tickFloor, "tick-floor", 0, "the consumers' Config.TickFloor (0: the default); the line says it when set")
			fs.BoolVar(&o.standby, "standby", o.standby, "start a streaming hot standby of the throwaway cluster and have the consumers read from it (Config.ReadDSN); server CPU stays the primary's, the standby's is reported beside it")
			return one(func(ctx context.Context, env *Env) (sustainedResult, error) { return runSustained(ctx, env, o) })
		}})
}

type sustainedOpts struct {
	writers, consumers, projects, tasks int
	seconds                             float64
	mailbox                             string
	standby, oneProcess                 bool
	tickBusyWait, tickFloor             time.Duration
}

type sustainedResult struct {
	Header
	Writers   int     `json:"writers"`
	Consumers int     `json:"consumers"`
	Projects  int     `json:"projects"`
	Seconds   float64 `json:"seconds"`
	Mailbox   string  `json:"mailbox"`
	// TickBusyWaitMS is the consumers' Config.TickBusyWait when -tick-busy-wait set it.
	TickBusyWaitMS float64 `json:"tick_busy_wait_ms,omitempty"`
	// TickFloorMS is the consumers' Config.TickFloor when -tick-floor set it.
	TickFloorMS float64 `json:"tick_floor_ms,omitempty"`
	// OneProcess: the consumers shared one pool, as consumers of one process do; SharedReads
	// counts the reads they took from one another's statements.
	OneProcess  bool  `json:"one_process,omitempty"`
	SharedReads int64 `json:"shared_reads,omitempty"`
	// The same writers without the outbox and without consumers, on their own database, in
	// two halves of seconds/2: one before the outbox phase, one after it.
	BaselineTx     int64   `json:"baseline_tx"`
	BaselineTxPerS float64 `json:"baseline_tx_per_s"`
	// The writers with the hook (wake-ups on) while the consumers observe.
	Tx     int64   `json:"tx"`
	TxPerS float64 `json:"tx_per_s"`
	// Ratio is tx_per_s / baseline_tx_per_s.
	Ratio  float64 `json:"ratio"`
	Errors int64   `json:"errors"`
	// Store.Delete call latency on each side.
	DeleteP50MS         float64 `json:"delete_p50_ms"`
	DeleteP99MS         float64 `json:"delete_p99_ms"`
	BaselineDeleteP50MS float64 `json:"baseline_delete_p50_ms"`
	BaselineDeleteP99MS float64 `json:"baseline_delete_p99_ms"`
	// Lag runs from the instant a delete's COMMIT returned in its writer (stampTracer) to the
	// event's arrival at the last of the K consumers: one sample per event, its latest arrival
	// across consumers, so it is the time until every consumer had it. Events that did not
	// reach every consumer are counted in missing and give no sample.
	LagP50MS float64 `json:"lag_p50_ms"`
	LagP99MS float64 `json:"lag_p99_ms"`
	LagMaxMS float64 `json:"lag_max_ms"`
	// Deliveries counted by the consumers' listeners, summed over the K consumers: received
	// counts every delivery, duplicates the repeated ones, and missing the committed events a
	// consumer still lacked when the catch-up deadline passed.
	Received   int `json:"received"`
	Duplicates int `json:"duplicates"`
	Missing    int `json:"missing"`
	Unexpected int `json:"unexpected,omitempty"`
	// CatchUpSeconds is how long, after the writers stopped, the last consumer took to have
	// every committed event.
	CatchUpSeconds float64 `json:"catch_up_seconds"`
	// NumberingShare is numbering's summed execution time over the outbox phase
	// (pg_stat_statements total_exec_time of the top-level statements calling
	// lifecycle_outbox_tick or lifecycle_outbox_read, from every consumer: the ticks that count
	// the events and the reads that rank them) divided by the CPU time every server process
	// used in that phase (the postmaster and its children, from /proc). It is executor time,
	// not CPU time: lock and I/O waits inside the calls count, which overstates the calls' own
	// CPU, while the background work they cause (WAL writing, vacuuming) is not in it. -1 when
	// pg_stat_statements or the server's CPU could not be read (NumberingShareSource says why).
	// One consumer ticks for all; every consumer reads, so the reads' part grows with K.
	NumberingShare       float64 `json:"numbering_share"`
	NumberingShareSource string  `json:"numbering_share_source"`
	NumberingExecMS      float64 `json:"numbering_exec_ms"`
	NumberingCalls       int64   `json:"numbering_calls"`
	// NumberingLockWaitMS is the part of numbering_exec_ms spent waiting for the tick table's
	// lock, where a second ticker (a fallback tick, or an election changing hands) waits for
	// the one ticking (pg_stat_statements' nested entry for that statement; almost all of it is
	// waiting; a lower bound, see numberingSQL). NumberingShareLessLockWait is
	// (numbering_exec_ms - numbering_lock_wait_ms) over the same server CPU: closer to the CPU
	// share when tickers contend, still an upper bound.
	NumberingLockWaitMS        float64 `json:"numbering_lock_wait_ms"`
	NumberingShareLessLockWait float64 `json:"numbering_share_less_lock_wait"`
	ServerCPUSeconds           float64 `json:"server_cpu_seconds"`
	// Server CPU per delete on each side (0 when the server does not run on this machine).
	ServerCPUPerTx         float64 `json:"server_cpu_us_per_tx"`
	BaselineServerCPUPerTx float64 `json:"baseline_server_cpu_us_per_tx"`
	// ReadFrom is where the consumers read events: "primary", or "standby" (-standby: a
	// streaming hot standby of the same cluster, Config.ReadDSN). With a standby, the server CPU
	// figures above stay the primary's (its WAL sender included) and the standby's own is
	// StandbyServerCPUPerTx; ReadFallbacks and StandbyWaits sum the consumers' Stats.
	ReadFrom              string  `json:"read_from"`
	StandbyServerCPUPerTx float64 `json:"standby_server_cpu_us_per_tx,omitempty"`
	ReadFallbacks         int64   `json:"read_fallbacks,omitempty"`
	ReadReturns           int64   `json:"read_returns,omitempty"`
	StandbyWaits          int64   `json:"standby_waits,omitempty"`
	TasksExhausted        bool    `json:"tasks_exhausted,omitempty"`
	TimedOut              bool    `json:"timed_out,omitempty"`
}

// taskQueue hands out one database's deletes, task t-1 .. t-n (t-i of project (i-1) mod
// projects), in order across phases, and keeps when each delete committed.
type taskQueue struct {
	jobs      []deleteJob // jobs[i] deletes t-i; jobs[0] is unused
	next      atomic.Int64
	commits   []int64 // commits[i]: Unix ns at which t-i's COMMIT returned; 0 if it did not
	exhausted atomic.Bool
}

func newTaskQueue(tasks, projects int) *taskQueue {
	q := &taskQueue{jobs: make([]deleteJob, tasks+1), commits: make([]int64, tasks+1)}
	for i := 1; i <= tasks; i++ {
		q.jobs[i] = deleteJob{project: projectName((i - 1) % projects), task: "t-" + strconv.Itoa(i)}
	}
	return q
}

// runFor deletes on writers goroutines, each as fast as it can, until d has passed (a writer
// finishes the delete it is in) or the tasks run out.
func (q *taskQueue) runFor(ctx context.Context, del deleteFunc, writers int, d time.Duration) deleteRun {
	type part struct {
		calls []time.Duration
		errs  int64
		first error
	}
	parts := make([]part, writers)
	started := time.Now()
	deadline := started.Add(d)
	var wg sync.WaitGroup
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := &parts[w]
			for ctx.Err() == nil && time.Now().Before(deadline) {
				i := int(q.next.Add(1))
				if i >= len(q.jobs) {
					q.exhausted.Store(true)
					return
				}
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
					c = end // not seen by the tracer (pgx commits on the call's context, so never)
				}
				q.commits[i] = c.UnixNano()
			}
		}()
	}
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

// sustainedDB is one side's database: tasks, a writers' pool and the host's delete.
type sustainedDB struct {
	db *DB
	// pool is the writer role's, for the deletes; admin the superuser's, for setup.
	pool, admin *pgxpool.Pool
	del         deleteFunc
	queue       *taskQueue
	server      *serverCPU
	close       []func()
}

func (s *sustainedDB) Close() {
	for i := len(s.close) - 1; i >= 0; i-- {
		s.close[i]()
	}
}

func newSustainedDB(ctx context.Context, env *Env, label string, o sustainedOpts, withOutbox bool) (*sustainedDB, error) {
	db, err := env.NewDB(ctx, label)
	if err != nil {
		return nil, err
	}
	s := &sustainedDB{db: db, close: []func(){db.Drop}, queue: newTaskQueue(o.tasks, o.projects)}
	if s.admin, err = db.Pool(ctx, 2, nil); err != nil {
		s.Close()
		return nil, err
	}
	s.close = append(s.close, s.admin.Close)
	if s.pool, err = db.WriterPool(ctx, int32(o.writers+2), &stampTracer{}); err != nil {
		s.Close()
		return nil, err
	}
	s.close = append(s.close, s.pool.Close)
	s.server = findServer(ctx, s.pool)
	for p := range o.projects {
		if err := createTasks(ctx, s.admin, projectName(p), "t", p+1, o.tasks, o.projects); err != nil {
			s.Close()
			return nil, err
		}
	}
	if _, err := s.admin.Exec(ctx, "VACUUM ANALYZE tasks"); err != nil {
		s.Close()
		return nil, fmt.Errorf("vacuum tasks: %w", err)
	}
	if o.mailbox == mailboxExcluded {
		if _, err := s.admin.Exec(ctx, skipMailboxSQL); err != nil {
			s.Close()
			return nil, fmt.Errorf("exclude mailbox: %w", err)
		}
	}
	store, w, err := newHost(s.pool, withOutbox, true)
	if err != nil {
		s.Close()
		return nil, err
	}
	if w != nil {
		s.close = append(s.close, closeWriter(w))
	}
	s.del = hostDelete(store)
	return s, nil
}

// phase runs the writers on s for d after a CHECKPOINT, measuring the server's CPU; start,
// when not nil, runs right before the writers do.
func (s *sustainedDB) phase(ctx context.Context, env *Env, name string, writers int, d time.Duration, start func() error) (deleteRun, time.Duration, error) {
	if _, err := s.admin.Exec(ctx, "CHECKPOINT"); err != nil {
		return deleteRun{}, 0, fmt.Errorf("checkpoint: %w", err)
	}
	if start != nil {
		if err := start(); err != nil {
			return deleteRun{}, 0, err
		}
	}
	env.Logf("sustained: %s, %d writers for %s", name, writers, d)
	cpu := startCPU(s.server)
	r := s.queue.runFor(ctx, s.del, writers, d)
	_, server := cpu.Stop()
	if r.firstEr != nil {
		env.Logf("sustained: %s: first error: %v", name, r.firstEr)
	}
	return r, server, ctx.Err()
}

// runSustained measures what the outbox costs a host under full write load while K durable
// consumers (default settings, wake-ups on) observe every project: baseline half, outbox
// phase, baseline half, so that drift over the run weighs on both sides.
func runSustained(ctx context.Context, env *Env, o sustainedOpts) (sustainedResult, error) {
	res := sustainedResult{Header: env.Header("sustained"), Writers: o.writers, Consumers: o.consumers, Projects: o.projects,
		Seconds: o.seconds, Mailbox: o.mailbox, NumberingShare: -1, NumberingShareLessLockWait: -1, ReadFrom: "primary",
		TickBusyWaitMS: float64(o.tickBusyWait) / float64(time.Millisecond), TickFloorMS: float64(o.tickFloor) / float64(time.Millisecond)}
	if o.writers < 1 || o.consumers < 1 || o.projects < 1 || o.seconds <= 0 || o.tasks < o.projects {
		return res, errors.New("sustained: need writers, consumers, projects >= 1, seconds > 0 and tasks >= projects")
	}
	if o.mailbox != mailboxExcluded && o.mailbox != mailboxIncluded {
		return res, fmt.Errorf("sustained: -mailbox must be %q or %q", mailboxExcluded, mailboxIncluded)
	}
	phase := time.Duration(o.seconds * float64(time.Second))
	var standbyHost string
	if o.standby {
		// Before the databases: they reach the standby as they are created.
		sb, err := env.StartStandby(ctx)
		if err != nil {
			return res, err
		}
		defer sb.Stop()
		standbyHost, res.ReadFrom = sb.SocketDir(), "standby"
	}
	base, err := newSustainedDB(ctx, env, "sustained_baseline", o, false)
	if err != nil {
		return res, err
	}
	defer base.Close()
	ob, err := newSustainedDB(ctx, env, "sustained_outbox", o, true)
	if err != nil {
		return res, err
	}
	defer ob.Close()
	stats := openStatStatements(ctx, ob.admin)

	b1, b1CPU, err := base.phase(ctx, env, "baseline, first half", o.writers, phase/2, nil)
	if err != nil {
		return res, err
	}

	projects := make([]string, o.projects)
	for p := range projects {
		projects[p] = projectName(p)
	}
	trackers := make([]*indexTracker, o.consumers)
	specs := make([]consumerSpec, o.consumers)
	ids := make([]string, o.consumers)
	for k := range specs {
		trackers[k] = newTimedTracker("t", o.tasks)
		ids[k] = fmt.Sprintf("bench-sustained-%d", k)
		specs[k] = consumerSpec{id: ids[k], projects: projects, listeners: []outbox.Listener{trackers[k].listener()}}
		specs[k].cfg.TickBusyWait, specs[k].cfg.TickFloor = o.tickBusyWait, o.tickFloor
		if o.standby {
			specs[k].cfg.ReadDSN = ob.db.ConsumerDSNOn(standbyHost)
		}
	}
	var standbyServer *serverCPU
	var standbyCPU cpuMeter
	if o.standby {
		sbPool, err := ob.db.SuperuserPoolOn(ctx, standbyHost, 1)
		if err != nil {
			return res, err
		}
		standbyServer = findServer(ctx, sbPool)
		sbPool.Close()
	}
	if o.oneProcess {
		shared, err := onOnePool(ctx, ob.db, specs)
		if err != nil {
			return res, err
		}
		defer shared.Close()
		res.OneProcess = true
	}
	env.Logf("sustained: starting %d consumers of %d projects", o.consumers, o.projects)
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
	// A new cursor is positioned at the head by the consumer's first scan; wait for all.
	if err := waitPositioned(ctx, outbox.NewAdmin(ob.admin, outbox.AdminOptions{}), ids, o.consumers*o.projects, time.Minute); err != nil {
		return res, fmt.Errorf("sustained: %w", err)
	}

	resetStats := func() error {
		standbyCPU = startCPU(standbyServer)
		if stats.ok {
			return stats.reset(ctx)
		}
		return nil
	}
	run, runCPU, err := ob.phase(ctx, env, "outbox with consumers", o.writers, phase, resetStats)
	if err != nil {
		return res, err
	}
	_, sbCPU := standbyCPU.Stop()
	if o.standby && run.tx > 0 {
		res.StandbyServerCPUPerTx = round1(float64(sbCPU/time.Microsecond) / float64(run.tx))
	}
	switch {
	case !stats.ok:
		res.NumberingShareSource = "unavailable: pg_stat_statements: " + stats.why
	case ob.server == nil:
		res.NumberingShareSource = "unavailable: the server's CPU cannot be read from this machine"
	default:
		st, err := stats.numbering(ctx)
		if err != nil {
			return res, err
		}
		res.NumberingExecMS, res.NumberingLockWaitMS, res.NumberingCalls = round3(st.execMS), round3(st.lockMS), st.calls
		res.NumberingShareSource = "pg_stat_statements total_exec_time / server CPU"
		if cpuMS := float64(runCPU.Milliseconds()); cpuMS > 0 {
			res.NumberingShare = round3(st.execMS / cpuMS)
			res.NumberingShareLessLockWait = round3((st.execMS - st.lockMS) / cpuMS)
		}
	}
	res.ServerCPUSeconds = seconds(runCPU)

	// Catch-up: until every consumer has every committed event, or the deadline.
	committed := ob.queue.commits
	waitStart := time.Now()
	deadline := waitStart.Add(drainTimeout(int(run.tx) * o.consumers))
	for {
		missing := 0
		for _, tr := range trackers {
			missing += tr.missingOf(committed)
		}
		if missing == 0 {
			res.CatchUpSeconds = seconds(time.Since(waitStart))
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			res.TimedOut = true
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	for _, c := range consumers {
		st := c.Stats()
		res.ReadFallbacks += st.ReadFallbacks
		res.ReadReturns += st.ReadReturns
		res.StandbyWaits += st.StandbyWaits
		res.SharedReads += st.SharedReads
	}
	stopConsumers()

	b2, b2CPU, err := base.phase(ctx, env, "baseline, second half", o.writers, phase/2, nil)
	if err != nil {
		return res, err
	}

	baseTx, baseElapsed := b1.tx+b2.tx, b1.elapsed+b2.elapsed
	res.BaselineTx, res.BaselineTxPerS = baseTx, perSecond(baseTx, baseElapsed)
	res.Tx, res.TxPerS, res.Errors = run.tx, perSecond(run.tx, run.elapsed), run.errors+b1.errors+b2.errors
	res.Ratio = ratio(res.TxPerS, res.BaselineTxPerS)
	l, bl := summarize(run.calls), summarize(append(b1.calls, b2.calls...))
	res.DeleteP50MS, res.DeleteP99MS, res.BaselineDeleteP50MS, res.BaselineDeleteP99MS = l.P50, l.P99, bl.P50, bl.P99
	if run.tx > 0 {
		res.ServerCPUPerTx = round1(float64(runCPU/time.Microsecond) / float64(run.tx))
	}
	if baseTx > 0 {
		res.BaselineServerCPUPerTx = round1(float64((b1CPU+b2CPU)/time.Microsecond) / float64(baseTx))
	}
	res.TasksExhausted = ob.queue.exhausted.Load() || base.queue.exhausted.Load()
	if res.TasksExhausted {
		env.Logf("sustained: the writers ran out of tasks; raise -tasks")
	}

	// Lag: each event's latest arrival across the consumers.
	latest := make([]int64, len(committed))
	reached := make([]int, len(committed))
	nCommitted := countCommitted(committed)
	for _, tr := range trackers {
		received, dups, notArrived, foreign := tr.Counts()
		missing := tr.missingOf(committed)
		res.Received += received
		res.Duplicates += dups
		res.Missing += missing
		// Events that arrived but whose delete reported no commit (none are expected), and
		// deliveries the tracker could not place.
		res.Unexpected += (o.tasks - notArrived) - (nCommitted - missing) + foreign
		for i, at := range tr.arrivals() {
			if at != 0 && committed[i] != 0 {
				latest[i] = max(latest[i], at)
				reached[i]++
			}
		}
	}
	lags := make([]time.Duration, 0, run.tx)
	for i, c := range committed {
		if c != 0 && reached[i] == o.consumers {
			lags = append(lags, time.Duration(latest[i]-c))
		}
	}
	lag := summarize(lags)
	res.LagP50MS, res.LagP99MS, res.LagMaxMS = lag.P50, lag.P99, lag.Max
	return res, ctx.Err()
}

func countCommitted(commits []int64) int {
	n := 0
	for _, c := range commits {
		if c != 0 {
			n++
		}
	}
	return n
}

// onOnePool puts every consumer of specs on one pool of db, as consumers of one process share
// their host's (-one-process): each holds up to two pool connections and hijacks one for its
// election, and one more is the LISTEN connection they share. The caller closes the pool.
func onOnePool(ctx context.Context, db *DB, specs []consumerSpec) (*pgxpool.Pool, error) {
	shared, err := db.ConsumerPool(ctx, int32(3*len(specs)+1), nil)
	if err != nil {
		return nil, err
	}
	for k := range specs {
		specs[k].pool = shared
	}
	return shared, nil
}

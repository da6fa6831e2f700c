package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"fusion/outbox"
)

func init() {
	register(benchCase{name: "longtx", usage: "a steady delete rate for minutes while an unrelated transaction holds an xid open: latency and server CPU per delete, first window against last",
		flags: func(fs *flag.FlagSet) runner {
			o := defaultLongTxOpts()
			fs.IntVar(&o.rate, "rate", o.rate, "deletes per second")
			fs.Float64Var(&o.seconds, "seconds", o.seconds, "how long to send")
			fs.Float64Var(&o.window, "window", o.window, "length in seconds of the first and of the last window measured (at most half of -seconds)")
			fs.IntVar(&o.writers, "writers", o.writers, "writer goroutines sharing the schedule")
			fs.BoolVar(&o.hold, "hold", o.hold, "hold the unrelated transaction open while sending (false: the control run, same shape)")
			return one(func(ctx context.Context, env *Env) (longTxResult, error) { return runLongTx(ctx, env, o) })
		}})
}

type longTxOpts struct {
	rate, writers   int
	seconds, window float64
	hold            bool
}

// defaultLongTxOpts is issue 33's run: 1,000 deletes/s for 5 minutes, a minute at each end.
func defaultLongTxOpts() longTxOpts {
	return longTxOpts{rate: 1000, seconds: 300, window: 60, writers: 8, hold: true}
}

// longTxWindow is what one window of the sending measured. Its events are the deletes whose
// COMMIT returned inside it; their latency runs from that instant to their arrival at the
// listener, which may be after the window.
type longTxWindow struct {
	// FromSeconds is when the window began, from the start of the sending.
	FromSeconds float64 `json:"from_s"`
	Seconds     float64 `json:"seconds"`
	Events      int     `json:"events"`
	EventsPerS  float64 `json:"events_per_s"`
	Latencies
	// The server's CPU over the window (the postmaster and its children, from /proc) and per
	// delete committed in it; -1 when the server does not run on this machine.
	ServerCPUSeconds     float64 `json:"server_cpu_seconds"`
	ServerCPUUSPerDelete float64 `json:"server_cpu_us_per_delete"`
	ScansPerS            float64 `json:"scans_per_s"`
	// Numbering's calls in the window (the ticks and the reads, see numberingSQL) and their
	// executor time; -1 without pg_stat_statements.
	NumberingCalls       int64   `json:"numbering_calls"`
	NumberingExecMeanMS  float64 `json:"numbering_exec_mean_ms"`
	NumberingExecTotalMS float64 `json:"numbering_exec_ms"`
}

type longTxResult struct {
	Header
	Hold          bool    `json:"hold"`
	Rate          int     `json:"rate"`
	Seconds       float64 `json:"seconds"`
	WindowSeconds float64 `json:"window_seconds"`
	Writers       int     `json:"writers"`
	Sent          int64   `json:"sent"`
	Errors        int64   `json:"errors"`
	AchievedRate  float64 `json:"achieved_rate"`
	// BehindSchedule counts the deletes the writers had not begun when the schedule ended:
	// they stop there, so that the run lasts -seconds and its last window is the last of the
	// sending, and a machine that cannot keep the rate says so here and in achieved_rate.
	BehindSchedule int64 `json:"behind_schedule"`
	// SendingSeconds runs from the first delete's schedule to the last delete's return.
	SendingSeconds float64 `json:"sending_seconds"`
	// Whole run, from what the listener got, keyed by event ID.
	Received   int  `json:"received"`
	Duplicates int  `json:"duplicates"`
	Missing    int  `json:"missing"`
	Unexpected int  `json:"unexpected,omitempty"`
	TimedOut   bool `json:"timed_out,omitempty"`
	// CatchUpSeconds is how long after the sending ended the listener took to have every
	// committed event (the held transaction is still open meanwhile).
	CatchUpSeconds float64 `json:"catch_up_seconds"`
	// The windows keep these names whatever -window is.
	FirstMinute longTxWindow `json:"first_minute"`
	LastMinute  longTxWindow `json:"last_minute"`
	// Last window over first: issue 33 wants both within 1.2. -1 when a side is missing.
	LastOverFirstP99 float64 `json:"last_over_first_p99"`
	LastOverFirstCPU float64 `json:"last_over_first_cpu"`
	// The held transaction: its xid, and at the end of the sending its xid's age (how many
	// xids were assigned since it began) and whether pg_xact_status still said "in progress".
	// 0, -1 and false without -hold.
	HeldXID       int64   `json:"held_xid"`
	HeldXIDAge    int64   `json:"held_xid_age"`
	HeldOpenAtEnd bool    `json:"held_open_at_end"`
	HeldSeconds   float64 `json:"held_seconds"`
	// NumberingSource says where the windows' numbering figures come from; they are -1 without
	// pg_stat_statements.
	NumberingSource string `json:"numbering_source"`
	// Load1mEnd is the load average when the sending ended; load_1m is the one at the start.
	Load1mEnd float64 `json:"load_1m_end"`
}

// The held transaction's own table, which nothing else touches, and its write there.
const (
	longTxScratchDDL = `CREATE TABLE bench_longtx_scratch (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, note text)`
	longTxHoldSQL    = `INSERT INTO bench_longtx_scratch (note) VALUES ('held') RETURNING pg_current_xact_id()::text`
)

// heldTx is the unrelated transaction: a write to its own table, which gives it an xid, left
// open on its own connection.
type heldTx struct {
	pool *pgxpool.Pool
	tx   pgx.Tx
	xid  int64
	at   time.Time
}

func openLongTx(ctx context.Context, db *DB, admin *pgxpool.Pool) (*heldTx, error) {
	if _, err := admin.Exec(ctx, longTxScratchDDL); err != nil {
		return nil, fmt.Errorf("longtx: create scratch table: %w", err)
	}
	pool, err := db.Pool(ctx, 1, nil)
	if err != nil {
		return nil, err
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("longtx: begin held transaction: %w", err)
	}
	h := &heldTx{pool: pool, tx: tx, at: time.Now()}
	var xid string
	if err := tx.QueryRow(ctx, longTxHoldSQL).Scan(&xid); err != nil {
		h.release()
		return nil, fmt.Errorf("longtx: held write: %w", err)
	}
	if h.xid, err = strconv.ParseInt(xid, 10, 64); err != nil {
		h.release()
		return nil, fmt.Errorf("longtx: held xid %q: %w", xid, err)
	}
	return h, nil
}

// check reads, from another connection, the held xid's age and whether it is still open.
func (h *heldTx) check(ctx context.Context, admin *pgxpool.Pool) (age int64, open bool, err error) {
	var status string
	err = admin.QueryRow(ctx, `SELECT pg_xact_status($1::text::xid8), age(($1::text::xid8)::text::xid)::bigint`,
		strconv.FormatInt(h.xid, 10)).Scan(&status, &age)
	if err != nil {
		return 0, false, fmt.Errorf("longtx: read held xid: %w", err)
	}
	return age, status == "in progress", nil
}

func (h *heldTx) release() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = h.tx.Rollback(ctx)
	h.pool.Close()
}

// windowMeter measures one window: the server's CPU, the consumer's scans and, reset when
// the window starts, pg_stat_statements.
type windowMeter struct {
	started time.Time
	cpu     cpuMeter
	scans   int64
}

func startWindow(ctx context.Context, server *serverCPU, c *runningConsumer, stats *statStatements) (windowMeter, error) {
	if stats.ok {
		if err := stats.reset(ctx); err != nil {
			return windowMeter{}, err
		}
	}
	return windowMeter{started: time.Now(), cpu: startCPU(server), scans: c.Stats().Scans}, nil
}

// stop ends the window at now; t0 is the start of the sending. Events and latencies are
// filled in after the run.
func (m windowMeter) stop(ctx context.Context, t0 time.Time, server *serverCPU, c *runningConsumer, stats *statStatements) (longTxWindow, time.Time, error) {
	_, srv := m.cpu.Stop()
	end := time.Now()
	scans := c.Stats().Scans - m.scans
	w := longTxWindow{FromSeconds: seconds(m.started.Sub(t0)), Seconds: seconds(end.Sub(m.started)),
		ServerCPUSeconds: -1, ServerCPUUSPerDelete: -1, NumberingCalls: -1, NumberingExecMeanMS: -1, NumberingExecTotalMS: -1}
	w.ScansPerS = perSecond(scans, end.Sub(m.started))
	if server != nil {
		w.ServerCPUSeconds = seconds(srv)
	}
	if stats.ok {
		st, err := stats.numbering(ctx)
		if err != nil {
			return w, end, err
		}
		w.NumberingCalls, w.NumberingExecTotalMS = st.calls, round3(st.execMS)
		if st.calls > 0 {
			w.NumberingExecMeanMS = round3(st.execMS / float64(st.calls))
		}
	}
	return w, end, nil
}

// finish counts the deletes that committed in [from, to) and their latencies to first
// arrival, and the server's CPU per delete.
func (w *longTxWindow) finish(from, to time.Time, commits, arrivals []int64, server *serverCPU) {
	var lat []time.Duration
	f, t := from.UnixNano(), to.UnixNano()
	for i, c := range commits {
		if c == 0 || c < f || c >= t {
			continue
		}
		w.Events++
		if i < len(arrivals) && arrivals[i] != 0 {
			lat = append(lat, time.Duration(arrivals[i]-c))
		}
	}
	w.Latencies = summarize(lat)
	w.EventsPerS = perSecond(int64(w.Events), to.Sub(from))
	if server != nil && w.Events > 0 {
		w.ServerCPUUSPerDelete = round1(w.ServerCPUSeconds * 1e6 / float64(w.Events))
	}
}

// over is last / first, -1 when either side is unknown or the first is 0.
func over(last, first float64) float64 {
	if last < 0 || first <= 0 {
		return -1
	}
	return round3(last / first)
}

// runLongTx commits deletes at a fixed rate through the reference host with the writer hook,
// one project, one consumer with default settings observing it (as latency does), while an
// unrelated transaction on its own connection holds an xid open from before the first delete
// until every committed event has arrived. It measures the first and the last window of the
// sending: how the cost of observing grows while the xmin horizon cannot advance.
func runLongTx(ctx context.Context, env *Env, o longTxOpts) (longTxResult, error) {
	res := longTxResult{Header: env.Header("longtx"), Hold: o.hold, Rate: o.rate, Seconds: o.seconds, WindowSeconds: o.window,
		Writers: o.writers, HeldXIDAge: -1, LastOverFirstP99: -1, LastOverFirstCPU: -1}
	total := int(float64(o.rate) * o.seconds)
	if o.rate < 1 || o.writers < 1 || total < 1 || o.window <= 0 || 2*o.window > o.seconds {
		return res, errors.New("longtx: need rate >= 1, writers >= 1, at least one event and 0 < window <= seconds/2")
	}
	db, err := env.NewDB(ctx, "longtx")
	if err != nil {
		return res, err
	}
	defer db.Drop()
	admin, pool, closePools, err := db.Pools(ctx, int32(o.writers+2), &stampTracer{})
	if err != nil {
		return res, err
	}
	defer closePools()
	server := findServer(ctx, admin)
	const project, consumer = "longtx", "bench-longtx"
	if err := createTasks(ctx, admin, project, "t", 1, total, 1); err != nil {
		return res, err
	}
	if _, err := admin.Exec(ctx, "VACUUM ANALYZE tasks"); err != nil {
		return res, fmt.Errorf("vacuum tasks: %w", err)
	}
	store, w, err := newHost(pool, true, true)
	if err != nil {
		return res, err
	}
	defer closeWriter(w)()

	tracker := newTimedTracker("t", total)
	c, err := startConsumer(ctx, db, consumerSpec{id: consumer, projects: []string{project}, listeners: []outbox.Listener{tracker.listener()}})
	if err != nil {
		return res, err
	}
	defer c.Close()
	if _, ok := waitCursor(ctx, admin, consumer, project, 0, 10*time.Second); !ok {
		return res, errors.New("longtx: the consumer never positioned its cursor")
	}
	stats := openStatStatements(ctx, admin)
	if stats.ok {
		res.NumberingSource = "pg_stat_statements"
	} else {
		res.NumberingSource = "unavailable: pg_stat_statements: " + stats.why
		env.Logf("longtx: no numbering figures: %s", stats.why)
	}
	if _, err := admin.Exec(ctx, "CHECKPOINT"); err != nil {
		return res, fmt.Errorf("checkpoint: %w", err)
	}

	var held *heldTx
	if o.hold {
		if held, err = openLongTx(ctx, db, admin); err != nil {
			return res, err
		}
		defer held.release()
		res.HeldXID = held.xid
		env.Logf("longtx: xid %d held open", held.xid)
	}

	env.Logf("longtx: %d deletes/s for %.1fs on %d writers (hold %t), windows of %.1fs", o.rate, o.seconds, o.writers, o.hold, o.window)
	// commits[i]: Unix ns at which t-i's COMMIT returned; 0 if it did not.
	commits := make([]int64, total+1)
	jobs := make(chan int, total)
	var mu sync.Mutex
	var sent, failed, behind int64
	// end is when the schedule ends; the writers read it only after a job, which is sent
	// after it is set.
	var end time.Time
	var firstErr error
	var wg sync.WaitGroup
	for range o.writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range jobs {
				if time.Now().After(end) {
					mu.Lock()
					behind++
					mu.Unlock()
					continue
				}
				sctx, st := withStamps(ctx)
				r, err := store.Delete(sctx, project, "t-"+strconv.Itoa(i))
				at := st.commit
				if at.IsZero() {
					at = time.Now()
				}
				mu.Lock()
				if err != nil || !r.EventRecorded {
					failed++
					if firstErr == nil {
						firstErr = fmt.Errorf("delete t-%d: recorded %t: %w", i, r.EventRecorded, err)
					}
				} else {
					sent++
					commits[i] = at.UnixNano()
				}
				mu.Unlock()
			}
		}()
	}

	first, err := startWindow(ctx, server, c, stats)
	if err != nil {
		return res, err
	}
	t0 := first.started
	length := time.Duration(o.seconds * float64(time.Second))
	end = t0.Add(length)
	window := time.Duration(o.window * float64(time.Second))
	sendDone := make(chan struct{})
	go func() {
		defer close(sendDone)
		period := time.Duration(float64(time.Second) / float64(o.rate))
		for i := 1; i <= total && ctx.Err() == nil; i++ {
			if d := time.Until(t0.Add(time.Duration(i-1) * period)); d > 0 {
				time.Sleep(d)
			}
			jobs <- i
		}
		close(jobs)
	}()

	// The windows run on the schedule's clock, which ends the sending too: a delete begun
	// just before the end and committed after it counts in neither window.
	sleepCtx(ctx, time.Until(t0.Add(window)))
	var firstEnd, lastEnd time.Time
	res.FirstMinute, firstEnd, err = first.stop(ctx, t0, server, c, stats)
	if err != nil {
		return res, err
	}
	sleepCtx(ctx, time.Until(t0.Add(length-window)))
	last, err := startWindow(ctx, server, c, stats)
	if err != nil {
		return res, err
	}
	sleepCtx(ctx, time.Until(t0.Add(length)))
	res.LastMinute, lastEnd, err = last.stop(ctx, t0, server, c, stats)
	if err != nil {
		return res, err
	}
	<-sendDone
	wg.Wait()
	sending := time.Since(t0)
	res.Load1mEnd = env.Header("longtx").Load1m
	if held != nil {
		if res.HeldXIDAge, res.HeldOpenAtEnd, err = held.check(ctx, admin); err != nil {
			return res, err
		}
	}
	if firstErr != nil {
		env.Logf("longtx: first error: %v", firstErr)
	}
	res.Sent, res.Errors, res.AchievedRate = sent, failed, perSecond(sent, sending)
	res.BehindSchedule, res.SendingSeconds = behind, seconds(sending)

	// Catch-up, still held: until the listener has every committed event, or the deadline.
	waitStart := time.Now()
	deadline := waitStart.Add(drainTimeout(int(sent)))
	for {
		if tracker.missingOf(commits) == 0 {
			res.CatchUpSeconds = seconds(time.Since(waitStart))
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			res.TimedOut = true
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if held != nil {
		res.HeldSeconds = seconds(time.Since(held.at))
	}

	arrivals := tracker.arrivals()
	res.FirstMinute.finish(first.started, firstEnd, commits, arrivals, server)
	res.LastMinute.finish(last.started, lastEnd, commits, arrivals, server)
	res.LastOverFirstP99 = over(res.LastMinute.P99, res.FirstMinute.P99)
	res.LastOverFirstCPU = over(res.LastMinute.ServerCPUUSPerDelete, res.FirstMinute.ServerCPUUSPerDelete)

	received, dups, notArrived, foreign := tracker.Counts()
	res.Received, res.Duplicates = received, dups
	res.Missing = tracker.missingOf(commits)
	// Events that arrived but whose delete reported no commit, and deliveries the tracker
	// could not place: none are expected.
	res.Unexpected = (total - notArrived) - (countCommitted(commits) - res.Missing) + foreign
	return res, ctx.Err()
}

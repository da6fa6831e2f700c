package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"sync"
	"time"

	"fusion/outbox"
)

func init() {
	register(benchCase{name: "latency", usage: "commit-to-listener latency at a steady delete rate",
		flags: func(fs *flag.FlagSet) runner {
			o := latencyOpts{rate: 1000, seconds: 10, writers: 8}
			fs.IntVar(&o.rate, "rate", o.rate, "deletes per second")
			fs.Float64Var(&o.seconds, "seconds", o.seconds, "how long to send")
			fs.IntVar(&o.writers, "writers", o.writers, "writer goroutines sharing the schedule")
			return one(func(ctx context.Context, env *Env) (latencyResult, error) { return runLatency(ctx, env, o) })
		}})
}

type latencyOpts struct {
	rate, writers int
	seconds       float64
}

type latencyResult struct {
	Header
	Rate       int     `json:"rate"`
	Seconds    float64 `json:"seconds"`
	Writers    int     `json:"writers"`
	Sent       int64   `json:"sent"`
	Errors     int64   `json:"errors"`
	Received   int     `json:"received"`
	Duplicates int     `json:"duplicates"`
	Missing    int     `json:"missing"`
	Latencies
	// AchievedRate is sent over the sending time: below Rate, the writers could not keep up.
	AchievedRate float64 `json:"achieved_rate"`
	// The consumer's cycle while the writers sent: its scans per second (Consumer.Stats), the
	// mean time between two (scan_period_ms) and the events each delivered on average. An
	// event waits for the scan after its commit, then for that scan's work.
	ScansPerS     float64 `json:"scans_per_s"`
	ScanPeriodMS  float64 `json:"scan_period_ms"`
	EventsPerScan float64 `json:"events_per_scan"`
	// Numbering's share of the cycle, from pg_stat_statements over the same phase: the calls
	// of the ticker and of the reader (see numberingSQL) and their mean executor time (the
	// commit after a tick is not in it); -1 without the extension.
	NumberingCalls      int64   `json:"numbering_calls"`
	NumberingExecMeanMS float64 `json:"numbering_exec_mean_ms"`
}

// runLatency commits deletes at a fixed rate through the reference host with the writer hook
// while one consumer with default settings (NOTIFY on, 1s poll) observes the project. Each
// event's latency runs from the instant its COMMIT returned in the writer (stampTracer) to its
// arrival at the listener, matched by event ID.
func runLatency(ctx context.Context, env *Env, o latencyOpts) (latencyResult, error) {
	res := latencyResult{Header: env.Header("latency"), Rate: o.rate, Seconds: o.seconds, Writers: o.writers}
	total := int(float64(o.rate) * o.seconds)
	if o.rate < 1 || o.writers < 1 || total < 1 {
		return res, errors.New("latency: need rate >= 1, writers >= 1 and at least one event")
	}
	db, err := env.NewDB(ctx, "latency")
	if err != nil {
		return res, err
	}
	defer db.Drop()
	admin, pool, closePools, err := db.Pools(ctx, int32(o.writers+2), &stampTracer{})
	if err != nil {
		return res, err
	}
	defer closePools()
	const project, consumer = "lat", "bench-latency"
	if err := createTasks(ctx, admin, project, "t", 0, total-1, 1); err != nil {
		return res, err
	}
	store, w, err := newHost(pool, true, true)
	if err != nil {
		return res, err
	}
	defer closeWriter(w)()

	arr := newArrivals()
	c, err := startConsumer(ctx, db, consumerSpec{id: consumer, projects: []string{project}, listeners: []outbox.Listener{arr.listener()}})
	if err != nil {
		return res, err
	}
	defer c.Close()
	// The first scan positions the new cursor (at the head, by reconciliation); wait for it.
	if _, ok := waitCursor(ctx, admin, consumer, project, 0, 10*time.Second); !ok {
		return res, errors.New("latency: the consumer never positioned its cursor")
	}

	stats := openStatStatements(ctx, admin)
	if !stats.ok {
		res.NumberingCalls, res.NumberingExecMeanMS = -1, -1
		env.Logf("latency: no numbering figures: %s", stats.why)
	}
	before := c.Stats()
	env.Logf("latency: %d deletes/s for %.1fs on %d writers", o.rate, o.seconds, o.writers)
	jobs := make(chan int, total)
	var mu sync.Mutex
	commits := make(map[string]time.Time, total)
	var sent, failed int64
	var firstErr error
	var wg sync.WaitGroup
	for range o.writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range jobs {
				sctx, st := withStamps(ctx)
				r, err := store.Delete(sctx, project, fmt.Sprintf("t-%d", i))
				mu.Lock()
				if err != nil || !r.EventRecorded {
					failed++
					if firstErr == nil {
						firstErr = fmt.Errorf("delete t-%d: recorded %t: %w", i, r.EventRecorded, err)
					}
				} else {
					sent++
					commits[r.Event.EventID] = st.commit
				}
				mu.Unlock()
			}
		}()
	}
	started := time.Now()
	period := time.Duration(float64(time.Second) / float64(o.rate))
	for i := 0; i < total && ctx.Err() == nil; i++ {
		if d := time.Until(started.Add(time.Duration(i) * period)); d > 0 {
			time.Sleep(d)
		}
		jobs <- i
	}
	close(jobs)
	wg.Wait()
	sending := time.Since(started)
	after := c.Stats()
	if scans := after.Scans - before.Scans; scans > 0 {
		res.ScansPerS = perSecond(scans, sending)
		res.ScanPeriodMS = round3(float64(sending) / float64(time.Millisecond) / float64(scans))
		res.EventsPerScan = round1(float64(after.Delivered-before.Delivered) / float64(scans))
	}
	if stats.ok {
		st, err := stats.numbering(ctx)
		if err != nil {
			return res, err
		}
		res.NumberingCalls = st.calls
		if st.calls > 0 {
			res.NumberingExecMeanMS = round3(st.execMS / float64(st.calls))
		}
	}
	if firstErr != nil {
		env.Logf("latency: first error: %v", firstErr)
	}
	ids := make([]string, 0, len(commits))
	for id := range commits {
		ids = append(ids, id)
	}
	// Give stragglers two poll intervals: anything later is reported missing.
	arr.waitFor(ctx, ids, 2*outbox.Config{}.WithDefaults().PollInterval+time.Second)

	first, received, dups, _ := arr.snapshot()
	lat := make([]time.Duration, 0, len(ids))
	for id, committed := range commits {
		if at, ok := first[id]; ok {
			lat = append(lat, at.Sub(committed))
		}
	}
	res.Sent, res.Errors, res.Received, res.Duplicates = sent, failed, received, dups
	res.Missing = len(ids) - len(lat)
	res.Latencies = summarize(lat)
	res.AchievedRate = perSecond(sent, sending)
	return res, ctx.Err()
}

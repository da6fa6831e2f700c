package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"fusion/outbox"
	"fusion/outbox/internal/testhost"
)

func init() {
	register(benchCase{name: "retention", usage: "prune a large backlog while deletes keep committing",
		flags: func(fs *flag.FlagSet) runner {
			o := retentionOpts{rows: 1000000, writers: 4, tasks: 200000, before: 2 * time.Second}
			fs.IntVar(&o.rows, "rows", o.rows, "prunable outbox rows")
			fs.IntVar(&o.writers, "writers", o.writers, "writers deleting during the sweep")
			fs.IntVar(&o.tasks, "tasks", o.tasks, "live tasks available to those deletes")
			fs.DurationVar(&o.before, "before", o.before, "how long the deletes run alone first, for comparison")
			return one(func(ctx context.Context, env *Env) (retentionResult, error) { return runRetention(ctx, env, o) })
		}})
}

type retentionOpts struct {
	rows, writers, tasks int
	before               time.Duration
}

type retentionResult struct {
	Header
	Rows              int     `json:"rows"`
	Pruned            int64   `json:"pruned"`
	Batches           int     `json:"batches"`
	BatchSize         int     `json:"batch_size"`
	Seconds           float64 `json:"seconds"`
	RowsPerS          float64 `json:"rows_per_s"`
	LongestBatchMS    float64 `json:"longest_batch_ms"`
	ConcurrentDeletes int64   `json:"concurrent_deletes"`
	DeleteErrors      int64   `json:"delete_errors"`
	DeleteP50MS       float64 `json:"delete_p50_ms"`
	DeleteP99MS       float64 `json:"delete_p99_ms"`
	DeleteMaxMS       float64 `json:"delete_max_ms"`
	// The same deletes alone just before the sweep, for comparison.
	DeleteP50BeforeMS float64 `json:"delete_p50_before_ms"`
	DeleteP99BeforeMS float64 `json:"delete_p99_before_ms"`
}

// runRetention loads rows prunable events (numbered, in the stream frozen at schema 18, whose
// rows retention removes one by one; 60 days old; no consumer holding them back) and times one Retention.Sweep with the default batch size and a budget of rows, while
// writers keep deleting tasks of the same project through the reference host.
func runRetention(ctx context.Context, env *Env, o retentionOpts) (retentionResult, error) {
	cfg := outbox.Config{RetentionBudget: o.rows}.WithDefaults()
	cfg.RetentionBudget = max(o.rows, cfg.RetentionBatchSize)
	res := retentionResult{Header: env.Header("retention"), Rows: o.rows, BatchSize: cfg.RetentionBatchSize}
	if o.rows < 1 || o.writers < 1 || o.tasks < 1 {
		return res, errors.New("retention: need rows, writers and tasks >= 1")
	}
	db, err := env.NewDB(ctx, "retention")
	if err != nil {
		return res, err
	}
	defer db.Drop()
	pool, hostPool, closePools, err := db.Pools(ctx, int32(o.writers+4), nil)
	if err != nil {
		return res, err
	}
	defer closePools()
	const project = "ret"
	env.Logf("retention: loading %d prunable rows", o.rows)
	if err := insertStreamBacklog(ctx, pool, project, "old", o.rows, 60*24*time.Hour); err != nil {
		return res, err
	}
	if err := createTasks(ctx, pool, project, "t", 1, o.tasks, 1); err != nil {
		return res, err
	}
	store, w, err := newHost(hostPool, true, true)
	if err != nil {
		return res, err
	}
	defer closeWriter(w)()
	// The sweep runs as the operator role, as the host's maintenance sweep would.
	opPool, err := db.OperatorPool(ctx, 2, nil)
	if err != nil {
		return res, err
	}
	defer opPool.Close()
	ret, err := outbox.NewRetention(opPool, cfg, nil, nil)
	if err != nil {
		return res, fmt.Errorf("new retention: %w", err)
	}

	d := &deleter{store: store, project: project, tasks: int64(o.tasks)}
	before := d.runFor(ctx, o.writers, func() { sleepCtx(ctx, o.before) })
	env.Logf("retention: sweeping")
	var sweep outbox.RetentionResult
	var sweepErr error
	during := d.runFor(ctx, o.writers, func() { sweep, sweepErr = ret.Sweep(ctx) })
	if sweepErr != nil {
		return res, sweepErr
	}
	if d.exhausted.Load() {
		env.Logf("retention: the deletes ran out of tasks before the sweep ended; raise -tasks")
	}
	res.Pruned, res.Batches = sweep.Pruned(), sweep.Batches
	res.Seconds, res.RowsPerS = seconds(sweep.Elapsed), perSecond(sweep.Pruned(), sweep.Elapsed)
	res.LongestBatchMS = ms(sweep.LongestBatch)
	res.ConcurrentDeletes, res.DeleteErrors = int64(len(during.calls)), during.errors
	l, b := summarize(during.calls), summarize(before.calls)
	res.DeleteP50MS, res.DeleteP99MS, res.DeleteMaxMS = l.P50, l.P99, l.Max
	res.DeleteP50BeforeMS, res.DeleteP99BeforeMS = b.P50, b.P99
	if res.Pruned != int64(o.rows) {
		return res, fmt.Errorf("retention: pruned %d of %d rows", res.Pruned, o.rows)
	}
	return res, ctx.Err()
}

// deleter deletes tasks t-1, t-2, ... of one project through the reference host.
type deleter struct {
	store     *testhost.Store
	project   string
	tasks     int64
	next      atomic.Int64
	exhausted atomic.Bool
}

// runFor deletes on writers goroutines while during runs, and returns what they measured.
func (d *deleter) runFor(ctx context.Context, writers int, during func()) deleteRun {
	stop := make(chan struct{})
	var mu sync.Mutex
	var r deleteRun
	var wg sync.WaitGroup
	for range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				select {
				case <-stop:
					return
				default:
				}
				i := d.next.Add(1)
				if i > d.tasks {
					d.exhausted.Store(true)
					return
				}
				t0 := time.Now()
				_, err := d.store.Delete(ctx, d.project, fmt.Sprintf("t-%d", i))
				el := time.Since(t0)
				mu.Lock()
				if err != nil {
					r.errors++
				} else {
					r.calls = append(r.calls, el)
				}
				mu.Unlock()
			}
		}()
	}
	started := time.Now()
	during()
	close(stop)
	wg.Wait()
	r.elapsed = time.Since(started)
	return r
}

func sleepCtx(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

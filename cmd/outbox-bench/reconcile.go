package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"time"

	"fusion/outbox"
	"fusion/outbox/internal/testhost"
)

func init() {
	register(benchCase{name: "reconcile", usage: "full reconciliation of a project's live tasks",
		flags: func(fs *flag.FlagSet) runner {
			o := reconcileOpts{tasks: 100000}
			fs.IntVar(&o.tasks, "tasks", o.tasks, "live tasks in the project")
			return one(func(ctx context.Context, env *Env) (reconcileResult, error) { return runReconcile(ctx, env, o) })
		}})
}

type reconcileOpts struct{ tasks int }

type reconcileResult struct {
	Header
	Tasks       int     `json:"tasks"`
	Seconds     float64 `json:"seconds"`
	LiveCached  int     `json:"live_cached"`
	StartupSecs float64 `json:"start_seconds"`
}

// runReconcile starts a consumer whose cursor is missing (NewCursor "reconcile") over the
// reference host's LiveTasks seam and an empty cache, and times from Start until the
// reconciliation is done: head and live task IDs read in one snapshot, the cache replaced, the
// cursor written. The cache must then hold every live task.
func runReconcile(ctx context.Context, env *Env, o reconcileOpts) (reconcileResult, error) {
	res := reconcileResult{Header: env.Header("reconcile"), Tasks: o.tasks}
	if o.tasks < 1 {
		return res, errors.New("reconcile: need tasks >= 1")
	}
	db, pool, closeDB, err := env.NewDBPool(ctx, "reconcile", 4)
	if err != nil {
		return res, err
	}
	defer closeDB()
	const project = "rec"
	if err := createTasks(ctx, pool, project, "t", 1, o.tasks, 1); err != nil {
		return res, err
	}
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE tasks"); err != nil {
		return res, fmt.Errorf("vacuum tasks: %w", err)
	}
	host := testhost.New(pool, testhost.Options{})
	cache := testhost.NewCache()
	env.Logf("reconcile: %d live tasks", o.tasks)
	started := time.Now()
	c, err := startConsumer(ctx, db, consumerSpec{id: "bench-reconcile", projects: []string{project},
		cfg: outbox.Config{NewCursor: outbox.NewCursorReconcile}, live: host, cache: cache})
	if err != nil {
		return res, err
	}
	defer c.Close()
	res.StartupSecs = seconds(time.Since(started))
	deadline := started.Add(time.Minute)
	for c.Stats().Reconciliations == 0 {
		if time.Now().After(deadline) || ctx.Err() != nil {
			return res, errors.New("reconcile: no reconciliation within a minute")
		}
		time.Sleep(200 * time.Microsecond)
	}
	res.Seconds = seconds(time.Since(started))
	res.LiveCached = len(cache.Live(project))
	if res.LiveCached != o.tasks {
		return res, fmt.Errorf("reconcile: cache holds %d of %d live tasks", res.LiveCached, o.tasks)
	}
	return res, nil
}

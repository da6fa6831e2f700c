package main

import (
	"context"
	"flag"
	"fmt"
	"strconv"
	"time"
)

func init() {
	register(benchCase{name: "all", usage: "every case, sized to finish in under 5 minutes on 2 cores",
		flags: func(fs *flag.FlagSet) runner {
			drains := "100000,200000,1000000"
			fs.StringVar(&drains, "drain-events", drains, "backlog sizes of the drain runs")
			return func(ctx context.Context, env *Env, emit func(any) error) error {
				return runAll(ctx, env, emit, drains)
			}
		}})
}

// runAll runs every case once (the write case in each configuration the issue names, plus one
// run with the mailbox notice included, and one drain per backlog size), emitting each line as
// soon as its case ends.
func runAll(ctx context.Context, env *Env, emit func(any) error, drains string) error {
	var steps []runner
	for _, w := range []writeOpts{
		{writers: 1, projects: 1, events: 4000, mailbox: mailboxExcluded, notify: true},
		{writers: 16, projects: 16, events: 20000, mailbox: mailboxExcluded, notify: true},
		{writers: 16, projects: 1, events: 20000, mailbox: mailboxExcluded, notify: true},
		{writers: 1, projects: 1, events: 4000, mailbox: mailboxIncluded, notify: true},
	} {
		steps = append(steps, one(func(ctx context.Context, env *Env) (writeResult, error) { return runWrite(ctx, env, w) }))
	}
	steps = append(steps, one(func(ctx context.Context, env *Env) (sequenceResult, error) {
		return runSequence(ctx, env, sequenceOpts{events: 200000, projects: 1, backlog: defaultBacklog()})
	}))
	for _, d := range splitList(drains) {
		n, err := strconv.Atoi(d)
		if err != nil || n < 1 {
			return fmt.Errorf("all: bad drain size %q", d)
		}
		steps = append(steps, one(func(ctx context.Context, env *Env) (drainResult, error) {
			return runDrain(ctx, env, drainOpts{events: n, batch: 1000, poll: time.Second, backlog: defaultBacklog()})
		}))
	}
	steps = append(steps,
		one(func(ctx context.Context, env *Env) (latencyResult, error) {
			return runLatency(ctx, env, latencyOpts{rate: 1000, seconds: 10, writers: 8})
		}),
		one(func(ctx context.Context, env *Env) (fanoutResult, error) {
			return runFanout(ctx, env, fanoutOpts{consumers: 4, events: 20000, backlog: defaultBacklog()})
		}),
		func(ctx context.Context, env *Env, emit func(any) error) error {
			o := oooOpts{hold: 2 * time.Second, events: 200, writers: 4}
			for _, c := range []string{oooOutboxTx, oooUnrelatedTx} {
				r, err := runOOO(ctx, env, o, c)
				if err != nil {
					return err
				}
				if err := emit(r); err != nil {
					return err
				}
			}
			return nil
		},
		one(func(ctx context.Context, env *Env) (reconcileResult, error) {
			return runReconcile(ctx, env, reconcileOpts{tasks: 100000})
		}),
		one(func(ctx context.Context, env *Env) (limitsResult, error) {
			return runLimits(ctx, env, limitsOpts{writers: "1,16", events: "4000,16000", readEvents: 200000, page: 1000})
		}),
		one(func(ctx context.Context, env *Env) (retentionResult, error) {
			return runRetention(ctx, env, retentionOpts{rows: 1000000, writers: 4, tasks: 200000, before: 2 * time.Second})
		}),
	)
	for _, s := range steps {
		if err := s(ctx, env, emit); err != nil {
			return err
		}
	}
	return nil
}

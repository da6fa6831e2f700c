package main

import (
	"context"
	"flag"
	"fmt"
	"time"
)

func init() {
	register(benchCase{name: "all", usage: "every case (about 29 minutes on 2 cores; -quick: a smoke run of a few minutes)",
		flags: func(fs *flag.FlagSet) runner {
			o := allOpts{drains: "10000,100000,200000,1000000:50"}
			fs.StringVar(&o.drains, "drain-events", o.drains, "backlog sizes of the drain runs, each N or N:deletes-per-prewrite-transaction")
			fs.BoolVar(&o.quick, "quick", o.quick, "every case at small sizes, to check the run and its chart end to end (the figures mean little)")
			return func(ctx context.Context, env *Env, emit func(any) error) error {
				return runAll(ctx, env, emit, o)
			}
		}})
}

type allOpts struct {
	drains string
	quick  bool
}

// runAll runs every case once (the write case in each configuration the issue names, plus one
// run with the mailbox notice included and one with a writer role granted 10,000 projects one
// by one, one drain per backlog size, sustained with 1 to 16 consumers, the standby curves,
// the scale curves, and longtx last), emitting each line as soon as its case ends. The drains'
// unsequenced backlogs are written one delete per transaction, as the host writes them, up to
// 200k events, and 50 per transaction for 1M, where one per transaction would take minutes;
// every line says which (prewrite_per_tx). Each drain is printed twice, as its drain line and
// as the same measurement's point of the scale case's drain_vs_backlog curve, so that the
// backlogs are not written twice; the scale case itself then runs its idle curves only.
func runAll(ctx context.Context, env *Env, emit func(any) error, o allOpts) error {
	// size picks the full size, or the small one with -quick.
	size := func(full, small int) int {
		if o.quick {
			return small
		}
		return full
	}
	drains := o.drains
	scale := defaultScaleOpts()
	scale.curves = curveIdleConsumers + "," + curveIdleProjects
	if o.quick {
		drains = "10000,20000:10"
		scale.consumers, scale.projects, scale.window, scale.settle = "1,4", "1,100", 3*time.Second, time.Second
	}
	sizes, err := parseSizes(drains)
	if err != nil {
		return fmt.Errorf("all: %w", err)
	}
	var steps []runner
	for _, w := range []writeOpts{
		{writers: 1, projects: 1, events: size(4000, 400), mailbox: mailboxExcluded, notify: true},
		{writers: 16, projects: 16, events: size(20000, 2000), mailbox: mailboxExcluded, notify: true},
		{writers: 16, projects: 1, events: size(20000, 2000), mailbox: mailboxExcluded, notify: true},
		{writers: 1, projects: 1, events: size(4000, 400), mailbox: mailboxIncluded, notify: true},
		// A project-scoped writer role, granted its projects one by one.
		{writers: 16, projects: 16, events: size(20000, 2000), mailbox: mailboxExcluded, notify: true, grants: size(10000, 1000)},
	} {
		steps = append(steps, one(func(ctx context.Context, env *Env) (writeResult, error) { return runWrite(ctx, env, w) }))
	}
	steps = append(steps, one(func(ctx context.Context, env *Env) (sequenceResult, error) {
		return runSequence(ctx, env, sequenceOpts{events: size(200000, 10000), projects: 1, backlog: defaultBacklog()})
	}))
	// A consumer of many projects after a pause: one event in each, numbered in one call.
	steps = append(steps, one(func(ctx context.Context, env *Env) (sequenceResult, error) {
		return runSequence(ctx, env, sequenceOpts{events: size(5000, 500), projects: size(5000, 500), backlog: defaultBacklog()})
	}))
	for _, s := range sizes {
		b := defaultBacklog()
		b.perTx = s.perTx
		steps = append(steps, func(ctx context.Context, env *Env, emit func(any) error) error {
			h := env.Header("scale")
			r, err := runDrain(ctx, env, drainOpts{events: s.events, batch: 1000, poll: time.Second, backlog: b})
			if err != nil {
				return err
			}
			if err := emit(r); err != nil {
				return err
			}
			return emit(drainScaleLine(h, r))
		})
	}
	// The two rates of issue 16's latency goal; each line's achieved_rate says whether the
	// writers reached its rate on this machine.
	for _, o := range []latencyOpts{{rate: 1000, writers: 8}, {rate: 5000, writers: 16}} {
		o.seconds = float64(size(10, 2))
		steps = append(steps, one(func(ctx context.Context, env *Env) (latencyResult, error) { return runLatency(ctx, env, o) }))
	}
	steps = append(steps,
		one(func(ctx context.Context, env *Env) (fanoutResult, error) {
			return runFanout(ctx, env, fanoutOpts{consumers: 4, events: size(20000, 2000), backlog: defaultBacklog()})
		}),
	)
	for _, k := range []int{1, 2, 4, 8, 16} {
		steps = append(steps, one(func(ctx context.Context, env *Env) (sustainedResult, error) {
			return runSustained(ctx, env, sustainedOpts{writers: 16, consumers: k, projects: 16, seconds: float64(size(20, 3)),
				tasks: size(400000, 100000), mailbox: mailboxIncluded})
		}))
	}
	// Issue 33's standby curves: K = 1, 4, 16 reading from the primary and from a standby, and
	// the hook and ticker with no consumer, at 1,000 deletes/s (about 3 minutes).
	steps = append(steps, func(ctx context.Context, env *Env, emit func(any) error) error {
		so := defaultStandbyOpts()
		if o.quick {
			so.consumers, so.rate, so.seconds = "1,4", 200, 2
		}
		return runStandbyCurve(ctx, env, so, emit)
	})
	steps = append(steps,
		func(ctx context.Context, env *Env, emit func(any) error) error {
			return runScale(ctx, env, scale, emit)
		},
		func(ctx context.Context, env *Env, emit func(any) error) error {
			o := oooOpts{hold: 2 * time.Second, events: size(200, 40), writers: 4}
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
			return runReconcile(ctx, env, reconcileOpts{tasks: size(100000, 10000)})
		}),
		one(func(ctx context.Context, env *Env) (limitsResult, error) {
			events := "4000,16000"
			if o.quick {
				events = "400,1600"
			}
			return runLimits(ctx, env, limitsOpts{writers: "1,16", events: events, readEvents: size(200000, 20000), page: 1000})
		}),
		one(func(ctx context.Context, env *Env) (retentionResult, error) {
			return runRetention(ctx, env, retentionOpts{rows: size(1000000, 50000), writers: 4, tasks: size(200000, 20000), before: 2 * time.Second})
		}),
		// Issue 33's long transaction: 1,000 deletes/s for 5 minutes with an xid held open,
		// first minute against last (-quick: 20 s, windows of 5 s).
		one(func(ctx context.Context, env *Env) (longTxResult, error) {
			lt := defaultLongTxOpts()
			lt.seconds, lt.window = float64(size(300, 20)), float64(size(60, 5))
			return runLongTx(ctx, env, lt)
		}),
	)
	for _, s := range steps {
		if err := s(ctx, env, emit); err != nil {
			return err
		}
	}
	return nil
}

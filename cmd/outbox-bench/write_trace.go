package main

import (
	"context"
	"flag"
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"fusion/outbox"
	"fusion/outbox/internal/testhost"
)

func init() {
	register(benchCase{name: "write-trace", usage: "the writer hook's cost of capturing the trace context: untraced, host span only, traced",
		flags: func(fs *flag.FlagSet) runner {
			o := writeTraceOpts{writers: 4, events: 8000, projects: 4}
			fs.IntVar(&o.writers, "writers", o.writers, "concurrent writers")
			fs.IntVar(&o.events, "events", o.events, "deletes per side")
			fs.IntVar(&o.projects, "projects", o.projects, "projects the deletes spread over")
			return one(func(ctx context.Context, env *Env) (writeTraceResult, error) { return runWriteTrace(ctx, env, o) })
		}})
}

type writeTraceOpts struct{ writers, events, projects int }

type writeTraceResult struct {
	Header
	Writers  int `json:"writers"`
	Projects int `json:"projects"`
	Events   int `json:"events"`
	// Untraced: no tracer anywhere, the module's insert as without tracing.
	Untraced WriteSide `json:"untraced"`
	// HostSpan: the host starts a span around each delete (an SDK provider, always sampling,
	// batching to an exporter that drops spans), but the module has no TracerProvider.
	HostSpan WriteSide `json:"host_span"`
	// Traced: the same host span, and the module traces too: the hook's create span, its
	// trace context formatted and stored in trace_context.
	Traced WriteSide `json:"traced"`
	// TracedVsHostSpan isolates the module's capture; TracedVsUntraced is the whole of tracing.
	TracedVsHostSpan float64 `json:"traced_vs_host_span"`
	TracedVsUntraced float64 `json:"traced_vs_untraced"`
}

// runWriteTrace measures Store.Delete with the writer hook on three fresh databases,
// interleaved by runABBA (untraced, host span, traced, traced, host span, untraced), with the
// post-commit mailbox notice excluded as in the write case.
func runWriteTrace(ctx context.Context, env *Env, o writeTraceOpts) (writeTraceResult, error) {
	res := writeTraceResult{Header: env.Header("write-trace"), Writers: o.writers, Projects: o.projects, Events: o.events}
	if o.writers < 1 || o.events < 2 || o.projects < 1 {
		return res, fmt.Errorf("write-trace: need writers >= 1, events >= 2, projects >= 1")
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()),
		sdktrace.WithBatcher(tracetest.NewNoopExporter()))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	host := func(hostSpan, moduleTraces bool) sideSetup {
		return func(ctx context.Context, admin, pool *pgxpool.Pool) (deleteFunc, func(), error) {
			if _, err := admin.Exec(ctx, skipMailboxSQL); err != nil {
				return nil, nil, fmt.Errorf("exclude mailbox: %w", err)
			}
			cfg := outbox.Config{WriterLabel: "bench"}
			if moduleTraces {
				cfg.TracerProvider = tp
			}
			w, err := outbox.NewWriter(pool, cfg, nil)
			if err != nil {
				return nil, nil, fmt.Errorf("new writer: %w", err)
			}
			del := hostDelete(testhost.New(pool, testhost.Options{Writer: w}))
			if hostSpan {
				del = withHostSpan(tp.Tracer("bench-host"), del)
			}
			return del, closeWriter(w), nil
		}
	}
	var sides []*side
	defer func() {
		for _, s := range sides {
			s.Close()
		}
	}()
	for _, spec := range []struct {
		name             string
		hostSpan, traced bool
	}{{"write_untraced", false, false}, {"write_host_span", true, false}, {"write_traced", true, true}} {
		s, err := newSide(ctx, env, spec.name, o.writers, o.events, o.projects, host(spec.hostSpan, spec.traced))
		if err != nil {
			return res, err
		}
		sides = append(sides, s)
	}
	if err := runABBA(ctx, env, o.writers, sides...); err != nil {
		return res, err
	}
	res.Untraced, res.HostSpan, res.Traced = sides[0].summary(), sides[1].summary(), sides[2].summary()
	res.TracedVsHostSpan = ratio(res.Traced.TxPerS, res.HostSpan.TxPerS)
	res.TracedVsUntraced = ratio(res.Traced.TxPerS, res.Untraced.TxPerS)
	return res, nil
}

// withHostSpan runs each delete under a span of the host's, as a traced request handler would.
func withHostSpan(tracer trace.Tracer, del deleteFunc) deleteFunc {
	return func(ctx context.Context, j deleteJob) (string, error) {
		ctx, span := tracer.Start(ctx, "DELETE /tasks")
		defer span.End()
		return del(ctx, j)
	}
}

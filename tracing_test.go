package outbox_test

import (
	"context"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/outboxtest"
)

// tracedProcess is a simulated process's tracer provider and what it exported.
type tracedProcess struct {
	tp  *sdktrace.TracerProvider
	exp *tracetest.InMemoryExporter
}

func newTracedProcess(t *testing.T) tracedProcess {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp), sdktrace.WithSampler(sdktrace.AlwaysSample()))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return tracedProcess{tp: tp, exp: exp}
}

// spans returns the exported spans named name.
func (p tracedProcess) spans(name string) tracetest.SpanStubs {
	var out tracetest.SpanStubs
	for _, s := range p.exp.GetSpans() {
		if s.Name == name {
			out = append(out, s)
		}
	}
	return out
}

func attrs(s tracetest.SpanStub) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes {
		m[kv.Key] = kv.Value
	}
	return m
}

// spanProbe is an observed listener that records the span its context carries and starts a
// span of the host's own under it.
type spanProbe struct {
	tracer trace.Tracer
	mu     sync.Mutex
	seen   []trace.SpanContext
	fail   func(outbox.ObservedEvent) bool
}

func (p *spanProbe) Name() string { return "span-probe" }

func (p *spanProbe) HandleObserved(ctx context.Context, ev outbox.ObservedEvent) error {
	_, span := p.tracer.Start(ctx, "host refresh")
	defer span.End()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.seen = append(p.seen, trace.SpanFromContext(ctx).SpanContext())
	if p.fail != nil && p.fail(ev) {
		return testkit.ErrListener
	}
	return nil
}

func (p *spanProbe) setFail(fn func(outbox.ObservedEvent) bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fail = fn
}

// TestTraceOfOneDeletionAcrossTwoProcesses: the host's delete request in one process, with the
// writer hook's span under it; in another process the consumer's span for that event, linked
// to the writer's span and carrying the messaging attributes, with the host's listener span
// nested under it.
func TestTraceOfOneDeletionAcrossTwoProcesses(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	wt, ct := newTracedProcess(t), newTracedProcess(t)
	wcfg := testkit.FastConfig()
	wcfg.TracerProvider = wt.tp
	writer := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: []string{"alpha"}, Config: wcfg})
	_, err := writer.Store.CreateMany(ctx, "alpha", "t", 1)
	require.NoError(t, err)

	ccfg := testkit.FastConfig()
	ccfg.TracerProvider = ct.tp
	probe := &spanProbe{tracer: ct.tp.Tracer("host")}
	observer := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "dashboard", Projects: []string{"alpha"}, Config: ccfg, Listeners: []outbox.Listener{probe}})

	reqCtx, request := wt.tp.Tracer("host").Start(ctx, "DELETE /tasks/t-1")
	res, err := writer.Store.Delete(reqCtx, "alpha", "t-1")
	require.NoError(t, err)
	request.End()
	evs := observer.Rec.WaitCount(t, ctx, 1)
	observer.Stop(t)

	creates := wt.spans("create alpha")
	require.Len(t, creates, 1)
	create := creates[0]
	require.Equal(t, trace.SpanKindProducer, create.SpanKind)
	require.Equal(t, request.SpanContext().SpanID(), create.Parent.SpanID(), "the hook's span is a child of the host's request")
	require.Equal(t, "fusion_outbox", attrs(create)["messaging.system"].AsString())
	require.Equal(t, res.Event.EventID, attrs(create)["messaging.message.id"].AsString())

	var stored string
	require.NoError(t, writer.Pool.QueryRow(ctx, `SELECT trace_context FROM lifecycle_event_log`).Scan(&stored))
	w3c := propagation.TraceContext{}.Extract(ctx, propagation.MapCarrier{"traceparent": stored})
	require.Equal(t, create.SpanContext.SpanID(), trace.SpanContextFromContext(w3c).SpanID(), "a W3C traceparent of the hook's span")

	processes := ct.spans("process alpha")
	require.Len(t, processes, 1)
	proc := processes[0]
	require.Equal(t, trace.SpanKindConsumer, proc.SpanKind)
	require.False(t, proc.Parent.IsValid(), "linked, not parented")
	require.NotEqual(t, create.SpanContext.TraceID(), proc.SpanContext.TraceID(), "a trace of its own")
	require.Len(t, proc.Links, 1)
	require.Equal(t, create.SpanContext.TraceID(), proc.Links[0].SpanContext.TraceID())
	require.Equal(t, create.SpanContext.SpanID(), proc.Links[0].SpanContext.SpanID())
	a := attrs(proc)
	require.Equal(t, "fusion_outbox", a["messaging.system"].AsString())
	require.Equal(t, "process", a["messaging.operation.type"].AsString())
	require.Equal(t, "alpha", a["messaging.destination.name"].AsString())
	require.Equal(t, "dashboard", a["messaging.consumer.group.name"].AsString())
	require.Equal(t, evs[0].EventID, a["messaging.message.id"].AsString())
	require.Equal(t, int64(1), a["messaging.fusion_outbox.delivery_attempt"].AsInt64())
	require.Equal(t, "delivered", a["messaging.fusion_outbox.outcome"].AsString())

	probe.mu.Lock()
	require.Equal(t, []trace.SpanContext{proc.SpanContext}, probe.seen, "the listener's context carries the process span")
	probe.mu.Unlock()
	refresh := ct.spans("host refresh")
	require.Len(t, refresh, 1)
	require.Equal(t, proc.SpanContext.SpanID(), refresh[0].Parent.SpanID(), "the host's own span nests under it")
}

// TestRetriedAndReplayedEventsLinkToTheSameCreation: every attempt of a failing event, the
// retries and the operator's replay, is a span of its own linked to the one creation.
func TestRetriedAndReplayedEventsLinkToTheSameCreation(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	wt, ct := newTracedProcess(t), newTracedProcess(t)
	wcfg := testkit.FastConfig()
	wcfg.TracerProvider = wt.tp
	writer := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: []string{"p"}, Config: wcfg})
	_, err := writer.Store.CreateMany(ctx, "p", "t", 1)
	require.NoError(t, err)
	_, err = writer.Store.Delete(ctx, "p", "t-1")
	require.NoError(t, err)

	ccfg := testkit.FastConfig()
	ccfg.TracerProvider = ct.tp
	ccfg.RetrySchedule = []time.Duration{10 * time.Millisecond}
	ccfg.MaxAttempts = 3
	probe := &spanProbe{tracer: ct.tp.Tracer("host"), fail: func(outbox.ObservedEvent) bool { return true }}
	observer := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "engine", Projects: []string{"p"}, Config: ccfg, Listeners: []outbox.Listener{probe}})
	testkit.WaitCursor(t, ctx, writer.Pool, "p", "engine", 1) // parked after three attempts
	probe.setFail(nil)
	_, err = outbox.NewAdmin(writer.Pool, outbox.AdminOptions{}).RequestReplay(ctx, outbox.ReplayRequest{ProjectID: "p",
		ConsumerID: "engine", Sequence: 1, Operator: outbox.Operator{Actor: "oncall", Reason: "FN-17"}})
	require.NoError(t, err)
	observer.Rec.WaitFor(t, ctx, "the replay", func(evs []outbox.ObservedEvent) bool {
		return len(evs) > 0 && evs[len(evs)-1].Replay
	})
	observer.Stop(t)

	creates := wt.spans("create p")
	require.Len(t, creates, 1)
	processes := ct.spans("process p")
	require.Len(t, processes, 4, "three attempts and the replay")
	for i, s := range processes {
		a := attrs(s)
		require.Equal(t, int64(i+1), a["messaging.fusion_outbox.delivery_attempt"].AsInt64())
		require.Len(t, s.Links, 1)
		require.Equal(t, creates[0].SpanContext.SpanID(), s.Links[0].SpanContext.SpanID(), "attempt %d links to the creation", i+1)
		require.Equal(t, creates[0].SpanContext.TraceID(), s.Links[0].SpanContext.TraceID())
		if i < 3 {
			require.Equal(t, codes.Error, s.Status.Code)
			require.Equal(t, "listener_error", a["messaging.fusion_outbox.failure_class"].AsString())
			require.False(t, a["messaging.fusion_outbox.replay"].AsBool())
		} else {
			require.Equal(t, codes.Unset, s.Status.Code)
			require.True(t, a["messaging.fusion_outbox.replay"].AsBool())
		}
	}
}

// TestSpansForReconciliationAndRetention covers the two maintenance paths.
func TestSpansForReconciliationAndRetention(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	tp := newTracedProcess(t)
	cfg := testkit.FastConfig()
	cfg.TracerProvider = tp.tp
	cfg.NewCursor = outbox.NewCursorReconcile
	w := seedDeletes(t, ctx, db.URL, "p", 3)
	obs := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "late", Projects: []string{"p"}, Config: cfg})
	testkit.WaitCursor(t, ctx, w.Pool, "p", "late", 3)
	obs.Stop(t)
	rec := tp.spans("outbox reconcile")
	require.Len(t, rec, 1)
	require.Equal(t, "missing_cursor", attrs(rec[0])["messaging.fusion_outbox.reconcile_reason"].AsString())

	clock := outboxtest.NewFakeClock()
	clock.Advance(365 * 24 * time.Hour)
	rcfg := cfg
	rcfg.Clock = clock
	retention := testkit.NewRetention(t, w.Pool, rcfg)
	res, err := retention.Sweep(ctx)
	require.NoError(t, err)
	sweeps := tp.spans("outbox retention sweep")
	require.Len(t, sweeps, 1)
	require.Equal(t, res.Pruned(), attrs(sweeps[0])["messaging.fusion_outbox.pruned_rows"].AsInt64())
	require.Equal(t, int64(3), res.Pruned())
}

// TestNoTracerStoresNoTraceContext: without a provider the column stays NULL.
func TestNoTracerStoresNoTraceContext(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	w := seedDeletes(t, ctx, db.URL, "p", 2)
	require.Equal(t, 2, pgtest.QueryInt(t, w.Pool, `SELECT count(*) FROM lifecycle_event_log WHERE trace_context IS NULL`))
}

// TestStoredTraceContextIsW3C: the stored form agrees with the W3C propagator both ways,
// tracestate included, and a damaged value yields no link rather than an error.
func TestStoredTraceContextIsW3C(t *testing.T) {
	t.Parallel()
	ts, err := trace.ParseTraceState("vendor=opaque,other=1")
	require.NoError(t, err)
	sc := trace.NewSpanContext(trace.SpanContextConfig{TraceID: trace.TraceID{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16},
		SpanID: trace.SpanID{9, 8, 7, 6, 5, 4, 3, 2}, TraceFlags: trace.FlagsSampled, TraceState: ts})
	carrier := propagation.MapCarrier{}
	propagation.TraceContext{}.Inject(trace.ContextWithSpanContext(context.Background(), sc), carrier)
	stored := outbox.FormatTraceContext(sc)
	require.Equal(t, carrier["traceparent"]+" "+carrier["tracestate"], stored)
	back, ok := outbox.ParseTraceContext(stored)
	require.True(t, ok)
	require.Equal(t, sc.TraceID(), back.TraceID())
	require.Equal(t, sc.SpanID(), back.SpanID())
	require.True(t, back.IsSampled())
	require.Equal(t, "vendor=opaque,other=1", back.TraceState().String())
	for _, bad := range []string{"", "01-0102", strings.Repeat("z", 55), "00-00000000000000000000000000000000-0000000000000000-01"} {
		_, ok := outbox.ParseTraceContext(bad)
		require.False(t, ok, "%q", bad)
	}
	require.Empty(t, outbox.FormatTraceContext(trace.SpanContext{}))
}

// TestNoSDKInTheModuleBuild: a host that does not trace compiles only the OpenTelemetry API.
func TestNoSDKInTheModuleBuild(t *testing.T) {
	t.Parallel()
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	require.NoError(t, err, "%s", out)
	for _, dep := range strings.Fields(string(out)) {
		require.False(t, strings.HasPrefix(dep, "go.opentelemetry.io/otel/sdk"), "the module's build depends on %s", dep)
	}
	require.Contains(t, string(out), "go.opentelemetry.io/otel/trace\n")
}

// TestTracedWriterRoleRecordsTheTraceContext: the writer role's column grant covers the trace
// context, so a host that traces can run its writer under GrantWriterRole, and a consumer role
// reads the stored context back to link its span.
func TestTracedWriterRoleRecordsTheTraceContext(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilege(t)
	writerPool, _ := lp.component(t, "writer", writerGrant("proj-a"))
	wt := newTracedProcess(t)
	_, err := testhost.New(lp.owner, testhost.Options{}).CreateMany(ctx, "proj-a", "t", 1)
	require.NoError(t, err)
	w, err := outbox.NewWriter(writerPool, outbox.Config{TracerProvider: wt.tp}, zaptest.NewLogger(t))
	require.NoError(t, err)
	defer func() { _ = w.Close(ctx) }()
	_, err = testhost.New(writerPool, testhost.Options{Writer: w}).Delete(ctx, "proj-a", "t-1")
	require.NoError(t, err, "a traced delete as the writer role")
	require.Len(t, wt.spans("create proj-a"), 1)
	require.Equal(t, 1, pgtest.QueryInt(t, lp.owner, `SELECT count(*) FROM lifecycle_event_log WHERE trace_context IS NOT NULL`))

	consumerPool, _ := lp.component(t, "consumer", consumerGrant("dash", "proj-a"))
	cfg := testkit.FastConfig()
	cfg.NewCursor = outbox.NewCursorOldest
	ct := newTracedProcess(t)
	cfg.TracerProvider = ct.tp
	_, rec := startConsumer(t, consumerPool, "dash", []string{"proj-a"}, cfg, nil)
	rec.WaitCount(t, ctx, 1)
	require.Eventually(t, func() bool { return len(ct.spans("process proj-a")) == 1 }, testkit.WaitLimit, 5*time.Millisecond)
	span := ct.spans("process proj-a")[0]
	require.Len(t, span.Links, 1)
	require.Equal(t, wt.spans("create proj-a")[0].SpanContext.TraceID(), span.Links[0].SpanContext.TraceID())
}

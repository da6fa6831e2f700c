package outbox

import (
	"context"
	"encoding/hex"
	"errors"
	"strings"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	semconv "go.opentelemetry.io/otel/semconv/v1.37.0"
	"go.opentelemetry.io/otel/trace"
)

// OpenTelemetry tracing, on when Config.TracerProvider is set. Only the API module is used
// here; the host brings the SDK and its exporters. With no provider every hook below is one
// nil check, the writer runs the same insert as without tracing, and nothing else happens.
//
// One deletion, traced across processes:
//
//   - In the writer, the hook's insert runs in a "create <project>" span (kind producer), a
//     child of whatever span the host's delete transaction context carries. Its W3C trace
//     context (traceparent, and tracestate when there is one) is stored in the event's
//     trace_context column, in the same transaction.
//   - In each observing process, every attempt to dispatch the event is a "process <project>"
//     span (kind consumer) of its own trace, linked, not parented, to the stored context:
//     the messaging conventions' way to tie a consumer to a producer whose trace it does not
//     continue, since one creation is processed many times (by every consumer, on every retry
//     and replay). The listeners' context carries the span, so a host's own spans nest under it.
//   - A reconciliation ("outbox reconcile") and a retention sweep ("outbox retention sweep")
//     get internal spans of their own. Ticks get none.

// TraceMessagingSystem is the messaging.system attribute of the module's spans.
const TraceMessagingSystem = "fusion_outbox"

// The module's own span attributes, under messaging.<system>. as the conventions ask.
const (
	attrAttempt      = attribute.Key("messaging.fusion_outbox.delivery_attempt")
	attrSequence     = attribute.Key("messaging.fusion_outbox.sequence")
	attrReplay       = attribute.Key("messaging.fusion_outbox.replay")
	attrOutcome      = attribute.Key("messaging.fusion_outbox.outcome")
	attrFailureClass = attribute.Key("messaging.fusion_outbox.failure_class")
	attrInserted     = attribute.Key("messaging.fusion_outbox.inserted")
	attrReason       = attribute.Key("messaging.fusion_outbox.reconcile_reason")
	attrPruned       = attribute.Key("messaging.fusion_outbox.pruned_rows")
)

// Span names that do not depend on the project.
const (
	spanReconcile = "outbox reconcile"
	spanRetention = "outbox retention sweep"
)

// tracerName is the instrumentation scope of the module's spans.
const tracerName = "fusion/outbox"

// tracing is a component's tracer; the zero value (no provider) traces nothing.
type tracing struct{ tracer trace.Tracer }

func newTracing(tp trace.TracerProvider) tracing {
	if tp == nil {
		return tracing{}
	}
	return tracing{tracer: tp.Tracer(tracerName)}
}

// start begins an internal span, or returns ctx and nil when tracing is off.
func (t tracing) start(ctx context.Context, name string, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	if t.tracer == nil {
		return ctx, nil
	}
	return t.tracer.Start(ctx, name, trace.WithSpanKind(trace.SpanKindInternal),
		trace.WithAttributes(append(attrs, semconv.MessagingSystemKey.String(TraceMessagingSystem))...))
}

// endSpan ends span (nil: tracing is off), marking it failed when err is set. The status
// carries no error text: it could hold payload prose or secrets.
func endSpan(span trace.Span, err error, attrs ...attribute.KeyValue) {
	if span == nil {
		return
	}
	span.SetAttributes(attrs...)
	if err != nil && !errors.Is(err, context.Canceled) {
		span.SetStatus(codes.Error, "failed")
	}
	span.End()
}

// insertTracedEventSQL is insertEventSQL storing the event's @trace_context too.
const insertTracedEventSQL = `
INSERT INTO lifecycle_event_log
    (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id, prior_column, trace_context)
VALUES (@project, @task_id, @deleted_at, 'task:deleted', @archived, @payload_version, pg_catalog.now() + @clock_offset::interval,
        @writer_process_id, @prior_column, @trace_context)
ON CONFLICT (project_id, task_id, deleted_at) DO NOTHING
RETURNING occurred_at`

// startCreate begins the "create" span of ev's insert and formats its trace context.
func (w *Writer) startCreate(ctx context.Context, ev Event) (context.Context, trace.Span, *string) {
	ctx, span := w.trace.tracer.Start(ctx, "create "+ev.ProjectID, trace.WithSpanKind(trace.SpanKindProducer),
		trace.WithAttributes(semconv.MessagingSystemKey.String(TraceMessagingSystem), semconv.MessagingOperationTypeCreate,
			semconv.MessagingOperationName("create"), semconv.MessagingDestinationName(ev.ProjectID),
			semconv.MessagingMessageID(ev.EventID)))
	return ctx, span, formatTraceContext(span.SpanContext())
}

// insertTraced is the writer hook's insert with tracing on: in a "create" span, storing that
// span's trace context with the event.
func (w *Writer) insertTraced(ctx context.Context, tx pgx.Tx, ev *Event, prior *string) error {
	ctx, span, tc := w.startCreate(ctx, *ev)
	args := w.insertArgs(*ev, prior)
	args["trace_context"] = tc
	err := tx.QueryRow(ctx, insertTracedEventSQL, args).Scan(&ev.OccurredAt)
	switch {
	case err == nil:
		if tc != nil {
			ev.traceContext = *tc
		}
		endSpan(span, nil, attrInserted.Bool(true))
	case errors.Is(err, pgx.ErrNoRows): // recorded before: nothing inserted, not a failure
		endSpan(span, nil, attrInserted.Bool(false))
	default:
		endSpan(span, err)
	}
	return err
}

// processSpan begins the span of one attempt to dispatch ev, linked to the event's creation
// context. With tracing off it returns its arguments and a nil span.
func (t tracing) processSpan(ctx context.Context, ev ObservedEvent) (context.Context, ObservedEvent, trace.Span) {
	if t.tracer == nil {
		return ctx, ev, nil
	}
	opts := []trace.SpanStartOption{trace.WithNewRoot(), trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(semconv.MessagingSystemKey.String(TraceMessagingSystem), semconv.MessagingOperationTypeProcess,
			semconv.MessagingOperationName("process"), semconv.MessagingDestinationName(ev.ProjectID),
			semconv.MessagingConsumerGroupName(string(ev.ConsumerID)), semconv.MessagingMessageID(ev.EventID),
			attrAttempt.Int(ev.Attempt), attrSequence.Int64(ev.Sequence), attrReplay.Bool(ev.Replay))}
	if sc, ok := parseTraceContext(ev.traceContext); ok {
		opts = append(opts, trace.WithLinks(trace.Link{SpanContext: sc}))
	}
	ctx, span := t.tracer.Start(ctx, "process "+ev.ProjectID, opts...)
	ev.span = span
	return ctx, ev, span
}

// endProcessSpan records what the dispatch did and ends the span.
func endProcessSpan(span trace.Span, outcome Outcome, class FailureClass) {
	if span == nil {
		return
	}
	span.SetAttributes(attrOutcome.String(outcomeLabel(outcome)))
	if outcome == Failed {
		span.SetAttributes(attrFailureClass.String(string(class)))
		span.SetStatus(codes.Error, string(class))
	}
	span.End()
}

// listenerContext gives the listeners' context the event's process span, so that a host's
// own spans nest under it.
func (ev ObservedEvent) listenerContext(ctx context.Context) context.Context {
	if ev.span == nil {
		return ctx
	}
	return trace.ContextWithSpan(ctx, ev.span)
}

// formatTraceContext is the stored form of sc: its traceparent ("00-<trace>-<span>-<flags>"),
// then a space and the tracestate when there is one. Neither part of a traceparent contains a
// space, so the first space separates them. Nil when sc is not valid.
func formatTraceContext(sc trace.SpanContext) *string {
	if !sc.IsValid() {
		return nil
	}
	tid, sid := sc.TraceID(), sc.SpanID()
	var b strings.Builder
	state := sc.TraceState().String()
	b.Grow(55 + 1 + len(state))
	b.WriteString("00-")
	b.WriteString(hex.EncodeToString(tid[:]))
	b.WriteByte('-')
	b.WriteString(hex.EncodeToString(sid[:]))
	b.WriteByte('-')
	b.WriteString(hex.EncodeToString([]byte{byte(sc.TraceFlags())}))
	if state != "" {
		b.WriteByte(' ')
		b.WriteString(state)
	}
	s := b.String()
	return &s
}

// parseTraceContext reads what formatTraceContext stored. A value it cannot read (another
// version, a damaged tracestate) yields no link, or a link without the state: tracing must
// never stop a delivery.
func parseTraceContext(s string) (trace.SpanContext, bool) {
	parent, state, _ := strings.Cut(s, " ")
	if len(parent) != 55 || parent[:3] != "00-" || parent[35] != '-' || parent[52] != '-' {
		return trace.SpanContext{}, false
	}
	tid, err := trace.TraceIDFromHex(parent[3:35])
	if err != nil {
		return trace.SpanContext{}, false
	}
	sid, err := trace.SpanIDFromHex(parent[36:52])
	if err != nil {
		return trace.SpanContext{}, false
	}
	flags, err := hex.DecodeString(parent[53:])
	if err != nil || len(flags) != 1 {
		return trace.SpanContext{}, false
	}
	cfg := trace.SpanContextConfig{TraceID: tid, SpanID: sid, TraceFlags: trace.TraceFlags(flags[0]) & trace.FlagsSampled, Remote: true}
	if state != "" {
		if ts, err := trace.ParseTraceState(state); err == nil {
			cfg.TraceState = ts
		}
	}
	sc := trace.NewSpanContext(cfg)
	return sc, sc.IsValid()
}

package outbox

import (
	"context"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	semconv "go.opentelemetry.io/otel/semconv/v1.37.0"
	"go.opentelemetry.io/otel/trace"
)

// BenchmarkTraceCapture is the client-side work tracing adds to one writer hook call, outside
// the database: the create span (an SDK provider, always sampling, batching to an exporter
// that drops spans) and the formatted trace context. The extra bytes the insert carries are
// the rest of its cost; the write-trace case of cmd/outbox-bench measures the whole.
func BenchmarkTraceCapture(b *testing.B) {
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()), sdktrace.WithBatcher(tracetest.NewNoopExporter()))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	tr := newTracing(tp)
	ctx, parent := tp.Tracer("host").Start(context.Background(), "request")
	defer parent.End()
	b.ReportAllocs()
	for b.Loop() {
		_, span := tr.tracer.Start(ctx, "create p", trace.WithSpanKind(trace.SpanKindProducer),
			trace.WithAttributes(semconv.MessagingSystemKey.String(TraceMessagingSystem), semconv.MessagingOperationTypeCreate,
				semconv.MessagingOperationName("create"), semconv.MessagingDestinationName("p"),
				semconv.MessagingMessageID("task-deleted:t-1:2024-01-01T00:00:00.000000Z")))
		_ = formatTraceContext(span.SpanContext())
		endSpan(span, nil, attrInserted.Bool(true))
	}
}

// BenchmarkTraceCaptureOff is the same call site with no provider: the nil check.
func BenchmarkTraceCaptureOff(b *testing.B) {
	w := &Writer{}
	n := 0
	for b.Loop() {
		if w.trace.tracer != nil {
			n++
		}
	}
	_ = n
}

package outbox

import "go.opentelemetry.io/otel/trace"

// The statements of the pooler and tracing work join Statements here, in a file of their own.
func init() {
	Statements["selfTestNotifySQL"] = selfTestNotifySQL
	Statements["insertTracedEventSQL"] = insertTracedEventSQL
}

// FormatTraceContext and ParseTraceContext expose the stored form of a trace context.
func FormatTraceContext(sc trace.SpanContext) string {
	if s := formatTraceContext(sc); s != nil {
		return *s
	}
	return ""
}

func ParseTraceContext(s string) (trace.SpanContext, bool) { return parseTraceContext(s) }

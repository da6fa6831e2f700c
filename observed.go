package outbox

import "context"

// Observed describes the delivery an observed context belongs to.
type Observed struct {
	ConsumerID      ConsumerID
	EventID         string
	WriterProcessID string // the process that wrote the event: its origin
}

type observedKey struct{}

// WithObserved marks ctx as observed. The dispatcher does this for every listener call; hosts
// rarely need it except to test their own fences.
func WithObserved(ctx context.Context, o Observed) context.Context {
	return context.WithValue(ctx, observedKey{}, o)
}

// ObservedFrom returns the observed marker of ctx, if any.
func ObservedFrom(ctx context.Context) (Observed, bool) {
	o, ok := ctx.Value(observedKey{}).(Observed)
	return o, ok
}

// IsObserved reports whether ctx belongs to an observed delivery.
func IsObserved(ctx context.Context) bool {
	_, ok := ObservedFrom(ctx)
	return ok
}

// RefuseObserved returns a *FenceError naming operation when ctx is observed, and nil
// otherwise. Every writer-owned side effect of a host (the delete mutation, its audit row, its
// mailbox notice) calls it first and writes nothing when it fails.
func RefuseObserved(ctx context.Context, operation string) error {
	if IsObserved(ctx) {
		return &FenceError{Operation: operation}
	}
	return nil
}

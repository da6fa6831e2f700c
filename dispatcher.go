package outbox

import (
	"context"
	"runtime/debug"
	"time"

	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"
)

// ObservedEvent is an event as the observed listeners receive it: always marked observed, with
// the writer's process ID (its origin) and the event ID to deduplicate on.
type ObservedEvent struct {
	Event
	Observed   bool       `json:"observed"` // always true
	ConsumerID ConsumerID `json:"consumerId"`
	Attempt    int        `json:"attempt"` // 1 on first delivery
	Replay     bool       `json:"replay,omitempty"`

	span trace.Span // this attempt's process span, nil when not tracing (tracing.go)
}

// Listener is an observed-safe listener. It must be idempotent (delivery is at-least-once) and
// must not perform writer-owned side effects: the context it gets is marked observed, and the
// writer hook and the host's writer-owned paths refuse such a context.
type Listener interface {
	// Name identifies the listener in logs.
	Name() string
	HandleObserved(ctx context.Context, ev ObservedEvent) error
}

// ListenerFunc adapts a function to a Listener.
func ListenerFunc(name string, fn func(context.Context, ObservedEvent) error) Listener {
	return listenerFunc{name, fn}
}

type listenerFunc struct {
	name string
	fn   func(context.Context, ObservedEvent) error
}

func (l listenerFunc) Name() string { return l.name }
func (l listenerFunc) HandleObserved(ctx context.Context, ev ObservedEvent) error {
	return l.fn(ctx, ev)
}

// FailureClass is the bounded reason an event's delivery failed. It is stored and audited
// instead of error text, which could carry payload prose or secrets.
type FailureClass string

// The failure classes.
const (
	FailureListenerError    FailureClass = "listener_error"
	FailureListenerPanic    FailureClass = "listener_panic"
	FailureListenerTimeout  FailureClass = "listener_timeout"
	FailureCacheError       FailureClass = "cache_error"
	FailureUnsupportedEvent FailureClass = "unsupported_event"
)

// Outcome is what dispatching one event did.
type Outcome int

// Dispatch outcomes.
const (
	// Delivered: the cache applied the deletion and every listener succeeded.
	Delivered Outcome = iota + 1
	// Own: this process wrote the event and its local path already handled it.
	Own
	// Failed: see the FailureClass.
	Failed
	// Interrupted: the consumer is stopping; nothing is recorded and the event is retried by
	// whoever holds the lease next.
	Interrupted
)

// DispatcherOptions configure a Dispatcher.
type DispatcherOptions struct {
	// Listeners are the host's observed-safe listeners. Their order is not significant.
	Listeners []Listener
	// Cache is the host's live-task cache; nil means the process keeps none.
	Cache TaskCache
	// SelfWriterID is this process's writer process ID: its own events are not delivered to
	// its own listeners a second time.
	SelfWriterID string
	// Timeout bounds one event's dispatch (Config.ListenerTimeout).
	Timeout time.Duration
	Logger  *zap.Logger
}

// Dispatcher hands events to the observed listeners and the cache. It is the fence between
// observation and writer-owned work: it marks every context observed.
type Dispatcher struct {
	listeners []Listener
	cache     TaskCache
	self      string
	timeout   time.Duration
	log       *zap.Logger
}

// NewDispatcher builds a dispatcher.
func NewDispatcher(opts DispatcherOptions) *Dispatcher {
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 30 * time.Second
	}
	d := &Dispatcher{listeners: opts.Listeners, cache: opts.Cache, self: opts.SelfWriterID,
		timeout: opts.Timeout, log: opts.Logger.Named("outbox.dispatch")}
	return d
}

// Dispatch delivers one event: it applies the deletion to the cache (idempotently) and then
// runs every listener. A cache error, or a listener error, panic or timeout, stops the dispatch
// and is returned as its class; a retry runs the whole dispatch again.
func (d *Dispatcher) Dispatch(ctx context.Context, ev ObservedEvent) (Outcome, FailureClass) {
	return d.dispatch(ctx, ev, nil)
}

// dispatch is Dispatch on the caller's listener runner (nil: a goroutine for this event).
func (d *Dispatcher) dispatch(ctx context.Context, ev ObservedEvent, runner **listenerRunner) (Outcome, FailureClass) {
	if ev.WriterProcessID == d.self && d.self != "" && !ev.Replay {
		return Own, ""
	}
	if err := ev.Event.supported(); err != nil {
		d.log.Error("event cannot be interpreted by this build", zap.String("project_id", ev.ProjectID),
			zap.Int64("sequence", ev.Sequence), zap.String("event_id", ev.EventID), zap.Error(err))
		return Failed, FailureUnsupportedEvent
	}
	ev.Observed = true
	octx := WithObserved(ctx, Observed{ConsumerID: ev.ConsumerID, EventID: ev.EventID, WriterProcessID: ev.WriterProcessID})
	// The cache first, as the local delete path does: listeners may read it.
	if d.cache != nil {
		if _, err := d.cache.RemoveTask(octx, ev.ProjectID, ev.TaskID, ev.DeletedAt); err != nil {
			d.log.Warn("cache update failed", zap.String("project_id", ev.ProjectID), zap.String("event_id", ev.EventID), zap.Error(err))
			return Failed, FailureCacheError
		}
	}
	if len(d.listeners) > 0 {
		return d.runListeners(ctx, ev, runner)
	}
	return Delivered, ""
}

// applyToCache records a parked event's deletion in the cache: the task is gone even though
// the listeners never took the event.
func (d *Dispatcher) applyToCache(ctx context.Context, ev Event) {
	if d.cache == nil {
		return
	}
	octx := WithObserved(ctx, Observed{EventID: ev.EventID, WriterProcessID: ev.WriterProcessID})
	if _, err := d.cache.RemoveTask(octx, ev.ProjectID, ev.TaskID, ev.DeletedAt); err != nil {
		d.log.Warn("cache update for a parked event failed", zap.String("event_id", ev.EventID), zap.Error(err))
	}
}

// listenerFailure is how the listener goroutine reports which listener failed and how.
type listenerFailure struct {
	listener string
	class    FailureClass
	err      error
}

// listenerRunner runs the listeners of one event after another on one long-lived goroutine,
// so that a consumer draining a backlog neither starts a goroutine nor builds a timeout context
// per event: the runner keeps one cancellable context for its listeners and one timer it resets
// per event. A runner whose listener overran its time is abandoned (its context cancelled) and
// its goroutine ends when that listener returns; the next event gets a new runner.
type listenerRunner struct {
	jobs   chan listenerJob
	done   chan *listenerFailure
	ctx    context.Context // parent of every listener call; cancelled when the runner is abandoned
	cancel context.CancelFunc
	timer  *time.Timer
}

type listenerJob struct {
	ctx context.Context
	ev  ObservedEvent
}

func (d *Dispatcher) newRunner(parent context.Context) *listenerRunner {
	ctx, cancel := context.WithCancel(parent)
	timer := time.NewTimer(d.timeout)
	timer.Stop()
	r := &listenerRunner{jobs: make(chan listenerJob), done: make(chan *listenerFailure, 1), ctx: ctx, cancel: cancel, timer: timer}
	go func() {
		for j := range r.jobs {
			r.done <- d.callListeners(j.ctx, j.ev)
		}
	}()
	return r
}

// close cancels the runner's context and ends its goroutine once its current event is done.
func (r *listenerRunner) close() {
	if r != nil {
		r.timer.Stop()
		r.cancel()
		close(r.jobs)
	}
}

// runListeners runs every listener, in order, on the runner's goroutine (the caller's, or one
// for this event) under the per-event timeout. A listener that ignores its context and keeps
// running past the timeout is abandoned: its goroutine finishes on its own and the event
// counts as a timeout.
func (d *Dispatcher) runListeners(parent context.Context, ev ObservedEvent, holder **listenerRunner) (Outcome, FailureClass) {
	var own *listenerRunner
	if holder == nil {
		own = d.newRunner(parent)
		defer own.close()
		holder = &own
	} else if *holder == nil {
		*holder = d.newRunner(parent)
	}
	r := *holder
	abandon := func() {
		r.close()
		*holder = nil
	}
	r.timer.Reset(d.timeout)
	defer r.timer.Stop()
	r.jobs <- listenerJob{ev.listenerContext(WithObserved(r.ctx, Observed{ConsumerID: ev.ConsumerID, EventID: ev.EventID, WriterProcessID: ev.WriterProcessID})), ev}
	select {
	case f := <-r.done:
		return d.outcome(parent, ev, f, false)
	case <-r.timer.C:
		select {
		case f := <-r.done: // it finished just as time ran out
			return d.outcome(parent, ev, f, true)
		default:
		}
		abandon()
		d.log.Warn("observed listener timed out", zap.String("event_id", ev.EventID), zap.Duration("timeout", d.timeout))
		return Failed, FailureListenerTimeout
	case <-parent.Done():
	}
	// The consumer is stopping and the listener's context is cancelled: give the listener the
	// rest of its time to return, so that an event it did handle is acknowledged.
	select {
	case f := <-r.done:
		return d.outcome(parent, ev, f, false)
	case <-r.timer.C:
		abandon()
		return Interrupted, ""
	}
}

// callListeners runs the listeners for one event and returns the first failure (nil when every
// listener succeeded), a panic included.
func (d *Dispatcher) callListeners(ctx context.Context, ev ObservedEvent) (failure *listenerFailure) {
	var current Listener
	defer func() {
		if r := recover(); r != nil {
			d.log.Error("observed listener panicked", zap.String("listener", current.Name()),
				zap.String("event_id", ev.EventID), zap.Any("panic", r), zap.ByteString("stack", debug.Stack()))
			failure = &listenerFailure{listener: current.Name(), class: FailureListenerPanic}
		}
	}()
	for _, l := range d.listeners {
		current = l
		if err := l.HandleObserved(ctx, ev); err != nil {
			return &listenerFailure{listener: l.Name(), class: FailureListenerError, err: err}
		}
	}
	return nil
}

// outcome interprets what the listener goroutine reported; timedOut says the event's time ran
// out as it returned.
func (d *Dispatcher) outcome(parent context.Context, ev ObservedEvent, f *listenerFailure, timedOut bool) (Outcome, FailureClass) {
	switch {
	case f == nil:
		return Delivered, ""
	case parent.Err() != nil:
		return Interrupted, "" // a failure while stopping is not an attempt
	case f.class == FailureListenerError && timedOut:
		f.class = FailureListenerTimeout
	}
	if f.err != nil {
		d.log.Warn("observed listener failed", zap.String("listener", f.listener), zap.String("event_id", ev.EventID),
			zap.String("class", string(f.class)), zap.Error(f.err))
	}
	return Failed, f.class
}

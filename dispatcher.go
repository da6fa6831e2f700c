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
	// SelfWriterID is this process's writer process ID (Writer.ProcessID): its own events are
	// applied to the cache but not delivered to its own listeners a second time, since its
	// local path already told them. A Consumer refuses a dispatcher with listeners and no
	// SelfWriterID unless NoLocalWriter says the process records no events.
	SelfWriterID string
	// NoLocalWriter declares that this process records no events (an observer only), so it
	// needs no SelfWriterID. Defaults to false.
	NoLocalWriter bool
	// Timeout bounds one event's dispatch when Dispatch is called directly. Under a Consumer
	// its Config.ListenerTimeout applies; a non-zero Timeout must then agree with it. Defaults
	// to Config.ListenerTimeout's default, 30s.
	Timeout time.Duration
	Logger  *zap.Logger
}

// defaultListenerTimeout is Config.ListenerTimeout's default.
const defaultListenerTimeout = 30 * time.Second

// Dispatcher hands events to the observed listeners and the cache. It is the fence between
// observation and writer-owned work: it marks every context observed.
type Dispatcher struct {
	listeners     []Listener
	cache         TaskCache
	self          string
	noLocalWriter bool
	timeout       time.Duration // 0: set by whoever runs it (a consumer's Config), else the default
	log           *zap.Logger
}

// NewDispatcher builds a dispatcher.
func NewDispatcher(opts DispatcherOptions) *Dispatcher {
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	return &Dispatcher{listeners: opts.Listeners, cache: opts.Cache, self: opts.SelfWriterID, noLocalWriter: opts.NoLocalWriter,
		timeout: max(opts.Timeout, 0), log: opts.Logger.Named("outbox.dispatch")}
}

// checkConsumer reports, as a ValidationError, a dispatcher a consumer with cfg must not run:
// one whose own timeout contradicts Config.ListenerTimeout (one of the two would be silently
// ignored), or one with listeners and no SelfWriterID (the process's own writes would be
// delivered to its listeners a second time) that does not declare the process writes nothing.
func (d *Dispatcher) checkConsumer(cfg consumerConfig) error {
	if d.timeout != 0 && d.timeout != cfg.ListenerTimeout {
		return invalid("DispatcherOptions.Timeout", "is %s but Config.ListenerTimeout is %s: leave it zero and set Config.ListenerTimeout", d.timeout, cfg.ListenerTimeout)
	}
	if d.self == "" && !d.noLocalWriter && len(d.listeners) > 0 {
		return invalid("DispatcherOptions.SelfWriterID", "is empty: set it to this process's Writer.ProcessID(), or set NoLocalWriter when the process records no events")
	}
	return nil
}

// session is one user's run of the dispatcher: the consumer's loop opens one for its whole
// run (s := d.session(ctx, ...); defer s.close()) and owns it, Dispatch one per event. It keeps
// the listener runner (started on first use), the listener timeout of the user's Config, and
// a channel closed when the user must stop at once (a consumer's stop context ended), which
// abandons a listener still running. Only its owner's goroutine uses it.
type session struct {
	d       *Dispatcher
	ctx     context.Context // parent of the runner's context
	timeout time.Duration
	abandon <-chan struct{}
	runner  *listenerRunner
	trace   tracing  // a consumer's: each attempt in a process span
	metrics *Metrics // a consumer's: each attempt measured
}

// session opens a session whose listeners run under ctx. A zero timeout means the
// dispatcher's own (or the default); a nil abandon never fires.
func (d *Dispatcher) session(ctx context.Context, timeout time.Duration, abandon <-chan struct{}) *session {
	if timeout <= 0 {
		timeout = d.timeout
	}
	if timeout <= 0 {
		timeout = defaultListenerTimeout
	}
	return &session{d: d, ctx: ctx, timeout: timeout, abandon: abandon}
}

// close ends the session's listener runner, if it started one.
func (s *session) close() {
	s.runner.close()
	s.runner = nil
}

// attempt is one dispatch attempt as a consumer makes it: in its process span when tracing,
// linked to the event's creation, and measured.
func (s *session) attempt(ctx context.Context, ev ObservedEvent) (Outcome, FailureClass) {
	started := time.Now()
	pctx, ev, span := s.trace.processSpan(ctx, ev)
	outcome, class := s.dispatch(pctx, ev)
	endProcessSpan(span, outcome, class)
	s.metrics.observeDispatch(ev.ProjectID, string(ev.ConsumerID), outcome, time.Since(started))
	return outcome, class
}

// Dispatch delivers one event: it applies the deletion to the cache (idempotently) and then
// runs every listener. A cache error, or a listener error, panic or timeout, stops the dispatch
// and is returned as its class; a retry runs the whole dispatch again. An event this process
// wrote itself (SelfWriterID) goes to the cache only: Own. With ctx already ended nothing is
// done: Interrupted.
func (d *Dispatcher) Dispatch(ctx context.Context, ev ObservedEvent) (Outcome, FailureClass) {
	s := d.session(ctx, 0, nil)
	defer s.close()
	return s.dispatch(ctx, ev)
}

// dispatch is Dispatch within the session.
func (s *session) dispatch(ctx context.Context, ev ObservedEvent) (Outcome, FailureClass) {
	d := s.d
	if ctx.Err() != nil {
		return Interrupted, "" // stopping: no new event is handed over
	}
	if err := ev.Event.supported(); err != nil {
		d.log.Error("event cannot be interpreted by this build", zap.String("project_id", ev.ProjectID),
			zap.Int64("sequence", ev.Sequence), zap.String("event_id", ev.EventID), zap.Error(err))
		return Failed, FailureUnsupportedEvent
	}
	ev.Observed = true
	octx := WithObserved(ctx, Observed{ConsumerID: ev.ConsumerID, EventID: ev.EventID, WriterProcessID: ev.WriterProcessID})
	// The cache first, as the local delete path does: listeners may read it. Own events too:
	// the local path removed the task already, but a reconciliation may have rebuilt the cache
	// from a snapshot taken before that delete committed.
	if d.cache != nil {
		if _, err := d.cache.RemoveTask(octx, ev.ProjectID, ev.TaskID, ev.DeletedAt); err != nil {
			d.log.Warn("cache update failed", zap.String("project_id", ev.ProjectID), zap.String("event_id", ev.EventID), zap.Error(err))
			return Failed, FailureCacheError
		}
	}
	if ev.WriterProcessID == d.self && d.self != "" && !ev.Replay {
		d.handOwn(octx, ev)
		return Own, "" // its local emitter told this process's listeners already
	}
	if len(d.listeners) > 0 {
		return s.runListeners(ctx, ev)
	}
	return Delivered, ""
}

// OwnWritesListener is a Listener that also takes the events this process wrote itself,
// which the dispatcher otherwise keeps from its listeners because the process's local path
// told them already. It is for a listener no local path feeds, such as the event stream
// (web.SSEHandler), which must show the process's own deletions in sequence order with the others
// as soon as they are numbered. HandleOwn runs on the consumer's goroutine before the event is
// acknowledged; it must return at once, and it cannot fail the event.
type OwnWritesListener interface {
	Listener
	HandleOwn(ctx context.Context, ev ObservedEvent)
}

// handOwn gives one of this process's own events to the listeners that take them. A panic is
// logged and contained: the event is the process's own, already applied, and is not retried.
func (d *Dispatcher) handOwn(ctx context.Context, ev ObservedEvent) {
	for _, l := range d.listeners {
		if o, ok := l.(OwnWritesListener); ok {
			d.contained(l, "own-writes", ev.EventID, func() { o.HandleOwn(ctx, ev) })
		}
	}
}

// ParkedListener is a Listener that is also told when the consumer parks an event as a dead
// letter instead of delivering it (its attempts spent, or a row it cannot decode), once the
// cursor has moved past it. It is for a listener that keeps a position in the stream, such as
// the event stream (web.SSEHandler), whose clients must move past the event as the consumer
// did, even when no later event follows. HandleParked runs on the consumer's goroutine; it must
// return at once, and it cannot fail anything.
type ParkedListener interface {
	Listener
	HandleParked(ctx context.Context, ev Event)
}

// handParked tells the listeners that keep a position that ev was parked.
func (d *Dispatcher) handParked(ctx context.Context, ev Event) {
	for _, l := range d.listeners {
		if p, ok := l.(ParkedListener); ok {
			d.contained(l, "parked", ev.EventID, func() { p.HandleParked(ctx, ev) })
		}
	}
}

// contained runs a listener's call that cannot fail the event, logging a panic instead.
func (d *Dispatcher) contained(l Listener, kind, eventID string, call func()) {
	defer func() {
		if r := recover(); r != nil {
			d.log.Error(kind+" listener panicked", zap.String("listener", l.Name()),
				zap.String("event_id", eventID), zap.Any("panic", r))
		}
	}()
	call()
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
	timer := time.NewTimer(time.Hour)
	timer.Stop() // armed per event with that event's timeout
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

// runListeners runs every listener, in order, on the session's runner goroutine under the
// per-event timeout. A listener that ignores its context and keeps running past the timeout is
// abandoned: its goroutine finishes on its own and the event counts as a timeout. Once parent
// ends no event is handed over; one already handed over may finish within its time, unless the
// session says to abandon it first.
func (s *session) runListeners(parent context.Context, ev ObservedEvent) (Outcome, FailureClass) {
	d := s.d
	if s.runner == nil {
		s.runner = d.newRunner(s.ctx)
	}
	r := s.runner
	abandon := func() {
		r.close()
		s.runner = nil
	}
	if parent.Err() != nil {
		return Interrupted, "" // Stop was called while the cache was updated
	}
	timeout := s.timeout
	r.timer.Reset(timeout)
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
		d.log.Warn("observed listener timed out", zap.String("event_id", ev.EventID), zap.Duration("timeout", timeout))
		return Failed, FailureListenerTimeout
	case <-parent.Done():
	}
	// The consumer is stopping and the listener's context is cancelled: give the listener the
	// rest of its time to return, so that an event it did handle is acknowledged, unless the
	// stop cannot wait that long.
	select {
	case f := <-r.done:
		return d.outcome(parent, ev, f, false)
	case <-r.timer.C:
	case <-s.abandon:
	}
	abandon()
	return Interrupted, ""
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

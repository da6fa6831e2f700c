// Package startstop is the one start/stop lifecycle every long-running part of the outbox
// embeds (the consumer, the writer's notifier, the event-stream handler) and a host may embed
// too (the reference host's self-healing sweep does), so that none of them writes the rules by
// hand:
//
//   - Start after Stop refuses with ErrStopped: a stopped service is never revived by a late
//     Start (an fx OnStart racing an OnStop, a retry loop).
//   - Stop is idempotent and safe before Start.
//   - Stop is bounded by its caller's context: it returns that context's error when the service
//     has not finished by then, and the service can see that it should give up (Abandoned).
//   - A Stop during start-up cancels the start-up's context and waits for it like for a run.
//   - A start-up that fails (Run.Failed) leaves the service startable again.
//
// It is public, not internal, because a host copied from example/taskstore uses it as well.
package startstop

import (
	"context"
	"errors"
	"sync"
)

// ErrStopped is returned by Start after Stop.
var ErrStopped = errors.New("stopped")

// ErrStarted is returned by a second Start while the service runs.
var ErrStarted = errors.New("already started")

// Base holds a service's lifecycle. The zero value is ready; embed it or keep it in a field.
type Base struct {
	mu          sync.Mutex
	started     bool
	stopped     bool
	cancel      context.CancelFunc
	done        chan struct{} // closed when the run (or a failed start-up) is over
	stopCtx     context.Context
	abandon     chan struct{} // closed when a Stop's context ended before done
	abandonOnce sync.Once
}

// Run is one start of a service: Ctx lives until Stop, and exactly one of Failed or Finished
// must be called, once the service's start-up failed or its goroutines have all returned.
type Run struct {
	// Ctx is cancelled by Stop. The service's goroutines run on it (not on Start's context,
	// which ends when Start returns).
	Ctx  context.Context
	b    *Base
	done chan struct{}
	once sync.Once
}

// Begin claims a start: it refuses after Stop (ErrStopped) and while running (ErrStarted).
func (b *Base) Begin() (*Run, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	switch {
	case b.stopped:
		return nil, ErrStopped
	case b.started:
		return nil, ErrStarted
	}
	ctx, cancel := context.WithCancel(context.Background())
	b.started, b.cancel, b.done, b.abandon = true, cancel, make(chan struct{}), make(chan struct{})
	b.abandonOnce = sync.Once{}
	return &Run{Ctx: ctx, b: b, done: b.done}, nil
}

// StartContext is ctx, cancelled as well when Stop is called: for a start-up that talks to
// the database and must give up when the service is stopped meanwhile. Call release when the
// start-up is over.
func (r *Run) StartContext(ctx context.Context) (startCtx context.Context, release func()) {
	startCtx, cancel := context.WithCancel(ctx)
	unwatch := context.AfterFunc(r.Ctx, cancel)
	return startCtx, func() { unwatch(); cancel() }
}

// Stopping reports whether Stop was called during this run.
func (r *Run) Stopping() bool { return r.Ctx.Err() != nil }

// Failed reports a start-up that did not succeed and was not stopped: the service may be
// started again.
func (r *Run) Failed() {
	r.once.Do(func() {
		r.b.mu.Lock()
		if !r.b.stopped {
			r.b.started = false
		}
		r.b.cancel()
		r.b.mu.Unlock()
		close(r.done)
	})
}

// Finished reports that the service's goroutines have all returned (or that a start-up was
// given up because Stop was called): a Stop waiting for it returns.
func (r *Run) Finished() {
	r.once.Do(func() {
		r.b.mu.Lock()
		r.b.cancel()
		r.b.mu.Unlock()
		close(r.done)
	})
}

// Stop cancels the run and waits for it to finish, bounded by ctx: when ctx ends first, it
// closes Abandoned and returns ctx's error wrapped. It is idempotent and safe before Start;
// after it, Start refuses.
func (b *Base) Stop(ctx context.Context) error {
	b.mu.Lock()
	first := !b.stopped
	b.stopped = true
	if !b.started {
		b.mu.Unlock()
		return nil
	}
	if first {
		b.stopCtx = ctx
		b.cancel()
	}
	done, abandon := b.done, b.abandon
	b.mu.Unlock()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		b.abandonOnce.Do(func() { close(abandon) })
		return ctx.Err()
	}
}

// StopContext is the first Stop's context, which bounds a service's shutdown writes; before
// any Stop it is context.Background().
func (b *Base) StopContext() context.Context {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.stopCtx == nil {
		return context.Background()
	}
	return b.stopCtx
}

// Abandoned is closed when a Stop's context ended before the run finished: whatever the
// service still waits for (a listener in flight) should be given up. Nil before Start.
func (b *Base) Abandoned() <-chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.abandon
}

// Done is closed when the current run has finished; nil before the first Start.
func (b *Base) Done() <-chan struct{} {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.done
}

// Stopped reports whether Stop has been called.
func (b *Base) Stopped() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.stopped
}

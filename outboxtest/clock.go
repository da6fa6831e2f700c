// Package outboxtest holds helpers for testing code that uses the outbox module.
package outboxtest

import (
	"context"
	"sort"
	"sync"
	"time"

	"fusion/outbox"
)

// FakeClock is an outbox.Clock that moves only when told. Its offset starts at zero, so the
// database clock is unshifted until the first Advance.
type FakeClock struct {
	mu      sync.Mutex
	offset  time.Duration
	timers  []*fakeTimer
	changed chan struct{} // closed and replaced whenever the set of timers changes
}

var _ outbox.Clock = (*FakeClock)(nil)

// NewFakeClock returns a clock at offset zero.
func NewFakeClock() *FakeClock { return &FakeClock{changed: make(chan struct{})} }

// Offset returns how far the clock has been advanced.
func (c *FakeClock) Offset() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.offset
}

// NewTimer returns a timer that fires once the clock has been advanced by d.
func (c *FakeClock) NewTimer(d time.Duration) outbox.Timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{clock: c, at: c.offset + d, ch: make(chan time.Time, 1)}
	if d <= 0 {
		t.ch <- time.Time{}
		return t
	}
	c.timers = append(c.timers, t)
	c.notifyLocked()
	return t
}

// Advance moves the clock forward by d and fires every timer that falls due.
func (c *FakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.offset += d
	sort.Slice(c.timers, func(i, j int) bool { return c.timers[i].at < c.timers[j].at })
	kept := c.timers[:0]
	for _, t := range c.timers {
		if t.at <= c.offset {
			t.ch <- time.Time{}
			continue
		}
		kept = append(kept, t)
	}
	c.timers = kept
	c.notifyLocked()
}

// Waiters returns the deadlines (as offsets) of the timers not fired yet, soonest first.
func (c *FakeClock) Waiters() []time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make([]time.Duration, 0, len(c.timers))
	for _, t := range c.timers {
		out = append(out, t.at)
	}
	sort.Slice(out, func(i, j int) bool { return out[i] < out[j] })
	return out
}

// WaitForTimer blocks until a pending timer with a deadline of at least offset+min exists (a
// consumer has started waiting for something at least that far ahead), or ctx ends.
func (c *FakeClock) WaitForTimer(ctx context.Context, min time.Duration) (time.Duration, error) {
	for {
		c.mu.Lock()
		changed := c.changed
		for _, t := range c.timers {
			if t.at-c.offset >= min {
				d := t.at - c.offset
				c.mu.Unlock()
				return d, nil
			}
		}
		c.mu.Unlock()
		select {
		case <-changed:
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}

func (c *FakeClock) notifyLocked() {
	close(c.changed)
	c.changed = make(chan struct{})
}

type fakeTimer struct {
	clock *FakeClock
	at    time.Duration
	ch    chan time.Time
}

func (t *fakeTimer) C() <-chan time.Time { return t.ch }

func (t *fakeTimer) Stop() bool {
	c := t.clock
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, o := range c.timers {
		if o == t {
			c.timers = append(c.timers[:i], c.timers[i+1:]...)
			c.notifyLocked()
			return true
		}
	}
	return false
}

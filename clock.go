package outbox

import "time"

// Clock is where the module's notion of time comes from.
//
// Leases, backoff and retention are judged by the database clock, so that processes on
// machines with skewed clocks agree. A Clock only shifts that clock (Offset, added to the
// database's now()) and measures waits (NewTimer). Production uses RealClock, whose offset is
// zero; tests use outboxtest.FakeClock to move time forward without sleeping.
type Clock interface {
	// Offset is added to the database clock in every time comparison the module makes.
	Offset() time.Duration
	// NewTimer returns a timer that fires after d on this clock.
	NewTimer(d time.Duration) Timer
}

// Timer is the part of time.Timer the module uses.
type Timer interface {
	C() <-chan time.Time
	Stop() bool
}

// RealClock is the wall clock with no offset.
type RealClock struct{}

// Offset is always zero.
func (RealClock) Offset() time.Duration { return 0 }

// NewTimer wraps time.NewTimer.
func (RealClock) NewTimer(d time.Duration) Timer { return realTimer{time.NewTimer(d)} }

type realTimer struct{ t *time.Timer }

func (t realTimer) C() <-chan time.Time { return t.t.C }
func (t realTimer) Stop() bool          { return t.t.Stop() }

package outbox

import "time"

// When the scan loop wakes: the schedule says, from everything due, when and why. Only the loop
// goroutine uses these.

// wakeReason is why the loop's timer fired.
type wakeReason uint8

const (
	// wakePoll: the poll interval passed (or a failed step's shorter one): a full scan.
	wakePoll wakeReason = iota
	// wakeDeferred: notifications the wake interval deferred may be scanned now.
	wakeDeferred
	// wakeFollowUp: the busy projects are scanned again (followUps).
	wakeFollowUp
	// wakeAck: a stream's cursor write falls due.
	wakeAck
)

func (r wakeReason) String() string {
	switch r {
	case wakePoll:
		return "poll"
	case wakeDeferred:
		return "deferred"
	case wakeFollowUp:
		return "follow-up"
	case wakeAck:
		return "ack"
	}
	return "unknown"
}

// schedule is what the loop waits for between scans. The poll, the deferred notifications, the
// follow-ups and the cursor writes are on the wall clock, and one timer waits for the earliest
// (next). A blocked retry is on the consumer's clock (Config.Clock, shifted: see shiftedNow),
// which a test's FakeClock moves apart from the wall clock: the loop waits for it with a timer
// of that clock (retryIn).
type schedule struct {
	pollInterval     time.Duration // Config.PollInterval
	followUpInterval time.Duration // Config.FollowUpInterval
	pollAt           time.Time     // the next full scan, set by scanned
	// What is due besides the poll, as the loop found it before it waits; zero (false) when
	// nothing is.
	deferredAt time.Time // the earliest deferred notification may be scanned (wakeLimiter.next)
	followUps  bool      // busy projects get follow-up scans (followUps.pending)
	ackAt      time.Time // the earliest cursor write falls due (streams.ackDeadline)
	retryAt    time.Time // on the consumer's clock: the earliest blocked retry (streams.earliestRetry)
}

// scanned moves the next poll after a scan that ended at now: soon (within a second) after a
// step failed, a poll interval after a full scan, and not at all after a scan of some projects.
func (s *schedule) scanned(now time.Time, full, failed bool) {
	switch {
	case failed:
		s.pollAt = now.Add(min(s.pollInterval, time.Second))
	case full:
		s.pollAt = now.Add(s.pollInterval)
	}
}

// next is when the loop wakes on the wall clock, and why: the earliest of the poll, the deferred
// notifications, the follow-up (a follow-up interval from now) and the cursor writes. A time
// already passed wakes it at once; on a tie the poll goes first, since its full scan covers
// the deferred notifications and the follow-ups.
func (s *schedule) next(now time.Time) (at time.Time, why wakeReason) {
	at, why = s.pollAt, wakePoll
	earlier := func(t time.Time, r wakeReason) {
		if !t.IsZero() && t.Before(at) {
			at, why = t, r
		}
	}
	earlier(s.deferredAt, wakeDeferred)
	if s.followUps {
		earlier(now.Add(s.followUpInterval), wakeFollowUp)
	}
	earlier(s.ackAt, wakeAck)
	return at, why
}

// retryIn is the wait, on the consumer's clock at now, until the earliest blocked retry falls
// due; ok is false when no stream waits for one. The wait may be zero or negative: the retry is
// due now.
func (s *schedule) retryIn(now time.Time) (wait time.Duration, ok bool) {
	if s.retryAt.IsZero() {
		return 0, false
	}
	return s.retryAt.Sub(now), true
}

// resting reports whether nothing but the poll is due: the loop rests until its next poll
// (or a notification).
func (s *schedule) resting() bool {
	return s.deferredAt.IsZero() && !s.followUps && s.ackAt.IsZero() && s.retryAt.IsZero()
}

// followUps are the projects being scanned again every interval because a scan of theirs
// made progress within window: under load the writers stay quiet (NotifyGap), and their events
// are found by these scans.
type followUps struct {
	interval, window time.Duration
	last             map[string]time.Time // when a scan of each busy project last made progress
}

// record notes which of the scanned projects (every project when scanned is nil) made progress.
func (f *followUps) record(all streams, scanned map[string]struct{}, now time.Time) {
	if f.window <= 0 {
		return
	}
	for p, st := range all {
		if _, ok := scanned[p]; (scanned == nil || ok) && st.progressed {
			f.last[p] = now
		}
	}
}

// pending reports whether a follow-up scan is due, forgetting projects quiet for a window.
func (f *followUps) pending(now time.Time) bool {
	for p, at := range f.last {
		if now.Sub(at) > f.window {
			delete(f.last, p)
		}
	}
	return len(f.last) > 0
}

// add puts every busy project into scan.
func (f *followUps) add(scan map[string]struct{}) {
	for p := range f.last {
		scan[p] = struct{}{}
	}
}

// wakeLimiter coalesces the scans that notifications start. Anyone who may connect can NOTIFY
// on the channel, so without it a flood of notifications would cost a scan (a read of heads,
// and of open deliveries after a replay hint) each. A notification for a project whose last
// notified scan found nothing to do, less than the wake interval ago, is deferred, and the
// deferred notifications start one scan when the interval has passed. A notified scan that found
// work does not defer the next one: real deletions are delivered at once however fast they
// come, since each scan then delivers something, while a flood of empty notifications costs at
// most one scan per project per interval. The poll interval's full scans are not limited and
// clear what is deferred. It runs on the wall clock, like the poll interval.
type wakeLimiter struct {
	interval time.Duration
	idle     map[string]time.Time // when a notified scan of each project last found nothing
	deferred map[string]struct{}  // notified projects waiting for their interval to pass
}

func newWakeLimiter(interval time.Duration) *wakeLimiter {
	return &wakeLimiter{interval: interval, idle: map[string]time.Time{}, deferred: map[string]struct{}{}}
}

// admit takes the projects notified since the last call and returns those to scan now.
func (w *wakeLimiter) admit(notified map[string]struct{}, now time.Time) map[string]struct{} {
	for p := range notified {
		if p != "" {
			w.deferred[p] = struct{}{}
		}
	}
	for p, at := range w.idle {
		if now.Sub(at) >= w.interval {
			delete(w.idle, p) // keeps the map to the projects notified within one interval
		}
	}
	scan := make(map[string]struct{}, len(w.deferred))
	for p := range w.deferred {
		if _, recent := w.idle[p]; recent {
			continue
		}
		scan[p] = struct{}{}
		delete(w.deferred, p)
	}
	return scan
}

// scanned records what a notified scan of project found.
func (w *wakeLimiter) scanned(project string, found bool, now time.Time) {
	if found {
		delete(w.idle, project)
	} else {
		w.idle[project] = now
	}
}

// next is when the earliest deferred project may be scanned; ok is false when none is.
func (w *wakeLimiter) next() (at time.Time, ok bool) {
	for p := range w.deferred {
		if t := w.idle[p].Add(w.interval); !ok || t.Before(at) {
			at, ok = t, true
		}
	}
	return at, ok
}

// covered forgets what is deferred: a full scan is about to look at every project.
func (w *wakeLimiter) covered() { clear(w.deferred) }

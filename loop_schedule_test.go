package outbox

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The loop's schedule, without a database (loop_schedule.go).

// TestLoopScheduleNext: when the loop wakes, and why, from the poll and whatever else is due:
// the wall timer's deadline (next), the retry's wait on the consumer's clock (retryIn), and
// whether the loop rests until its poll.
func TestLoopScheduleNext(t *testing.T) {
	t.Parallel()
	now := t0
	const poll, followUp = time.Minute, 2 * time.Millisecond
	const none = time.Duration(math.MinInt64)
	for _, tc := range []struct {
		name    string
		s       schedule
		wakeIn  time.Duration // from now, on the wall clock
		why     wakeReason
		retryIn time.Duration // on the consumer's clock; none: no retry waits
		resting bool
	}{
		{"idle: only the poll", schedule{pollAt: now.Add(poll)}, poll, wakePoll, none, true},
		{"a retry due before the poll", schedule{pollAt: now.Add(poll), retryAt: now.Add(time.Second)},
			poll, wakePoll, time.Second, false},
		{"a retry already due fires at once", schedule{pollAt: now.Add(poll), retryAt: now.Add(-time.Second)},
			poll, wakePoll, -time.Second, false},
		{"a retry due after the poll", schedule{pollAt: now.Add(poll), retryAt: now.Add(time.Hour)},
			poll, wakePoll, time.Hour, false},
		{"a cursor write due before the poll", schedule{pollAt: now.Add(poll), ackAt: now.Add(time.Second)},
			time.Second, wakeAck, none, false},
		{"an overdue cursor write", schedule{pollAt: now.Add(poll), ackAt: now.Add(-time.Second)},
			-time.Second, wakeAck, none, false},
		{"a cursor write due after the poll", schedule{pollAt: now.Add(poll), ackAt: now.Add(2 * poll)},
			poll, wakePoll, none, false},
		{"a follow-up", schedule{pollAt: now.Add(poll), followUps: true},
			followUp, wakeFollowUp, none, false},
		{"a follow-up before a cursor write", schedule{pollAt: now.Add(poll), followUps: true, ackAt: now.Add(time.Second)},
			followUp, wakeFollowUp, none, false},
		{"a cursor write before a follow-up", schedule{pollAt: now.Add(poll), followUps: true, ackAt: now.Add(time.Millisecond)},
			time.Millisecond, wakeAck, none, false},
		{"deferred notifications", schedule{pollAt: now.Add(poll), deferredAt: now.Add(5 * time.Millisecond)},
			5 * time.Millisecond, wakeDeferred, none, false},
		{"the poll is overdue", schedule{pollAt: now.Add(-time.Millisecond), deferredAt: now.Add(5 * time.Millisecond), followUps: true},
			-time.Millisecond, wakePoll, none, false},
		{"a tie: the poll's full scan covers the rest", schedule{pollAt: now.Add(time.Second), deferredAt: now.Add(time.Second), ackAt: now.Add(time.Second)},
			time.Second, wakePoll, none, false},
		{"everything at once: the earliest wins", schedule{pollAt: now.Add(poll), deferredAt: now.Add(3 * time.Millisecond), followUps: true,
			ackAt: now.Add(4 * time.Millisecond), retryAt: now.Add(time.Millisecond)}, followUp, wakeFollowUp, time.Millisecond, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := tc.s
			s.pollInterval, s.followUpInterval = poll, followUp
			at, why := s.next(now)
			require.Equal(t, tc.wakeIn, at.Sub(now))
			require.Equal(t, tc.why, why, "woken for %s", why)
			wait, ok := s.retryIn(now)
			require.Equal(t, tc.retryIn != none, ok)
			if ok {
				require.Equal(t, tc.retryIn, wait)
			}
			require.Equal(t, tc.resting, s.resting())
		})
	}
}

// TestLoopScheduleScanned: where the next poll goes after a scan.
func TestLoopScheduleScanned(t *testing.T) {
	t.Parallel()
	before := t0.Add(-time.Hour)
	for _, tc := range []struct {
		name         string
		pollInterval time.Duration
		full, failed bool
		pollAt       time.Time
	}{
		{"a full scan", time.Minute, true, false, t0.Add(time.Minute)},
		{"a notified scan leaves the poll where it was", time.Minute, false, false, before},
		{"a failed step: again within a second", time.Minute, false, true, t0.Add(time.Second)},
		{"a failed full scan", time.Minute, true, true, t0.Add(time.Second)},
		{"a failed step, polling faster than a second", 100 * time.Millisecond, false, true, t0.Add(100 * time.Millisecond)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := schedule{pollInterval: tc.pollInterval, pollAt: before}
			s.scanned(t0, tc.full, tc.failed)
			require.Equal(t, tc.pollAt, s.pollAt)
		})
	}
}

// TestLoopFollowUps: a project whose scan made progress is scanned again every follow-up
// interval until it has been quiet for the window.
func TestLoopFollowUps(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		window   time.Duration
		scanned  map[string]struct{} // nil: a full scan
		after    time.Duration       // when pending is asked, after the scan
		followed []string
	}{
		{"a full scan: whoever progressed", time.Minute, nil, time.Second, []string{"busy", "busy2"}},
		{"a notified scan: only what it scanned", time.Minute, map[string]struct{}{"busy": {}, "quiet": {}}, time.Second, []string{"busy"}},
		{"quiet for the window", time.Minute, nil, time.Minute + time.Nanosecond, nil},
		{"at the window's end", time.Minute, nil, time.Minute, []string{"busy", "busy2"}},
		{"follow-ups off", 0, nil, 0, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			all := streams{"busy": {progressed: true}, "busy2": {progressed: true}, "quiet": {}}
			f := followUps{interval: time.Millisecond, window: tc.window, last: map[string]time.Time{}}
			f.record(all, tc.scanned, t0)
			require.Equal(t, len(tc.followed) > 0, f.pending(t0.Add(tc.after)))
			scan := map[string]struct{}{}
			f.add(scan)
			var got []string
			for _, p := range []string{"busy", "busy2", "quiet"} {
				if _, ok := scan[p]; ok {
					got = append(got, p)
				}
			}
			require.Equal(t, tc.followed, got)
		})
	}
}

// TestLoopWakeLimiter: a notification for a project whose last notified scan found nothing,
// less than the wake interval ago, is deferred until the interval has passed; one whose scan
// found work is not; a full scan covers what is deferred.
func TestLoopWakeLimiter(t *testing.T) {
	t.Parallel()
	const interval = 10 * time.Millisecond
	notified := func(ps ...string) map[string]struct{} {
		m := map[string]struct{}{}
		for _, p := range ps {
			m[p] = struct{}{}
		}
		return m
	}
	w := newWakeLimiter(interval)
	require.Equal(t, notified("a", "b"), w.admit(notified("a", "b", ""), t0), "first notifications pass; \"\" is the poll's")
	w.scanned("a", false, t0) // found nothing
	w.scanned("b", true, t0)  // found work
	require.Equal(t, notified("b"), w.admit(notified("a", "b"), t0.Add(time.Millisecond)), "a is deferred")
	at, ok := w.next()
	require.True(t, ok)
	require.Equal(t, t0.Add(interval), at, "a may be scanned a wake interval after its empty scan")
	require.Empty(t, w.admit(nil, t0.Add(interval-time.Nanosecond)))
	require.Equal(t, notified("a"), w.admit(nil, t0.Add(interval)), "the deferred notifications start one scan")
	_, ok = w.next()
	require.False(t, ok)

	w.scanned("a", false, t0.Add(interval))
	require.Empty(t, w.admit(notified("a"), t0.Add(interval+time.Millisecond)))
	w.covered()
	_, ok = w.next()
	require.False(t, ok, "a full scan looked at a")
	require.Empty(t, w.admit(nil, t0.Add(2*interval)))
}

package outbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/outboxtest"
)

// attemptLog records the fake-clock offset of every listener call.
type attemptLog struct {
	mu    sync.Mutex
	calls []time.Duration
}

func (l *attemptLog) add(d time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls = append(l.calls, d)
}

func (l *attemptLog) get() []time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]time.Duration(nil), l.calls...)
}

// retryConfig polls rarely so that only the injected clock moves retries forward.
func retryConfig(clock *outboxtest.FakeClock) outbox.Config {
	// The lease outlasts every advance of the fake clock in these tests (the heartbeat runs on
	// the real clock).
	return outbox.Config{PollInterval: time.Hour, LeaseTTL: 24 * time.Hour, HeartbeatInterval: time.Hour,
		NewCursor: outbox.NewCursorOldest, Clock: clock, ListenerTimeout: 5 * time.Second}
}

// seedDeletes writes n deletions in project p through a writer process.
func seedDeletes(t *testing.T, ctx context.Context, url, p string, n int) *testkit.Process {
	t.Helper()
	w := testkit.StartProcess(t, url, testkit.ProcessOpts{Projects: []string{p}})
	_, err := w.Store.CreateMany(ctx, p, "t", n)
	require.NoError(t, err)
	for i := range n {
		_, err := w.Store.Delete(ctx, p, fmt.Sprintf("t-%d", i+1))
		require.NoError(t, err)
	}
	return w
}

func TestRetryBackoffThenSuccess(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	clock := outboxtest.NewFakeClock()
	w := seedDeletes(t, ctx, db.URL, "p", 2)

	var log attemptLog
	obs := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "engine", Projects: []string{"p"}, Config: retryConfig(clock), NoStart: true})
	obs.Rec.SetFail(func(ev outbox.ObservedEvent) error {
		if ev.Sequence != 1 {
			return nil
		}
		log.add(clock.Offset())
		if len(log.get()) <= 3 {
			return testkit.ErrListener
		}
		return nil
	})
	since := dbNow(t, w.Pool)
	obs.Start(t)

	windows := []attemptWindow{{}} // where on the clock each attempt may run; the first at once
	for i, want := range []time.Duration{time.Second, 5 * time.Second, 30 * time.Second} {
		d := armedRetry(t, ctx, w.Pool, clock, "engine", 1, i+1, since)
		row := testkit.DeliveryOf(t, w.Pool, "engine", 1)
		require.Equal(t, testkit.DeliveryRow{State: "retrying", Attempts: i + 1, Class: "listener_error", Wait: want}, row)
		require.Equal(t, int64(0), testkit.CursorOf(t, w.Pool, "p", "engine"), "no acknowledgement past a failing event")
		require.Empty(t, obs.Rec.Snapshot(), "the stream waits: event 2 is not delivered before event 1")
		since = dbNow(t, w.Pool)
		windows = append(windows, fireRetry(t, ctx, w.Pool, clock, "engine", 1, i+1, d))
	}
	evs := obs.Rec.WaitCount(t, ctx, 2)
	require.Equal(t, []int64{1, 2}, []int64{evs[0].Sequence, evs[1].Sequence})
	require.Equal(t, 4, evs[0].Attempt)
	testkit.WaitCursor(t, ctx, w.Pool, "p", "engine", 2)

	// Each attempt ran when its timer fired, not before. (What each timer waited was checked
	// against the persisted schedule above.)
	requireAttemptsWithin(t, windows, log.get())
	row := testkit.DeliveryOf(t, w.Pool, "engine", 1)
	require.Equal(t, "resolved", row.State)
	require.Equal(t, 4, row.Attempts)
}

func TestPoisonEventIsParkedAfterTenAttempts(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	clock := outboxtest.NewFakeClock()
	w := seedDeletes(t, ctx, db.URL, "p", 2)

	var log attemptLog
	obs := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "engine", Projects: []string{"p"}, Config: retryConfig(clock), NoStart: true})
	obs.Rec.SetFail(func(ev outbox.ObservedEvent) error {
		if ev.Sequence == 1 {
			log.add(clock.Offset())
			return testkit.ErrListener
		}
		return nil
	})
	since := dbNow(t, w.Pool)
	obs.Start(t)

	schedule := []time.Duration{time.Second, 5 * time.Second, 30 * time.Second, 5 * time.Minute,
		15 * time.Minute, 15 * time.Minute, 15 * time.Minute, 15 * time.Minute, 15 * time.Minute}
	windows := []attemptWindow{{}} // where on the clock each attempt may run; the first at once
	for i, want := range schedule {
		d := armedRetry(t, ctx, w.Pool, clock, "engine", 1, i+1, since)
		row := testkit.DeliveryOf(t, w.Pool, "engine", 1)
		require.Equal(t, testkit.DeliveryRow{State: "retrying", Attempts: i + 1, Class: "listener_error", Wait: want}, row)
		since = dbNow(t, w.Pool)
		windows = append(windows, fireRetry(t, ctx, w.Pool, clock, "engine", 1, i+1, d))
	}
	evs := obs.Rec.WaitCount(t, ctx, 1)
	require.Equal(t, int64(2), evs[0].Sequence, "the next event is delivered after the park")
	require.Equal(t, []int64{1}, obs.Rec.Parked(), "a listener that keeps a position is told of the park before the next event")
	testkit.WaitCursor(t, ctx, w.Pool, "p", "engine", 2)

	require.Len(t, log.get(), 10, "exactly ten attempts")
	// Each attempt ran when its timer fired, not before.
	requireAttemptsWithin(t, windows, log.get())
	row := testkit.DeliveryOf(t, w.Pool, "engine", 1)
	require.Equal(t, "dead", row.State)
	require.Equal(t, 10, row.Attempts)

	rows, err := w.Pool.Query(ctx, `SELECT project_id, task_id, actor, metadata FROM run_audit WHERE action = $1`, outbox.AuditConsumerPoisoned)
	require.NoError(t, err)
	type audit struct {
		Project, Task, Actor string
		Meta                 map[string]any
	}
	var audits []audit
	for rows.Next() {
		var a audit
		var raw []byte
		require.NoError(t, rows.Scan(&a.Project, &a.Task, &a.Actor, &raw))
		require.NoError(t, json.Unmarshal(raw, &a.Meta))
		audits = append(audits, a)
	}
	require.NoError(t, rows.Err())
	require.Len(t, audits, 1, "one audit row")
	eventID := outbox.TaskDeletedEventID("t-1", mustDeletedAt(t, w.Pool, "t-1"))
	require.Equal(t, map[string]any{"consumerId": "engine", "eventId": eventID, "sequence": float64(1), "attempts": float64(10)}, audits[0].Meta,
		"identifiers and counts only: no error text")
	require.Equal(t, "t-1", audits[0].Task)
	require.False(t, obs.Store.Cache().Has("p", "t-1"), "the deletion still reached the cache")
	require.Equal(t, int64(1), obs.Consumer.Stats().Parked)
}

func mustDeletedAt(t *testing.T, pool *pgxpool.Pool, task string) time.Time {
	t.Helper()
	var at time.Time
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT deleted_at FROM tasks WHERE id = $1`, task).Scan(&at))
	return at
}

func TestBackoffSurvivesRestart(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	clock := outboxtest.NewFakeClock()
	w := seedDeletes(t, ctx, db.URL, "p", 1)

	var log attemptLog
	failing := func(ev outbox.ObservedEvent) error { log.add(clock.Offset()); return testkit.ErrListener }
	first := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "engine", Projects: []string{"p"}, Config: retryConfig(clock), NoStart: true})
	first.Rec.SetFail(failing)
	since := dbNow(t, w.Pool)
	first.Start(t)
	d := armedRetry(t, ctx, w.Pool, clock, "engine", 1, 1, since)
	since = dbNow(t, w.Pool)
	fireRetry(t, ctx, w.Pool, clock, "engine", 1, 1, d)
	armedRetry(t, ctx, w.Pool, clock, "engine", 1, 2, since) // after attempt 2, waiting 5s
	first.Stop(t)
	require.Empty(t, clock.Waiters(), "the stopped process left no timer behind")
	before := testkit.DeliveryOf(t, w.Pool, "engine", 1)
	require.Equal(t, testkit.DeliveryRow{State: "retrying", Attempts: 2, Class: "listener_error", Wait: 5 * time.Second}, before)
	require.Len(t, log.get(), 2)

	// Two seconds pass while no one runs; another process with the same identity takes over.
	// It waits out what is left of the persisted backoff: next_attempt_at less the shifted
	// database clock, about 3s, less whatever real time the machine took meanwhile (armedRetry
	// checks it against the row, so that a busy machine cannot fail it).
	clock.Advance(2 * time.Second)
	second := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "engine", Projects: []string{"p"}, Config: retryConfig(clock), NoStart: true})
	second.Rec.SetFail(failing)
	since = dbNow(t, w.Pool)
	second.Start(t)
	d = armedRetry(t, ctx, w.Pool, clock, "engine", 1, 2, since)
	require.LessOrEqual(t, d, 3*time.Second, "the takeover does not restart the backoff")
	require.Len(t, log.get(), 2, "no attempt was added by the restart")
	since = dbNow(t, w.Pool)
	third := fireRetry(t, ctx, w.Pool, clock, "engine", 1, 2, d)
	armedRetry(t, ctx, w.Pool, clock, "engine", 1, 3, since)
	after := testkit.DeliveryOf(t, w.Pool, "engine", 1)
	require.Equal(t, testkit.DeliveryRow{State: "retrying", Attempts: 3, Class: "listener_error", Wait: 30 * time.Second}, after,
		"exactly one more attempt: none lost, none added")
	calls := log.get()
	require.Len(t, calls, 3)
	requireAttemptsWithin(t, []attemptWindow{third}, calls[2:]) // when the takeover's timer fired, not before
}

func TestPanicAndTimeoutAreClassified(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	clock := outboxtest.NewFakeClock()
	w := seedDeletes(t, ctx, db.URL, "p", 1)
	cfg := retryConfig(clock)
	cfg.ListenerTimeout = 50 * time.Millisecond

	obs := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "engine", Projects: []string{"p"}, Config: cfg, NoStart: true})
	var calls int
	var mu sync.Mutex
	stuck, finished := make(chan struct{}), make(chan struct{})
	obs.Rec.SetFail(func(ev outbox.ObservedEvent) error {
		mu.Lock()
		calls++
		n := calls
		mu.Unlock()
		if n == 1 {
			panic("listener bug")
		}
		<-stuck // ignores its context: abandoned after the timeout, finishes when released
		close(finished)
		return nil
	})
	since := dbNow(t, w.Pool)
	obs.Start(t)
	d := armedRetry(t, ctx, w.Pool, clock, "engine", 1, 1, since)
	require.Equal(t, "listener_panic", testkit.DeliveryOf(t, w.Pool, "engine", 1).Class)
	since = dbNow(t, w.Pool)
	fireRetry(t, ctx, w.Pool, clock, "engine", 1, 1, d)
	armedRetry(t, ctx, w.Pool, clock, "engine", 1, 2, since)
	row := testkit.DeliveryOf(t, w.Pool, "engine", 1)
	require.Equal(t, "listener_timeout", row.Class)
	require.Equal(t, 2, row.Attempts)
	obs.Stop(t)
	close(stuck)
	<-finished // the abandoned goroutine ends; the leak check at exit stays clean
}

func TestReplayReachesOnlyTheOwningConsumer(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	w := seedDeletes(t, ctx, db.URL, "p", 2)
	cfg := testkit.FastConfig()
	cfg.MaxAttempts = 1 // park at the first failure

	broken := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "broken", Projects: []string{"p"}, Config: cfg, NoStart: true})
	var fixed bool
	var mu sync.Mutex
	broken.Rec.SetFail(func(ev outbox.ObservedEvent) error {
		mu.Lock()
		defer mu.Unlock()
		if ev.Sequence == 1 && !fixed {
			return testkit.ErrListener
		}
		return nil
	})
	broken.Start(t)
	healthy := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "healthy", Projects: []string{"p"}, Config: cfg})
	testkit.WaitCursor(t, ctx, w.Pool, "p", "broken", 2)
	testkit.WaitCursor(t, ctx, w.Pool, "p", "healthy", 2)
	require.Equal(t, "dead", testkit.DeliveryOf(t, w.Pool, "broken", 1).State)

	admin := outbox.NewAdmin(w.Pool, outbox.AdminOptions{Audit: w.Store})
	_, err := admin.RequestReplay(ctx, outbox.ReplayRequest{ProjectID: "p", ConsumerID: "healthy", Sequence: 1,
		Operator: outbox.Operator{Actor: "oncall@example.com", Reason: "FN-1"}})
	require.ErrorIs(t, err, outbox.ErrNotDeadLetter)
	_, err = admin.RequestReplay(ctx, outbox.ReplayRequest{ProjectID: "p", ConsumerID: "nobody", Sequence: 1,
		Operator: outbox.Operator{Actor: "oncall@example.com", Reason: "FN-1"}})
	require.ErrorIs(t, err, outbox.ErrUnknownConsumer)
	_, err = admin.RequestReplay(ctx, outbox.ReplayRequest{ProjectID: "p", ConsumerID: "broken", Sequence: 1,
		Operator: outbox.Operator{Actor: "oncall@example.com", Reason: "it broke, please fix"}})
	var verr *outbox.ValidationError
	require.ErrorAs(t, err, &verr, "prose is refused as a reason")

	mu.Lock()
	fixed = true
	mu.Unlock()
	eventID, err := admin.RequestReplay(ctx, outbox.ReplayRequest{ProjectID: "p", ConsumerID: "broken", Sequence: 1,
		Operator: outbox.Operator{Actor: "oncall@example.com", Reason: "FN-8690"}})
	require.NoError(t, err)

	evs := broken.Rec.WaitFor(t, ctx, "the replay", func(evs []outbox.ObservedEvent) bool {
		for _, ev := range evs {
			if ev.Replay {
				return true
			}
		}
		return false
	})
	require.Equal(t, eventID, evs[len(evs)-1].EventID)
	require.Eventually(t, func() bool { return testkit.DeliveryOf(t, w.Pool, "broken", 1).State == "resolved" }, testkit.WaitLimit, 10*time.Millisecond)

	var meta []byte
	var actor string
	require.NoError(t, w.Pool.QueryRow(ctx, `SELECT actor, metadata FROM run_audit WHERE action = $1`, outbox.AuditConsumerReplayed).Scan(&actor, &meta))
	require.Equal(t, "oncall@example.com", actor)
	var m map[string]any
	require.NoError(t, json.Unmarshal(meta, &m))
	require.Equal(t, map[string]any{"consumerId": "broken", "eventId": eventID, "sequence": float64(1), "attempts": float64(2), "reason": "FN-8690"}, m)
	require.Equal(t, 1, pgtest.QueryInt(t, w.Pool, `SELECT count(*) FROM run_audit WHERE action = $1`, outbox.AuditConsumerReplayed))

	h := healthy.Rec.Snapshot()
	require.Len(t, h, 2, "the other consumer saw each event once, and not the replay")
	require.Equal(t, int64(2), testkit.CursorOf(t, w.Pool, "p", "healthy"))
}

// waitForRetry waits until the consumer arms a retry timer, and returns what it waits. The fake
// clock's only timers are the consumers' retry timers, so before the first Advance any timer is
// that of the first failure's retry. After an Advance a scan that read the schedule before the
// clock moved can arm a stale timer for a moment: there armedRetry tells the right one.
func waitForRetry(ctx context.Context, clock *outboxtest.FakeClock) (time.Duration, error) {
	return clock.WaitForTimer(ctx, time.Nanosecond)
}

// dbNow reads the database clock.
func dbNow(t *testing.T, pool *pgxpool.Pool) time.Time {
	t.Helper()
	var now time.Time
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT now()`).Scan(&now))
	return now
}

// fireRetry moves the clock on by d, the wait of the retry timer armed after attempts failed
// attempts of (consumer, seq), and waits until the retry ran: the row records another attempt.
// A scan that read the schedule before the clock moved can have armed a timer by it after the
// clock moved, so that it waits d again on the moved clock while the retry is already due; a
// timer pending while the row says the retry is due is such a stale one (a due retry fires at
// once), and the clock is moved on to fire it. The consumer makes no attempt while a timer is
// pending, so a stale timer is fired only before the attempt, or while a scan that already
// stopped it makes the attempt: the attempt runs on the clock between where the wait d ends and
// where the clock is when this returns.
func fireRetry(t *testing.T, ctx context.Context, pool *pgxpool.Pool, clock *outboxtest.FakeClock, consumer string, seq int64, attempts int, d time.Duration) attemptWindow {
	t.Helper()
	from := clock.Offset() + d
	clock.Advance(d)
	for {
		waiters := clock.Waiters()
		offset := clock.Offset()
		var got int
		var state string
		var due bool
		require.NoError(t, pool.QueryRow(ctx, `SELECT attempts, state, coalesce(next_attempt_at <= now() + $3::interval + interval '1 millisecond', false)
			FROM lifecycle_consumer_deliveries WHERE consumer_id = $1 AND sequence = $2`, consumer, seq, offset).Scan(&got, &state, &due))
		if got != attempts || state != "retrying" {
			return attemptWindow{from: from, to: clock.Offset()}
		}
		if due && len(waiters) > 0 && clock.Offset() == offset {
			clock.Advance(waiters[0] - offset)
			continue
		}
		select {
		case <-ctx.Done():
			t.Fatalf("the retry of %s/%d after %d attempts did not run (timers %v at offset %v, due %t)", consumer, seq, attempts, waiters, offset, due)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// attemptWindow is where on the fake clock an attempt may run: not before its retry's wait has
// passed, and not after the clock stopped moving for it.
type attemptWindow struct{ from, to time.Duration }

// requireAttemptsWithin checks that the i-th attempt, logged at the clock's offset then, ran in
// the i-th window.
func requireAttemptsWithin(t *testing.T, windows []attemptWindow, calls []time.Duration) {
	t.Helper()
	require.Len(t, calls, len(windows))
	for i, w := range windows {
		require.True(t, calls[i] >= w.from && calls[i] <= w.to, "attempt %d ran at %v on the clock, not in [%v, %v]", i+1, calls[i], w.from, w.to)
	}
}

// armedRetry waits until (consumer, seq) has failed attempts times and the consumer has armed
// the timer of its next retry, and returns what that timer waits, checked against the schedule
// the database holds rather than against how fast the machine ran. The consumer measures the
// wait on the database clock shifted by the fake clock's offset: next_attempt_at less
// (now() + offset) when it read the row, less the real time it took to arm the timer. It read
// the row after since (a database time the caller took before what scheduled the retry) and
// armed the timer before the clock's timers are listed here, so the wait lies between
// next_attempt_at less the shifted now() read after that and next_attempt_at less the shifted
// since. A millisecond of slack covers the microseconds the database rounds its times to. Until
// such a timer is there (or ctx ends) the clock is looked at again: a scan that read the row
// before the last Advance can arm a stale timer for a moment.
func armedRetry(t *testing.T, ctx context.Context, pool *pgxpool.Pool, clock *outboxtest.FakeClock, consumer string, seq int64, attempts int, since time.Time) time.Duration {
	t.Helper()
	var last string
	for {
		offset, waiters := clock.Offset(), clock.Waiters()
		var next *time.Time
		var now time.Time
		var got *int
		require.NoError(t, pool.QueryRow(ctx, `SELECT d.next_attempt_at, d.attempts, now() FROM (SELECT) one
			LEFT JOIN lifecycle_consumer_deliveries d ON d.consumer_id = $1 AND d.sequence = $2 AND d.state = 'retrying'`,
			consumer, seq).Scan(&next, &got, &now))
		if got != nil && *got == attempts && next != nil {
			least, most := next.Sub(now.Add(offset))-time.Millisecond, next.Sub(since.Add(offset))+time.Millisecond
			for _, at := range waiters {
				if d := at - offset; d >= least && d <= most {
					return d
				}
			}
			last = fmt.Sprintf("timers %v at offset %v; want one waiting next_attempt_at %v less the shifted database clock, in [%v, %v]",
				waiters, offset, next, least, most)
		}
		select {
		case <-ctx.Done():
			t.Fatalf("no retry timer of %s/%d after %d attempts matches the persisted schedule: %s", consumer, seq, attempts, last)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

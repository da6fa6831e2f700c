package outbox_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
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

type deliveryRow struct {
	State    string
	Attempts int
	Class    string
	Wait     time.Duration // next_attempt_at - last_failed_at
}

func deliveryOf(t *testing.T, pool *pgxpool.Pool, consumer string, seq int64) deliveryRow {
	t.Helper()
	var r deliveryRow
	var waitSeconds float64
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT state, attempts, coalesce(last_failure_class, ''),
		coalesce(extract(epoch FROM next_attempt_at - last_failed_at), 0)::float8
		FROM lifecycle_consumer_deliveries WHERE consumer_id = $1 AND sequence = $2`, consumer, seq).Scan(&r.State, &r.Attempts, &r.Class, &waitSeconds))
	r.Wait = time.Duration(waitSeconds * float64(time.Second)).Round(time.Millisecond)
	return r
}

// retryConfig polls rarely so that only the injected clock moves retries forward.
func retryConfig(clock *outboxtest.FakeClock) outbox.Config {
	// The lease outlasts every advance of the fake clock in these tests (the heartbeat runs on
	// the real clock).
	return outbox.Config{PollInterval: time.Hour, LeaseTTL: 24 * time.Hour, HeartbeatInterval: time.Hour,
		NewCursor: outbox.NewCursorOldest, Clock: clock, ListenerTimeout: 5 * time.Second}
}

// seedDeletes writes n deletions in project p through a writer process.
func seedDeletes(t *testing.T, ctx context.Context, url, p string, n int) *process {
	t.Helper()
	w := startProcess(t, url, processOpts{projects: []string{p}})
	_, err := w.store.CreateMany(ctx, p, "t", n)
	require.NoError(t, err)
	for i := range n {
		_, err := w.store.Delete(ctx, p, fmt.Sprintf("t-%d", i+1))
		require.NoError(t, err)
	}
	return w
}

var errListener = errors.New("listener says no: secret-token-123 and some prose")

func TestRetryBackoffThenSuccess(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := pgtest.NewDB(t)
	clock := outboxtest.NewFakeClock()
	w := seedDeletes(t, ctx, db.URL, "p", 2)

	var log attemptLog
	obs := startProcess(t, db.URL, processOpts{id: "engine", projects: []string{"p"}, cfg: retryConfig(clock), noStart: true})
	obs.rec.setFail(func(ev outbox.ObservedEvent) error {
		if ev.Sequence != 1 {
			return nil
		}
		log.add(clock.Offset())
		if len(log.get()) <= 3 {
			return errListener
		}
		return nil
	})
	obs.start(t)

	for i, want := range []time.Duration{time.Second, 5 * time.Second, 30 * time.Second} {
		d, err := waitForRetry(ctx, clock, want)
		require.NoError(t, err)
		row := deliveryOf(t, w.pool, "engine", 1)
		require.Equal(t, deliveryRow{State: "retrying", Attempts: i + 1, Class: "listener_error", Wait: want}, row)
		require.Equal(t, int64(0), cursorOf(t, w.pool, "p", "engine"), "no acknowledgement past a failing event")
		require.Empty(t, obs.rec.snapshot(), "the stream waits: event 2 is not delivered before event 1")
		clock.Advance(d)
	}
	evs := obs.rec.waitCount(t, ctx, 2)
	require.Equal(t, []int64{1, 2}, []int64{evs[0].Sequence, evs[1].Sequence})
	require.Equal(t, 4, evs[0].Attempt)
	waitCursor(t, ctx, w.pool, "p", "engine", 2)

	calls := log.get()
	require.Len(t, calls, 4)
	// The consumer computes what is left of a wait from the database clock, so real time spent
	// in between shortens a timer by a few milliseconds; the persisted schedule above is exact.
	for i, at := range []time.Duration{0, time.Second, 6 * time.Second, 36 * time.Second} {
		require.InDelta(t, at.Seconds(), calls[i].Seconds(), 0.5, "attempt %d ran after the scheduled wait", i+1)
	}
	row := deliveryOf(t, w.pool, "engine", 1)
	require.Equal(t, "resolved", row.State)
	require.Equal(t, 4, row.Attempts)
}

func TestPoisonEventIsParkedAfterTenAttempts(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := pgtest.NewDB(t)
	clock := outboxtest.NewFakeClock()
	w := seedDeletes(t, ctx, db.URL, "p", 2)

	var log attemptLog
	obs := startProcess(t, db.URL, processOpts{id: "engine", projects: []string{"p"}, cfg: retryConfig(clock), noStart: true})
	obs.rec.setFail(func(ev outbox.ObservedEvent) error {
		if ev.Sequence == 1 {
			log.add(clock.Offset())
			return errListener
		}
		return nil
	})
	obs.start(t)

	schedule := []time.Duration{time.Second, 5 * time.Second, 30 * time.Second, 5 * time.Minute,
		15 * time.Minute, 15 * time.Minute, 15 * time.Minute, 15 * time.Minute, 15 * time.Minute}
	advanced := []time.Duration{0} // the clock's offset at each attempt
	for _, want := range schedule {
		d, err := waitForRetry(ctx, clock, want)
		require.NoError(t, err)
		require.InDelta(t, want.Seconds(), d.Seconds(), want.Seconds()/4)
		clock.Advance(d)
		advanced = append(advanced, clock.Offset())
	}
	evs := obs.rec.waitCount(t, ctx, 1)
	require.Equal(t, int64(2), evs[0].Sequence, "the next event is delivered after the park")
	waitCursor(t, ctx, w.pool, "p", "engine", 2)

	require.Len(t, log.get(), 10, "exactly ten attempts")
	// Each attempt ran when its timer fired, not before: at the offset the clock was moved to.
	require.Equal(t, advanced, log.get(), "attempts ran at the armed backoffs")
	row := deliveryOf(t, w.pool, "engine", 1)
	require.Equal(t, "dead", row.State)
	require.Equal(t, 10, row.Attempts)

	rows, err := w.pool.Query(ctx, `SELECT project_id, task_id, actor, metadata FROM run_audit WHERE action = $1`, outbox.AuditConsumerPoisoned)
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
	eventID := outbox.TaskDeletedEventID("t-1", mustDeletedAt(t, w.pool, "t-1"))
	require.Equal(t, map[string]any{"consumerId": "engine", "eventId": eventID, "sequence": float64(1), "attempts": float64(10)}, audits[0].Meta,
		"identifiers and counts only: no error text")
	require.Equal(t, "t-1", audits[0].Task)
	require.False(t, obs.store.Cache().Has("p", "t-1"), "the deletion still reached the cache")
	require.Equal(t, int64(1), obs.consumer.Stats().Parked)
}

func mustDeletedAt(t *testing.T, pool *pgxpool.Pool, task string) time.Time {
	t.Helper()
	var at time.Time
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT deleted_at FROM tasks WHERE id = $1`, task).Scan(&at))
	return at
}

func TestBackoffSurvivesRestart(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := pgtest.NewDB(t)
	clock := outboxtest.NewFakeClock()
	w := seedDeletes(t, ctx, db.URL, "p", 1)

	var log attemptLog
	failing := func(ev outbox.ObservedEvent) error { log.add(clock.Offset()); return errListener }
	first := startProcess(t, db.URL, processOpts{id: "engine", projects: []string{"p"}, cfg: retryConfig(clock), noStart: true})
	first.rec.setFail(failing)
	first.start(t)
	d, err := waitForRetry(ctx, clock, time.Second)
	require.NoError(t, err)
	clock.Advance(d)
	_, err = waitForRetry(ctx, clock, 5*time.Second) // after attempt 2, waiting 5s
	require.NoError(t, err)
	first.stop(t)
	before := deliveryOf(t, w.pool, "engine", 1)
	require.Equal(t, deliveryRow{State: "retrying", Attempts: 2, Class: "listener_error", Wait: 5 * time.Second}, before)
	require.Len(t, log.get(), 2)

	// Two seconds pass while no one runs; another process with the same identity takes over.
	clock.Advance(2 * time.Second)
	second := startProcess(t, db.URL, processOpts{id: "engine", projects: []string{"p"}, cfg: retryConfig(clock), noStart: true})
	second.rec.setFail(failing)
	second.start(t)
	d, err = clock.WaitForTimer(ctx, 2*time.Second)
	require.NoError(t, err)
	require.InDelta(t, (3 * time.Second).Seconds(), d.Seconds(), 0.5, "the takeover waits out the remaining backoff")
	require.Len(t, log.get(), 2, "no attempt was added by the restart")
	clock.Advance(d)
	_, err = waitForRetry(ctx, clock, 30*time.Second)
	require.NoError(t, err)
	after := deliveryOf(t, w.pool, "engine", 1)
	require.Equal(t, 3, after.Attempts, "exactly one more attempt: none lost, none added")
	calls := log.get()
	require.Len(t, calls, 3)
	// The takeover computed its wait from the database clock, so real time spent meanwhile
	// counts: the third attempt comes at 1s+5s on the shifted clock, within that slack.
	require.InDelta(t, (6 * time.Second).Seconds(), calls[2].Seconds(), 0.5, "the third attempt waited out the persisted backoff")
}

func TestPanicAndTimeoutAreClassified(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := pgtest.NewDB(t)
	clock := outboxtest.NewFakeClock()
	w := seedDeletes(t, ctx, db.URL, "p", 1)
	cfg := retryConfig(clock)
	cfg.ListenerTimeout = 50 * time.Millisecond

	obs := startProcess(t, db.URL, processOpts{id: "engine", projects: []string{"p"}, cfg: cfg, noStart: true})
	var calls int
	var mu sync.Mutex
	stuck, finished := make(chan struct{}), make(chan struct{})
	obs.rec.setFail(func(ev outbox.ObservedEvent) error {
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
	obs.start(t)
	d, err := waitForRetry(ctx, clock, time.Second)
	require.NoError(t, err)
	require.Equal(t, "listener_panic", deliveryOf(t, w.pool, "engine", 1).Class)
	clock.Advance(d)
	_, err = waitForRetry(ctx, clock, 5*time.Second)
	require.NoError(t, err)
	row := deliveryOf(t, w.pool, "engine", 1)
	require.Equal(t, "listener_timeout", row.Class)
	require.Equal(t, 2, row.Attempts)
	obs.stop(t)
	close(stuck)
	<-finished // the abandoned goroutine ends; the leak check at exit stays clean
}

func TestReplayReachesOnlyTheOwningConsumer(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := pgtest.NewDB(t)
	w := seedDeletes(t, ctx, db.URL, "p", 2)
	cfg := fastConfig()
	cfg.MaxAttempts = 1 // park at the first failure

	broken := startProcess(t, db.URL, processOpts{id: "broken", projects: []string{"p"}, cfg: cfg, noStart: true})
	var fixed bool
	var mu sync.Mutex
	broken.rec.setFail(func(ev outbox.ObservedEvent) error {
		mu.Lock()
		defer mu.Unlock()
		if ev.Sequence == 1 && !fixed {
			return errListener
		}
		return nil
	})
	broken.start(t)
	healthy := startProcess(t, db.URL, processOpts{id: "healthy", projects: []string{"p"}, cfg: cfg})
	waitCursor(t, ctx, w.pool, "p", "broken", 2)
	waitCursor(t, ctx, w.pool, "p", "healthy", 2)
	require.Equal(t, "dead", deliveryOf(t, w.pool, "broken", 1).State)

	admin := outbox.NewAdmin(w.pool, outbox.AdminOptions{Audit: w.store})
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

	evs := broken.rec.waitFor(t, ctx, "the replay", func(evs []outbox.ObservedEvent) bool {
		for _, ev := range evs {
			if ev.Replay {
				return true
			}
		}
		return false
	})
	require.Equal(t, eventID, evs[len(evs)-1].EventID)
	require.Eventually(t, func() bool { return deliveryOf(t, w.pool, "broken", 1).State == "resolved" }, 30*time.Second, 10*time.Millisecond)

	var meta []byte
	var actor string
	require.NoError(t, w.pool.QueryRow(ctx, `SELECT actor, metadata FROM run_audit WHERE action = $1`, outbox.AuditConsumerReplayed).Scan(&actor, &meta))
	require.Equal(t, "oncall@example.com", actor)
	var m map[string]any
	require.NoError(t, json.Unmarshal(meta, &m))
	require.Equal(t, map[string]any{"consumerId": "broken", "eventId": eventID, "sequence": float64(1), "attempts": float64(2), "reason": "FN-8690"}, m)
	require.Equal(t, 1, pgtest.QueryInt(t, w.pool, `SELECT count(*) FROM run_audit WHERE action = $1`, outbox.AuditConsumerReplayed))

	h := healthy.rec.snapshot()
	require.Len(t, h, 2, "the other consumer saw each event once, and not the replay")
	require.Equal(t, int64(2), cursorOf(t, w.pool, "p", "healthy"))
}

// waitForRetry waits until the consumer arms the retry timer of a backoff of want. The consumer
// measures what is left of a wait on the database clock, so real time spent between the
// failure and the timer shortens it: half the wait is allowed for that, which still tells one
// step of the schedule (1s, 5s, 30s, ...) from the next. A quarter was too little: in a full
// -race run on two cores, 273ms passed between a listener's failure and its record, and the
// consumer's 1s timer was armed below 750ms, so the test waited for a timer that never came.
func waitForRetry(ctx context.Context, clock *outboxtest.FakeClock, want time.Duration) (time.Duration, error) {
	return clock.WaitForTimer(ctx, want/2)
}

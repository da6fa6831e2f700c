package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/fx"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
)

// Per-project runtimes (ProjectRuntimes) on a real consumer: a writer process deletes tasks in
// projects "a" and "b"; an observer built by outbox.New (or the fx Module) gets them through
// ProjectRuntimes, its Projects seam and its listener. The observer's heartbeat and its
// acknowledgements by time are twenty minutes apart, so what the tests see comes from
// RefreshProjects and from the release of a dropped project, never from a heartbeat round or a
// timed cursor write.

const runtimesConsumer = "engine"

func runtimesConfig() outbox.Config {
	return outbox.Config{IdentityField: "outbox.consumer_id", NewCursor: outbox.NewCursorOldest, PollInterval: 50 * time.Millisecond,
		LeaseTTL: time.Hour, HeartbeatInterval: 20 * time.Minute, AckInterval: 20 * time.Minute, ListenerTimeout: 5 * time.Minute}
}

// runtimesHost is the writer process and the observer.
type runtimesHost struct {
	writer *testkit.Process
	pool   *pgxpool.Pool // the observer's
	ob     *outbox.Outbox
	pr     *outbox.ProjectRuntimes
}

// startRuntimesHost seeds 20 tasks in each project and starts the observer with no runtime:
// through the fx Module and ProvideProjectRuntimes when withFx, else through outbox.New.
func startRuntimesHost(t *testing.T, withFx bool) *runtimesHost {
	t.Helper()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	h := &runtimesHost{writer: testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: []string{"a", "b"}, Config: testkit.FastConfig()})}
	for _, p := range []string{"a", "b"} {
		_, err := h.writer.Store.CreateMany(ctx, p, "t", 20)
		require.NoError(t, err)
	}
	h.pool = pgtest.Pool(t, db.URL)
	settings := mapSettings{"outbox.consumer_id": runtimesConsumer}
	if withFx {
		app := fx.New(
			outbox.Module,
			outbox.ProvideProjectRuntimes,
			fx.Supply(h.pool, runtimesConfig(), zaptest.NewLogger(t)),
			fx.Provide(func() outbox.Settings { return settings }),
			fx.Populate(&h.ob, &h.pr),
			fx.NopLogger,
		)
		require.NoError(t, app.Err())
		require.NoError(t, app.Start(ctx))
		t.Cleanup(func() { stopWithin(t, app.Stop) })
	} else {
		h.pr = outbox.NewProjectRuntimes(outbox.ProjectRuntimesOptions{Logger: zaptest.NewLogger(t)})
		ob, err := outbox.New(h.pool, runtimesConfig(), outbox.Deps{Logger: zaptest.NewLogger(t), Settings: settings,
			Projects: h.pr, Listeners: []outbox.Listener{h.pr}})
		require.NoError(t, err)
		h.ob = ob
		require.NoError(t, ob.Start(ctx))
		t.Cleanup(func() { stopWithin(t, ob.Stop) })
	}
	require.Equal(t, outbox.StateRunning, h.ob.State())
	return h
}

func stopWithin(t *testing.T, stop func(context.Context) error) {
	ctx, cancel := context.WithTimeout(context.Background(), testkit.WaitLimit)
	defer cancel()
	require.NoError(t, stop(ctx))
}

// stop stops the observer, so that what the runtimes recorded is final.
func (h *runtimesHost) stop(t *testing.T) { stopWithin(t, h.ob.Stop) }

// del deletes tasks t-from to t-to of project, one transaction each, in order: their events
// get sequences from to to in a project with no earlier deletion.
func (h *runtimesHost) del(t *testing.T, project string, from, to int) {
	t.Helper()
	for i := from; i <= to; i++ {
		_, err := h.writer.Store.Delete(testkit.Ctx(t), project, fmt.Sprintf("t-%d", i))
		require.NoError(t, err)
	}
}

// leases counts the observer's leases on project in the database.
func (h *runtimesHost) leases(t *testing.T, project string) int {
	return pgtest.QueryInt(t, h.pool, `SELECT count(*) FROM lifecycle_consumer_cursors
		WHERE project_id = $1 AND consumer_id = $2 AND lease_owner IS NOT NULL`, project, runtimesConsumer)
}

// waitReleased waits until the observer holds no lease on project.
func (h *runtimesHost) waitReleased(t *testing.T, ctx context.Context, project string) {
	t.Helper()
	for h.leases(t, project) != 0 {
		select {
		case <-ctx.Done():
			t.Fatalf("the lease of %s was never released", project)
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// requireRun checks that evs are exactly the events of project with sequences from to to, in
// order, each delivered once and at its first attempt.
func requireRun(t *testing.T, evs []outbox.ObservedEvent, project string, from, to int) {
	t.Helper()
	var got []string
	for _, ev := range evs {
		got = append(got, fmt.Sprintf("%s/%d=%s#%d", ev.ProjectID, ev.Sequence, ev.TaskID, ev.Attempt))
	}
	var want []string
	for i := from; i <= to; i++ {
		want = append(want, fmt.Sprintf("%s/%d=t-%d#1", project, i, i))
	}
	require.Equal(t, want, got)
}

// TestRuntimeAddedMidStreamStartsAtItsCursor: with project a's runtime running, a runtime
// added for b gets every event of b once, in order, those written before the Add included, at
// once (no heartbeat runs); a's runtime never sees one of b's events. Wired with fx, as a
// host's engine binary is.
func TestRuntimeAddedMidStreamStartsAtItsCursor(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	h := startRuntimesHost(t, true)
	ra, rb := testkit.NewRecorder(), testkit.NewRecorder()
	require.NoError(t, h.pr.Add(ctx, "a", ra))
	observed, err := h.pr.ObservedProjects(ctx)
	require.NoError(t, err)
	require.Equal(t, []string{"a"}, observed)

	h.del(t, "a", 1, 5)
	h.del(t, "b", 1, 5) // before b has a runtime
	ra.WaitCount(t, ctx, 5)

	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // a's stream keeps going while b is added
		defer wg.Done()
		h.del(t, "a", 6, 10)
	}()
	require.NoError(t, h.pr.Add(ctx, "b", rb))
	h.del(t, "b", 6, 10)
	wg.Wait()
	rb.WaitCount(t, ctx, 10)
	ra.WaitCount(t, ctx, 10)

	h.stop(t)
	requireRun(t, ra.Snapshot(), "a", 1, 10)
	requireRun(t, rb.Snapshot(), "b", 1, 10)
	require.Equal(t, int64(10), testkit.CursorOf(t, h.pool, "b", runtimesConsumer), "the stop wrote b's cursor")
}

// TestRemoveStopsCleanlyAndAddResumesFromTheCursor: once Remove returns, the runtime gets
// nothing more; the consumer writes the project's cursor through the last event the runtime
// took (no cursor write by time is due yet) and releases its lease; events written afterwards
// go to a runtime added later, from that cursor, with no gap and no duplicate.
func TestRemoveStopsCleanlyAndAddResumesFromTheCursor(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	h := startRuntimesHost(t, false)
	ra, first := testkit.NewRecorder(), testkit.NewRecorder()
	require.NoError(t, h.pr.Add(ctx, "a", ra))
	require.NoError(t, h.pr.Add(ctx, "b", first))
	h.del(t, "b", 1, 5)
	first.WaitCount(t, ctx, 5)

	require.NoError(t, h.pr.Remove(ctx, "b"))
	observed, err := h.pr.ObservedProjects(ctx)
	require.NoError(t, err)
	require.Equal(t, []string{"a"}, observed)
	h.waitReleased(t, ctx, "b")
	require.Equal(t, int64(5), testkit.CursorOf(t, h.pool, "b", runtimesConsumer), "written before the lease was released")
	require.Equal(t, 1, h.leases(t, "a"), "a's lease is untouched")
	require.ErrorIs(t, h.pr.Remove(ctx, "b"), outbox.ErrNoRuntime)

	h.del(t, "b", 6, 8)
	h.del(t, "a", 1, 3)
	ra.WaitCount(t, ctx, 3) // the consumer scans on: b's events would have been handed over by now

	second := testkit.NewRecorder()
	require.NoError(t, h.pr.Add(ctx, "b", second))
	second.WaitCount(t, ctx, 3)
	h.stop(t)
	requireRun(t, first.Snapshot(), "b", 1, 5)
	requireRun(t, second.Snapshot(), "b", 6, 8)
	requireRun(t, ra.Snapshot(), "a", 1, 3)
	require.Equal(t, int64(8), testkit.CursorOf(t, h.pool, "b", runtimesConsumer))
}

// TestRemoveWaitsForTheCallInFlight: a runtime blocked in HandleObserved holds Remove up until
// the call returns; a second Remove meanwhile waits for the same call, bounded by its context,
// and an Add of the project waits for it too. The event in flight counts as delivered, and the
// next runtime resumes after it.
func TestRemoveWaitsForTheCallInFlight(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	h := startRuntimesHost(t, false)
	refreshed := make(chan struct{}, 1)
	h.pr.SetRefresher(func(ctx context.Context) error {
		err := h.ob.RefreshProjects(ctx)
		select {
		case refreshed <- struct{}{}:
		default:
		}
		return err
	})
	entered, release := make(chan struct{}), make(chan struct{})
	var returned atomic.Bool
	first := testkit.NewRecorder()
	first.SetFail(func(ev outbox.ObservedEvent) error {
		if ev.Sequence == 2 {
			close(entered)
			<-release // ignores its context
			returned.Store(true)
		}
		return nil
	})
	require.NoError(t, h.pr.Add(ctx, "b", first))
	<-refreshed
	h.del(t, "b", 1, 3)
	select {
	case <-entered:
	case <-ctx.Done():
		t.Fatal("the runtime never got event 2")
	}

	after := func(err error, what string) error { // what returned before the call did is an error
		if err == nil && !returned.Load() {
			err = errors.New(what + " returned while the removed runtime's call was in flight")
		}
		return err
	}
	removed := make(chan error, 1)
	go func() { removed <- after(h.pr.Remove(ctx, "b"), "Remove") }()
	<-refreshed // the consumer dropped b: Remove now waits for the call in flight

	ended, cancel := context.WithCancel(ctx)
	cancel()
	require.ErrorIs(t, h.pr.Remove(ended, "b"), context.Canceled, "a Remove meanwhile waits for the same call, bounded by its context")
	second := testkit.NewRecorder()
	added := make(chan error, 1)
	go func() { added <- after(h.pr.Add(ctx, "b", second), "Add") }()

	close(release)
	require.NoError(t, <-removed)
	require.NoError(t, <-added)
	second.WaitCount(t, ctx, 1)
	h.stop(t)
	requireRun(t, first.Snapshot(), "b", 1, 2)
	requireRun(t, second.Snapshot(), "b", 3, 3)
}

// TestEventOfARemovedRuntimeSpendsNoAttempt: a runtime that fails its event because it is
// being removed (the consumer dropped the project while the event was out) spends none of the
// event's attempts: nothing is recorded, and the runtime added next gets the event at its
// first attempt.
func TestEventOfARemovedRuntimeSpendsNoAttempt(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	h := startRuntimesHost(t, false)
	refreshed := make(chan struct{}, 1)
	h.pr.SetRefresher(func(ctx context.Context) error {
		err := h.ob.RefreshProjects(ctx)
		select {
		case refreshed <- struct{}{}:
		default:
		}
		return err
	})
	removed := make(chan error, 1)
	first := testkit.NewRecorder()
	first.SetFail(func(ev outbox.ObservedEvent) error {
		if ev.Sequence != 2 {
			return nil
		}
		go func() { removed <- h.pr.Remove(ctx, "b") }()
		<-refreshed // the consumer dropped b while this event is out
		return errors.New("runtime shutting down")
	})
	require.NoError(t, h.pr.Add(ctx, "b", first))
	<-refreshed
	h.del(t, "b", 1, 3)
	require.NoError(t, <-removed)
	h.waitReleased(t, ctx, "b")
	require.Equal(t, int64(1), testkit.CursorOf(t, h.pool, "b", runtimesConsumer))
	c := h.ob.Consumer()
	require.Zero(t, c.Stats().Failures, "no failed attempt counted")
	require.Zero(t, pgtest.QueryInt(t, h.pool, `SELECT count(*) FROM lifecycle_consumer_deliveries`), "no attempt recorded")

	second := testkit.NewRecorder()
	require.NoError(t, h.pr.Add(ctx, "b", second))
	second.WaitCount(t, ctx, 2)
	h.stop(t)
	requireRun(t, first.Snapshot(), "b", 1, 1)
	requireRun(t, second.Snapshot(), "b", 2, 3)
	require.Zero(t, c.Stats().Failures)
}

// TestProjectRuntimesRefusals: Add refuses an invalid project ID, a nil runtime and a second
// runtime for a project; Remove and HandleObserved name the project that has none. Without a
// running consumer RefreshProjects does nothing and says nothing went wrong.
func TestProjectRuntimesRefusals(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pr := outbox.NewProjectRuntimes(outbox.ProjectRuntimesOptions{})
	rt := testkit.NewRecorder()
	for _, bad := range []string{"", "has space", "-leading", "semi;colon", string(make([]byte, 129))} {
		err := pr.Add(ctx, bad, rt)
		var ve *outbox.ValidationError
		require.ErrorAs(t, err, &ve, "%q", bad)
		require.Equal(t, "ProjectRuntimes.Add project", ve.Field)
	}
	require.Error(t, pr.Add(ctx, "p", nil))
	require.NoError(t, pr.Add(ctx, "p", rt)) // no refresher: the consumer takes it when it starts
	require.ErrorIs(t, pr.Add(ctx, "p", testkit.NewRecorder()), outbox.ErrRuntimeExists)
	require.ErrorContains(t, pr.Add(ctx, "p", testkit.NewRecorder()), "project p")
	require.NoError(t, pr.Add(ctx, "o", testkit.NewRecorder()))
	observed, err := pr.ObservedProjects(ctx)
	require.NoError(t, err)
	require.Equal(t, []string{"o", "p"}, observed)

	err = pr.Remove(ctx, "q")
	require.ErrorIs(t, err, outbox.ErrNoRuntime)
	require.ErrorContains(t, err, "project q")
	err = pr.HandleObserved(ctx, outbox.ObservedEvent{Event: outbox.Event{ProjectID: "q", Sequence: 1}})
	require.ErrorIs(t, err, outbox.ErrNoRuntime)
	require.ErrorContains(t, err, "project q")
	require.NoError(t, pr.HandleObserved(ctx, outbox.ObservedEvent{Event: outbox.Event{ProjectID: "p", Sequence: 1}}))
	require.Len(t, rt.Snapshot(), 1)
	require.NoError(t, pr.Remove(ctx, "p"))
	require.ErrorIs(t, pr.HandleObserved(ctx, outbox.ObservedEvent{Event: outbox.Event{ProjectID: "p", Sequence: 2}}), outbox.ErrNoRuntime)
	require.Len(t, rt.Snapshot(), 1, "a removed runtime is never called")

	failing := outbox.NewProjectRuntimes(outbox.ProjectRuntimesOptions{})
	require.NoError(t, failing.Add(ctx, "p", rt))
	failing.SetRefresher(func(context.Context) error { return errors.New("refresh failed") })
	require.ErrorContains(t, failing.Remove(ctx, "p"), "refresh failed")
	observed, err = failing.ObservedProjects(ctx)
	require.NoError(t, err)
	require.Equal(t, []string{"p"}, observed, "a Remove the consumer could not apply leaves the runtime in place")
	require.ErrorIs(t, failing.Add(ctx, "p", rt), outbox.ErrRuntimeExists)

	// Wired by New, RefreshProjects is a no-op until the consumer runs, and after it stopped.
	wired := outbox.NewProjectRuntimes(outbox.ProjectRuntimesOptions{})
	ob, err := outbox.New(pgtest.NewPool(t), runtimesConfig(), outbox.Deps{Logger: zap.NewNop(),
		Settings: mapSettings{"outbox.consumer_id": runtimesConsumer}, Projects: wired, Listeners: []outbox.Listener{wired}})
	require.NoError(t, err)
	require.NoError(t, ob.RefreshProjects(ctx))
	require.NoError(t, wired.Add(ctx, "p", rt))
	require.NoError(t, ob.Start(ctx))
	require.NoError(t, wired.Remove(ctx, "p"))
	require.NoError(t, ob.Stop(ctx))
	require.NoError(t, ob.RefreshProjects(ctx))
	require.NoError(t, wired.Add(ctx, "p", testkit.NewRecorder()))
}

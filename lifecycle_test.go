package outbox_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
)

// stubbornListener blocks in its first call until release is closed, ignoring its context
// (entered is closed once it is in), and counts every call.
type stubbornListener struct {
	calls   atomic.Int64
	entered chan struct{}
	release <-chan struct{}
	once    sync.Once
}

func (l *stubbornListener) Name() string { return "stubborn" }

func (l *stubbornListener) HandleObserved(ctx context.Context, ev outbox.ObservedEvent) error {
	if l.calls.Add(1) == 1 {
		l.once.Do(func() { close(l.entered) })
		<-l.release
	}
	return nil
}

// backlogConsumer seeds n deletions and builds (without starting) a consumer whose only
// listener is l.
func backlogConsumer(t *testing.T, n int, cfg outbox.Config, l outbox.Listener) (*outbox.Consumer, *testkit.Process) {
	t.Helper()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	w := seedDeletes(t, ctx, db.URL, "p", n)
	pool := pgtest.Pool(t, db.URL)
	c, err := outbox.NewConsumer(outbox.ConsumerOptions{ID: "dash", Pool: pool, Config: cfg, Projects: outbox.StaticProjects{"p"},
		Dispatcher: outbox.NewDispatcher(outbox.DispatcherOptions{Listeners: []outbox.Listener{l}, NoLocalWriter: true}), Logger: zaptest.NewLogger(t)})
	require.NoError(t, err)
	return c, w
}

// TestStopHandsNoFurtherEventToListeners: once Stop is called the listener in flight may
// finish, and is acknowledged because it did, but no further event of the backlog is handed
// to a listener.
func TestStopHandsNoFurtherEventToListeners(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	var calls atomic.Int64
	entered := make(chan struct{})
	// The first call returns once Stop has cancelled its context: a listener that finishes the
	// work it had started. Any later call would be an event handed over after Stop.
	l := outbox.ListenerFunc("finishes-after-stop", func(ctx context.Context, ev outbox.ObservedEvent) error {
		if calls.Add(1) == 1 {
			close(entered)
			<-ctx.Done()
		}
		return nil
	})
	c, w := backlogConsumer(t, 60, testkit.FastConfig(), l)
	require.NoError(t, c.Start(ctx))
	<-entered
	require.NoError(t, c.Stop(ctx))
	require.Equal(t, int64(1), calls.Load(), "no event was handed to the listener after Stop")
	require.Equal(t, int64(1), testkit.CursorOf(t, w.Pool, "p", "dash"), "the event in flight finished and was acknowledged")
}

// TestStartAfterStopRefuses: a consumer stopped before it started cannot then be started
// (nothing could stop it), and neither can one that ran and stopped.
func TestStartAfterStopRefuses(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	newConsumer := func() *outbox.Consumer {
		c, err := outbox.NewConsumer(outbox.ConsumerOptions{ID: "dash", Pool: pool, Config: testkit.FastConfig(), Projects: outbox.StaticProjects{"p"},
			Dispatcher: outbox.NewDispatcher(outbox.DispatcherOptions{}), Logger: zaptest.NewLogger(t)})
		require.NoError(t, err)
		return c
	}

	c := newConsumer()
	require.NoError(t, c.Stop(ctx), "Stop before Start is allowed")
	err := c.Start(ctx)
	require.ErrorIs(t, err, outbox.ErrConsumerStopped)
	require.NoError(t, c.Stop(ctx), "and Stop stays idempotent")

	c = newConsumer()
	require.NoError(t, c.Start(ctx))
	require.NoError(t, c.Stop(ctx))
	require.ErrorIs(t, c.Start(ctx), outbox.ErrConsumerStopped)
	require.Zero(t, pgtest.QueryInt(t, pool, `SELECT count(*) FROM lifecycle_consumer_cursors WHERE lease_owner IS NOT NULL`), "nothing holds a lease")
}

// blockingProjects blocks ObservedProjects until its context ends, standing in for a start-up
// that waits on an unreachable database.
type blockingProjects struct{ entered chan struct{} }

func (b blockingProjects) ObservedProjects(ctx context.Context) ([]string, error) {
	close(b.entered)
	<-ctx.Done()
	return nil, ctx.Err()
}

// TestStopDuringStartIsBoundedByItsContext: Stop called while Start is still talking to the
// database returns within its own context and makes Start give up.
func TestStopDuringStartIsBoundedByItsContext(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	projects := blockingProjects{entered: make(chan struct{})}
	c, err := outbox.NewConsumer(outbox.ConsumerOptions{ID: "dash", Pool: pool, Config: testkit.FastConfig(), Projects: projects,
		Dispatcher: outbox.NewDispatcher(outbox.DispatcherOptions{}), Logger: zaptest.NewLogger(t)})
	require.NoError(t, err)
	started := make(chan error, 1)
	go func() { started <- c.Start(context.Background()) }()
	<-projects.entered

	stopCtx, cancel := context.WithTimeout(ctx, testkit.WaitLimit)
	defer cancel()
	stopped := make(chan error, 1)
	go func() { stopped <- c.Stop(stopCtx) }()
	select {
	case err := <-stopped:
		require.NoError(t, err)
	case <-stopCtx.Done():
		t.Fatal("Stop did not return within its context while Start was in progress")
	}
	select {
	case err := <-started:
		require.ErrorIs(t, err, outbox.ErrConsumerStopped)
	case <-ctx.Done():
		t.Fatal("Start did not give up after Stop")
	}
}

// TestStopIsBoundedByItsContext: with a listener that ignores its context and outlives the
// stop context, Stop returns the context's error and the consumer's goroutines end at once,
// without waiting for the listener timeout; the unfinished event is not acknowledged.
func TestStopIsBoundedByItsContext(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	release := make(chan struct{})
	defer close(release)
	l := &stubbornListener{entered: make(chan struct{}), release: release}
	cfg := testkit.FastConfig()
	cfg.ListenerTimeout = time.Hour
	c, w := backlogConsumer(t, 5, cfg, l)
	require.NoError(t, c.Start(ctx))
	<-l.entered

	stopCtx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	err := c.Stop(stopCtx)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	done, cancelWait := context.WithTimeout(ctx, testkit.WaitLimit) // far below the hour
	defer cancelWait()
	select {
	case <-c.Done():
	case <-done.Done():
		t.Fatal("the consumer kept running after its stop context ended")
	}
	require.Equal(t, int64(1), l.calls.Load())
	require.Less(t, testkit.CursorOf(t, w.Pool, "p", "dash"), int64(1), "the unfinished event was not acknowledged")
	require.NoError(t, c.Stop(ctx), "a second Stop finds it stopped")
}

// stuckDB is a database whose Exec (the writer's wake-up notification) blocks until its
// context ends, like a connection to a server that stopped answering.
type stuckDB struct {
	outbox.DBTX
	entered chan struct{}
	left    chan error
}

func (s *stuckDB) Exec(ctx context.Context, _ string, _ ...any) (pgconn.CommandTag, error) {
	s.entered <- struct{}{}
	<-ctx.Done()
	s.left <- ctx.Err()
	return pgconn.CommandTag{}, ctx.Err()
}

// TestWriterCloseIsBoundedByItsContext: Close waits for the wake-up in flight only as long as
// its context allows, and then abandons it.
func TestWriterCloseIsBoundedByItsContext(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := &stuckDB{entered: make(chan struct{}, 1), left: make(chan error, 1)}
	w, err := outbox.NewWriter(db, outbox.Config{}, zaptest.NewLogger(t))
	require.NoError(t, err)
	w.Committed("p")
	<-db.entered
	closeCtx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, w.Close(closeCtx), context.DeadlineExceeded)
	require.ErrorIs(t, <-db.left, context.Canceled, "the notification in flight was cancelled, not left running")
	w.Committed("p") // after Close: nothing is sent, nothing blocks
	require.NoError(t, w.Close(ctx))
}

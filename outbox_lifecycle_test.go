package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/fx"
	"go.uber.org/fx/fxtest"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
)

type fixedSettings map[string]string

func (m fixedSettings) Setting(_ context.Context, name string) (string, bool, error) {
	v, ok := m[name]
	return v, ok, nil
}

// TestOutboxStartAfterStopRefuses: the Outbox the module provides follows the lifecycle rule
// every part follows: once stopped, a Start (a late OnStart, a retry loop) refuses instead of
// starting a consumer that nothing would stop.
func TestOutboxStartAfterStopRefuses(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	var ob *outbox.Outbox
	app := fxtest.New(t, outbox.Module,
		fx.Supply(pool, outbox.Config{IdentityField: "outbox.consumer_id"}),
		fx.Provide(
			func() outbox.Settings { return fixedSettings{"outbox.consumer_id": "c1"} },
			func() outbox.Projects { return outbox.StaticProjects{"p"} },
		),
		fx.Populate(&ob), fx.NopLogger)
	app.RequireStart()
	require.Equal(t, outbox.StateRunning, ob.State())
	app.RequireStop()
	require.Equal(t, outbox.StateStopped, ob.State())

	err := ob.Start(ctx)
	if c := ob.Consumer(); c != nil && ob.State() == outbox.StateRunning {
		t.Cleanup(func() { _ = c.Stop(context.Background()) })
	}
	require.ErrorIs(t, err, outbox.ErrConsumerStopped, "Start after Stop must refuse")
	require.Equal(t, outbox.StateStopped, ob.State(), "and leave nothing running")
}

// outboxWithHeldStart builds an Outbox whose Start holds in hold just before it starts
// the consumer; the recorder is its listener.
func outboxWithHeldStart(t *testing.T, hold func(ctx context.Context)) (*outbox.Outbox, *testkit.Recorder, *pgxpool.Pool) {
	t.Helper()
	pool := pgtest.NewPool(t)
	rec := testkit.NewRecorder()
	ob, err := outbox.New(pool, testkit.FastConfig(), outbox.Deps{Logger: zaptest.NewLogger(t),
		Settings: fixedSettings{"outbox.consumer_id": "c1"}, Projects: outbox.StaticProjects{"p"}, Listeners: []outbox.Listener{rec}})
	require.NoError(t, err)
	outbox.HoldConsumerStart(ob, hold)
	return ob, rec, pool
}

// TestOutboxStopWaitsForAStartInFlight: a Stop that arrives while Start is in the middle of
// its start-up cancels it and returns only once Start has returned, with no consumer running
// and no lease held: nothing Start began can reach a listener or the pool after Stop.
func TestOutboxStopWaitsForAStartInFlight(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	held, let := make(chan struct{}), make(chan struct{})
	ob, rec, pool := outboxWithHeldStart(t, func(ctx context.Context) {
		close(held)
		<-ctx.Done() // a start-up step waiting on the database, until Stop cancels it
		close(let)
	})
	startCtx, cancelStart := context.WithCancel(ctx)
	defer cancelStart() // the code before the fix waits here, on Start's own context
	started := make(chan error, 1)
	go func() { started <- ob.Start(startCtx) }()
	<-held

	stopCtx, cancel := context.WithTimeout(ctx, testkit.WaitLimit)
	defer cancel()
	require.NoError(t, ob.Stop(stopCtx))
	// Stop returns only after Start has: the step Start was held in has ended by then. (The
	// goroutine's send of Start's result may still be on its way, so it is waited for.)
	select {
	case <-let:
	default:
		t.Fatal("Stop returned while Start was still in flight")
	}
	select {
	case err := <-started:
		require.ErrorIs(t, err, outbox.ErrConsumerStopped)
	case <-time.After(testkit.WaitLimit):
		t.Fatal("Start never returned after Stop")
	}
	require.Nil(t, ob.Consumer(), "no consumer runs")
	require.Zero(t, pgtest.QueryInt(t, pool, `SELECT count(*) FROM lifecycle_consumer_cursors WHERE lease_owner IS NOT NULL`), "nothing holds a lease")

	// An event written now reaches no listener: the full scan ScanNow would ask for has no
	// consumer to run it, and the recorder stays empty.
	_, err := pool.Exec(ctx, insertLogRow, "p", "t0")
	require.NoError(t, err)
	require.Empty(t, rec.Snapshot())
	require.ErrorIs(t, ob.Start(ctx), outbox.ErrConsumerStopped, "and Start after Stop refuses")
}

// TestOutboxStopBoundedWhileStartIgnoresIt: when the start-up step in flight does not give up,
// Stop returns its context's error in time; the Start, once let go, starts no consumer.
func TestOutboxStopBoundedWhileStartIgnoresIt(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	held, release := make(chan struct{}), make(chan struct{})
	ob, _, pool := outboxWithHeldStart(t, func(context.Context) {
		close(held)
		<-release // ignores its context
	})
	started := make(chan error, 1)
	go func() { started <- ob.Start(ctx) }()
	<-held

	stopCtx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, ob.Stop(stopCtx), context.DeadlineExceeded, "Stop is bounded by its context")
	close(release)
	require.ErrorIs(t, <-started, outbox.ErrConsumerStopped, "the Start let go after Stop starts nothing")
	require.Nil(t, ob.Consumer())
	require.Zero(t, pgtest.QueryInt(t, pool, `SELECT count(*) FROM lifecycle_consumer_cursors WHERE lease_owner IS NOT NULL`), "nothing holds a lease")
	require.NoError(t, ob.Stop(ctx))
}

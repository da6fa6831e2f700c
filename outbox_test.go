package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
)

// Tests of the composition root, outbox.New: what it refuses, what Start decides, and that the
// Config and the seams reach every part it builds (the defects it exists to prevent were a
// Config field only fx applied, and a SelfWriterID a host had to copy by hand).

func TestNewRefusesWhatCannotRun(t *testing.T) {
	t.Parallel()
	_, err := outbox.New(nil, outbox.Config{}, outbox.Deps{})
	var ve *outbox.ValidationError
	require.ErrorAs(t, err, &ve)
	require.Equal(t, "New.pool", ve.Field)

	pool := pgtest.NewPool(t)
	_, err = outbox.New(pool, outbox.Config{PollInterval: time.Nanosecond}, outbox.Deps{})
	require.ErrorAs(t, err, &ve)
	require.Equal(t, "Config.PollInterval (poll_interval)", ve.Field)
}

// TestNewStartsWithoutAnIdentity: with no identity in the named setting, Start succeeds and
// State says observation is off; Stop is idempotent and Start after Stop refuses.
func TestNewStartsWithoutAnIdentity(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	o, err := outbox.New(pool, outbox.Config{IdentityField: "outbox.consumer_id"},
		outbox.Deps{Settings: mapSettings{}, Projects: outbox.StaticProjects{"p"}})
	require.NoError(t, err)
	require.Equal(t, outbox.StateNotStarted, o.State())
	require.NoError(t, o.Start(ctx))
	require.Equal(t, outbox.StateNoIdentity, o.State())
	require.Nil(t, o.Consumer())
	require.NotNil(t, o.Writer())
	require.NotNil(t, o.Admin())
	require.NotNil(t, o.Retention())
	require.Len(t, o.MaintenanceTasks(), 1)
	require.NoError(t, o.Stop(ctx))
	require.NoError(t, o.Stop(ctx))
	require.ErrorIs(t, o.Start(ctx), outbox.ErrConsumerStopped)
}

type mapSettings map[string]string

func (m mapSettings) Setting(_ context.Context, name string) (string, bool, error) {
	v, ok := m[name]
	return v, ok, nil
}

// TestNewAppliesTheConfigToEveryPart: one Outbox both writes and observes. Its own event
// reaches the cache but not its own listener (SelfWriterID comes from the writer New built),
// a listener from another process times out after Config.ListenerTimeout, not the default 30s,
// the process spans go to Config.TracerProvider, and the consumer runs on Deps.ConsumerPool.
func TestNewAppliesTheConfigToEveryPart(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	consumerCfg, err := pgxpool.ParseConfig(db.URL + "&application_name=outbox_consumer_pool")
	require.NoError(t, err)
	consumerPool := pgtest.PoolConfig(t, consumerCfg)
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })

	heard := make(chan outbox.ObservedEvent, 4)
	release := make(chan struct{})
	t.Cleanup(func() { close(release) })
	listener := outbox.ListenerFunc("slow", func(ctx context.Context, ev outbox.ObservedEvent) error {
		heard <- ev
		<-release // ignores its context: only the listener timeout ends the attempt
		return nil
	})
	cfg := outbox.Config{IdentityField: "outbox.consumer_id", NewCursor: outbox.NewCursorOldest, PollInterval: 50 * time.Millisecond,
		ListenerTimeout: 200 * time.Millisecond, RetrySchedule: []time.Duration{time.Hour}, TracerProvider: tp}
	core, logs := observer.New(zap.WarnLevel)
	o, err := outbox.New(pool, cfg, outbox.Deps{Logger: zap.New(core), ConsumerPool: consumerPool, Settings: mapSettings{"outbox.consumer_id": "c1"},
		Projects: outbox.StaticProjects{"p"}, Listeners: []outbox.Listener{listener}})
	require.NoError(t, err)
	require.NoError(t, o.Start(ctx))
	t.Cleanup(func() { _ = o.Stop(context.Background()) })
	require.Equal(t, outbox.StateRunning, o.State())

	record := func(w *outbox.Writer, task string) {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		_, _, err = w.RecordTaskDeletedTx(ctx, tx, outbox.TaskDeletion{ProjectID: "p", TaskID: task, DeletedAt: time.Now().UTC().Truncate(time.Microsecond)})
		require.NoError(t, err)
		require.NoError(t, tx.Commit(ctx))
		w.Committed("p")
	}
	record(o.Writer(), "own")
	other, err := outbox.NewWriter(pool, outbox.Config{}, nil)
	require.NoError(t, err)
	t.Cleanup(func() { _ = other.Close(context.Background()) })
	record(other, "theirs")

	select {
	case ev := <-heard:
		require.Equal(t, "theirs", ev.TaskID, "the process's own event must not reach its own listener")
	case <-ctx.Done():
		t.Fatal("the other process's event never reached the listener")
	}
	for {
		rows, err := o.Admin().Status(ctx, outbox.StatusFilter{ProjectID: "p", ConsumerID: "c1"})
		require.NoError(t, err)
		if len(rows) == 1 && rows[0].Retrying == 1 {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatal("the listener's attempt was never recorded as failed")
		case <-time.After(20 * time.Millisecond):
		}
	}
	timedOut := logs.FilterMessage("observed listener timed out").All()
	require.Len(t, timedOut, 1)
	require.Equal(t, 200*time.Millisecond, time.Duration(timedOut[0].ContextMap()["timeout"].(time.Duration)),
		"the attempt is bounded by Config.ListenerTimeout, not the 30s default")
	c := o.Consumer()
	require.Equal(t, int64(1), c.Stats().Own)

	var failureClass string
	require.NoError(t, pool.QueryRow(ctx, `SELECT last_failure_class FROM lifecycle_consumer_deliveries WHERE consumer_id = 'c1'`).Scan(&failureClass))
	require.Equal(t, string(outbox.FailureListenerTimeout), failureClass)

	var processSpans int
	for _, s := range exp.GetSpans() {
		if s.Name == "process p" {
			processSpans++
		}
	}
	require.GreaterOrEqual(t, processSpans, 2, "Config.TracerProvider reaches the consumer")

	var onConsumerPool int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox_consumer_pool' AND datname = current_database()`).Scan(&onConsumerPool))
	require.Positive(t, onConsumerPool, "the consumer runs on Deps.ConsumerPool")
}

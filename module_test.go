package outbox_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/fx"
	"go.uber.org/fx/fxtest"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"fusion/outbox"
	"fusion/outbox/example/taskstore/schema"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
	"fusion/outbox/internal/testkit"
)

// engineApp builds an app the way an engine binary does: the outbox module plus the host's
// own options.
func engineApp(t *testing.T, host testhost.HostConfig, extra ...fx.Option) (*fxtest.App, *observer.ObservedLogs, *outbox.Outbox, *testhost.Store) {
	t.Helper()
	core, logs := observer.New(zapcore.DebugLevel)
	t.Cleanup(func() {
		if t.Failed() {
			for _, e := range logs.All() {
				t.Logf("%s %s %v", e.Level, e.Message, e.ContextMap())
			}
		}
	})
	var ob *outbox.Outbox
	var store *testhost.Store
	app := fxtest.New(t,
		outbox.Module,
		testhost.Module,
		fx.Supply(host, zap.New(core)),
		fx.Populate(&ob, &store),
		fx.Options(extra...),
		fx.NopLogger,
	)
	return app, logs, ob, store
}

func TestModuleInEngineApp(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	seed := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: []string{"p"}})
	_, err := seed.Store.CreateMany(ctx, "p", "t", 10)
	require.NoError(t, err)
	require.NoError(t, testhost.NewSettings(seed.Pool, "observer").Set(ctx, "outbox.consumer_id", "dashboard"))
	fast := outbox.Config{PollInterval: 50 * time.Millisecond}

	t.Run("with an identity it observes through the bus bridge", func(t *testing.T) {
		app, _, ob, store := engineApp(t, testhost.HostConfig{DSN: db.URL, Projects: []string{"p"}, SettingsScope: "observer", Outbox: fast})
		var mu sync.Mutex
		var heard []testhost.TaskDeleted
		store.Emitter().On(func(_ context.Context, ev testhost.TaskDeleted) { mu.Lock(); heard = append(heard, ev); mu.Unlock() })
		app.RequireStart()
		require.Equal(t, outbox.StateRunning, ob.State())
		require.Len(t, store.Cache().Live("p"), 10, "the store loaded its cache at open")
		// A new identity reconciles first; deletions after that are delivered as events.
		testkit.WaitCursor(t, ctx, seed.Pool, "p", "dashboard", 0)

		_, err := seed.Store.Delete(ctx, "p", "t-1")
		require.NoError(t, err)
		require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return len(heard) == 1 }, testkit.WaitLimit, 10*time.Millisecond)
		mu.Lock()
		got := heard[0]
		mu.Unlock()
		require.True(t, got.Observed, "the bridge marks the event observed")
		require.Equal(t, "t-1", got.TaskID)
		require.Equal(t, seed.Writer.ProcessID(), got.OriginProcessID)
		require.False(t, store.Cache().Has("p", "t-1"))
		app.RequireStop()
		require.Equal(t, outbox.StateStopped, ob.State())
	})

	t.Run("without an identity the writer works and observation is off", func(t *testing.T) {
		app, logs, ob, store := engineApp(t, testhost.HostConfig{DSN: db.URL, Projects: []string{"p"}, SettingsScope: "writer-node", Outbox: fast})
		app.RequireStart()
		require.Equal(t, outbox.StateNoIdentity, ob.State())
		res, err := store.Delete(ctx, "p", "t-2")
		require.NoError(t, err)
		require.True(t, res.EventRecorded, "the writer hook is wired")
		app.RequireStop()
		said := logs.FilterMessageSnippet("observation disabled").All()
		require.Len(t, said, 1, "said once")
		require.Equal(t, "outbox.consumer_id", said[0].ContextMap()["setting"], "and it names the field to set")
	})

	t.Run("disabled, nothing starts and the hook records nothing", func(t *testing.T) {
		app, logs, ob, store := engineApp(t, testhost.HostConfig{DSN: db.URL, Projects: []string{"p"}, SettingsScope: "observer",
			Outbox: outbox.Config{Disabled: true}})
		app.RequireStart()
		require.Equal(t, outbox.StateDisabled, ob.State())
		res, err := store.Delete(ctx, "p", "t-3")
		require.NoError(t, err)
		require.True(t, res.Deleted)
		require.False(t, res.EventRecorded)
		app.RequireStop()
		require.Len(t, logs.FilterMessageSnippet("outbox disabled").All(), 1)
		require.Zero(t, pgtest.QueryInt(t, seed.Pool, `SELECT count(*) FROM lifecycle_event_log WHERE task_id = 't-3'`))
	})

	t.Run("the retention task joins the host's sweep", func(t *testing.T) {
		var sweep *testhost.SelfHealing
		app, _, _, _ := engineApp(t, testhost.HostConfig{DSN: db.URL, Projects: []string{"p"}, SettingsScope: "observer", Outbox: fast},
			fx.Populate(&sweep))
		app.RequireStart()
		results := sweep.LastResults()
		require.Len(t, results, 1, "ran at store open")
		require.Equal(t, "outbox-retention", results[0].Task)
		require.NoError(t, results[0].Err)
		app.RequireStop()
	})
}

func TestModuleRefusesABehindSchema(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmptyDB(t)
	pool := pgtest.Pool(t, db.URL)
	require.NoError(t, schema.Migrate(testkit.Ctx(t), pool)) // the host's own tables are current
	_, err := outbox.MigrateThrough(testkit.Ctx(t), pool, 1)
	require.NoError(t, err)
	app := fx.New(outbox.Module, testhost.Module,
		fx.Supply(testhost.HostConfig{DSN: db.URL, Projects: []string{"p"}}, zap.NewNop()), fx.NopLogger)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = app.Start(ctx)
	require.ErrorIs(t, err, outbox.ErrSchemaBehind)
	require.ErrorContains(t, err, "outboxctl migrate")
	require.NoError(t, app.Stop(ctx))
}

func TestModuleRejectsInvalidConfig(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	app := fx.New(outbox.Module, testhost.Module,
		fx.Supply(testhost.HostConfig{DSN: db.URL, Outbox: outbox.Config{PollInterval: time.Millisecond, MaxAttempts: -1}}, zap.NewNop()), fx.NopLogger)
	err := app.Err()
	require.Error(t, err)
	require.ErrorContains(t, err, "PollInterval")
	require.ErrorContains(t, err, "MaxAttempts")
}

func TestModuleReportsADSNThatDoesNotParse(t *testing.T) {
	t.Parallel()
	app := fx.New(outbox.Module, testhost.Module,
		fx.Supply(testhost.HostConfig{DSN: "postgres://user@host:notaport/db"}, zap.NewNop()), fx.NopLogger)
	err := app.Err()
	require.Error(t, err)
	require.ErrorContains(t, err, "database DSN")
	require.NotContains(t, err.Error(), "panic")
}

package outbox_test

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/fx"
	"go.uber.org/zap"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
)

// A host's own pieces, standing in for the real ones.
type nodeSettings struct{ pool *pgxpool.Pool }

func (s nodeSettings) Setting(ctx context.Context, name string) (string, bool, error) {
	var v string
	err := s.pool.QueryRow(ctx, `SELECT value FROM settings WHERE scope = 'node-1' AND key = $1`, name).Scan(&v)
	if err != nil {
		return "", false, nil
	}
	return v, true, nil
}

func newDashboardRefresher(log *zap.Logger) outbox.Listener {
	return outbox.ListenerFunc("dashboard-refresh", func(ctx context.Context, ev outbox.ObservedEvent) error {
		log.Info("task deleted elsewhere", zap.String("project_id", ev.ProjectID), zap.String("task_id", ev.TaskID))
		return nil
	})
}

// Example_wiring shows how an engine binary wires the module: the host supplies what it owns
// (pool, logger, config, settings, projects) and its observed listeners; the module provides
// the writer hook, the dispatcher, the consumer runner and the retention task.
func Example_wiring() {
	app := fx.New(
		outbox.Module,
		fx.Supply(outbox.Config{IdentityField: "outbox.consumer_id"}),
		fx.Provide(
			zap.NewProduction,
			func(lc fx.Lifecycle) (*pgxpool.Pool, error) {
				pool, err := pgxpool.New(context.Background(), "postgres:///tasks")
				lc.Append(fx.StopHook(pool.Close))
				return pool, err
			},
			func(pool *pgxpool.Pool) outbox.Settings { return nodeSettings{pool} },
			func() outbox.Projects { return outbox.StaticProjects{"alpha", "beta"} },
			outbox.AsListener(newDashboardRefresher),
		),
		fx.Invoke(func(w *outbox.Writer) {
			// The host's delete path calls w.RecordTaskDeletedTx inside its transaction and
			// w.Committed(projectID) after commit.
		}),
	)
	app.Run()
}

// settingsMap is a host's persisted settings, standing in for a real settings table.
type settingsMap map[string]string

func (m settingsMap) Setting(_ context.Context, name string) (string, bool, error) {
	v, ok := m[name]
	return v, ok, nil
}

// Example_withoutFx wires two processes with the composition root alone, on one database: a
// task store that records a deletion, and a dashboard that observes it. The schema must be
// migrated first (outboxctl migrate, outbox.Migrate, or Config.AutoMigrate). The store has no
// consumer identity in its settings, so it starts with observation off and only records; the
// dashboard has one and hands the deletion to its listener, marked observed, with the
// writer's process ID. Both stop bounded by a context.
func Example_withoutFx() {
	ctx := context.Background()
	db, drop, err := pgtest.ExampleDB() // a throwaway database; a host opens its own
	if err != nil {
		fmt.Println(err)
		return
	}
	defer func() { _ = drop() }()
	pool, err := pgxpool.New(ctx, db.URL)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	if _, err := outbox.Migrate(ctx, pool); err != nil {
		fmt.Println(err)
		return
	}

	// The task store: it records deletions and observes nothing (no identity setting).
	store, err := outbox.New(pool, outbox.Config{IdentityField: "outbox.consumer_id"},
		outbox.Deps{Settings: settingsMap{}, Projects: outbox.StaticProjects{"alpha"}})
	if err != nil {
		fmt.Println(err)
		return
	}
	// The dashboard: a durable identity in its settings, the projects it shows, a listener.
	seen := make(chan outbox.ObservedEvent, 1)
	dashboard, err := outbox.New(pool, outbox.Config{IdentityField: "outbox.consumer_id", NewCursor: outbox.NewCursorOldest},
		outbox.Deps{
			Settings: settingsMap{"outbox.consumer_id": "dashboard-1"},
			Projects: outbox.StaticProjects{"alpha"},
			Listeners: []outbox.Listener{outbox.ListenerFunc("dashboard", func(_ context.Context, ev outbox.ObservedEvent) error {
				seen <- ev
				return nil
			})},
		})
	if err != nil {
		fmt.Println(err)
		return
	}
	for _, o := range []*outbox.Outbox{store, dashboard} {
		if err := o.Start(ctx); err != nil {
			fmt.Println(err)
			return
		}
	}
	fmt.Println("store:", store.State())
	fmt.Println("dashboard:", dashboard.State())

	// The store's delete transaction: its own soft delete would come first; the hook adds one
	// row, and the wake-up goes out after commit.
	tx, err := pool.Begin(ctx)
	if err != nil {
		fmt.Println(err)
		return
	}
	deletedAt := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	ev, _, err := store.Writer().RecordTaskDeletedTx(ctx, tx, outbox.TaskDeletion{ProjectID: "alpha", TaskID: "task-1", DeletedAt: deletedAt})
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		fmt.Println(err)
		return
	}
	store.Writer().Committed("alpha")

	select {
	case got := <-seen:
		fmt.Println("observed:", got.EventID, "observed:", got.Observed, "from the store:", got.WriterProcessID == ev.WriterProcessID)
	case <-time.After(time.Minute): // only a failure bound: generous for a busy machine
		fmt.Println("nothing observed")
	}

	stopCtx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	fmt.Println("stopped:", dashboard.Stop(stopCtx) == nil && store.Stop(stopCtx) == nil)
	fmt.Println("start after stop:", dashboard.Start(ctx))

	// Output:
	// store: no-identity
	// dashboard: running
	// observed: task-deleted:task-1:2026-01-02T03:04:05.000000Z observed: true from the store: true
	// stopped: true
	// start after stop: consumer stopped: a stopped consumer cannot be started again
}

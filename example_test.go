package outbox_test

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/fx"
	"go.uber.org/zap"

	"fusion/outbox"
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

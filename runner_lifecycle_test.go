package outbox_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/fx"
	"go.uber.org/fx/fxtest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
)

type fixedSettings map[string]string

func (m fixedSettings) Setting(_ context.Context, name string) (string, bool, error) {
	v, ok := m[name]
	return v, ok, nil
}

// TestRunnerStartAfterStopRefuses: the runner the module provides follows the lifecycle rule
// every part follows: once stopped, a Start (a late OnStart, a retry loop) refuses instead of
// building and starting a fresh consumer that nothing would stop.
func TestRunnerStartAfterStopRefuses(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.NewPool(t)
	var runner *outbox.Runner
	app := fxtest.New(t, outbox.Module,
		fx.Supply(pool, outbox.Config{IdentityField: "outbox.consumer_id"}),
		fx.Provide(
			func() outbox.Settings { return fixedSettings{"outbox.consumer_id": "c1"} },
			func() outbox.Projects { return outbox.StaticProjects{"p"} },
		),
		fx.Populate(&runner), fx.NopLogger)
	app.RequireStart()
	require.Equal(t, outbox.StateRunning, runner.State())
	app.RequireStop()
	require.Equal(t, outbox.StateStopped, runner.State())

	err := runner.Start(ctx)
	if c := runner.Consumer(); c != nil && runner.State() == outbox.StateRunning {
		t.Cleanup(func() { _ = c.Stop(context.Background()) })
	}
	require.ErrorIs(t, err, outbox.ErrConsumerStopped, "Start after Stop must refuse")
	require.Equal(t, outbox.StateStopped, runner.State(), "and leave nothing running")
}

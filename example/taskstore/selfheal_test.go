package taskstore_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/example/taskstore"
	"fusion/outbox/startstop"
)

// TestSelfHealingLifecycle: the sweep runs once at Start, refuses a second Start and any Start
// after Stop, and Stop is idempotent.
func TestSelfHealingLifecycle(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	m := taskstore.NewSelfHealing([]outbox.MaintenanceTask{{Name: "count", Run: func(context.Context) (fmt.Stringer, error) {
		runs.Add(1)
		return nil, nil
	}}}, time.Hour, nil)
	ctx := context.Background()
	require.NoError(t, m.Stop(ctx), "Stop before Start")
	m = taskstore.NewSelfHealing(nil, time.Hour, nil)
	require.NoError(t, m.Start(ctx))
	require.ErrorIs(t, m.Start(ctx), startstop.ErrStarted)
	require.NoError(t, m.Stop(ctx))
	require.NoError(t, m.Stop(ctx))
	require.ErrorIs(t, m.Start(ctx), startstop.ErrStopped)

	counted := taskstore.NewSelfHealing([]outbox.MaintenanceTask{{Name: "count", Run: func(context.Context) (fmt.Stringer, error) {
		runs.Add(1)
		return nil, nil
	}}}, time.Hour, nil)
	require.NoError(t, counted.Start(ctx))
	require.Equal(t, int64(1), runs.Load(), "the store-open sweep runs in Start")
	require.NoError(t, counted.Stop(ctx))
}

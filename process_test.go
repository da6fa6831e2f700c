package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/testkit"
)

// What the consumer tests add to internal/testkit's simulated processes.

// newConsumerWith builds a consumer for p with extra listeners after the recorder.
func newConsumerWith(t *testing.T, p *testkit.Process, id outbox.ConsumerID, projects []string, cfg outbox.Config, extra ...outbox.Listener) *outbox.Consumer {
	t.Helper()
	d := outbox.NewDispatcher(outbox.DispatcherOptions{
		Listeners: append([]outbox.Listener{p.Rec}, extra...), Cache: p.Store.Cache(),
		SelfWriterID: p.Writer.ProcessID(), Timeout: cfg.WithDefaults().ListenerTimeout, Logger: zaptest.NewLogger(t),
	})
	c, err := outbox.NewConsumer(outbox.ConsumerOptions{
		ID: id, Pool: p.Pool, Config: cfg, Projects: outbox.StaticProjects(projects), Dispatcher: d,
		LiveTasks: p.Store, Cache: p.Store.Cache(), Audit: p.Store, Logger: zaptest.NewLogger(t),
	})
	require.NoError(t, err)
	return c
}

// waitReconciled waits until c has reconciled want times. The cursor a reconciliation moves
// is committed before its count goes up, so a test that saw the cursor waits for the count.
func waitReconciled(t *testing.T, ctx context.Context, c *outbox.Consumer, want int64) {
	t.Helper()
	for c.Stats().Reconciliations < want {
		select {
		case <-ctx.Done():
			t.Fatalf("consumer reconciled %d times, want %d", c.Stats().Reconciliations, want)
		case <-time.After(5 * time.Millisecond):
		}
	}
	require.Equal(t, want, c.Stats().Reconciliations)
}

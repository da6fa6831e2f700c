package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
)

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
	ctx := ctxT(t)
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

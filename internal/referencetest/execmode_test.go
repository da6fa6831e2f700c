package referencetest_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/example/taskstore"
	"fusion/outbox/internal/pgtest"
)

// TestStoreWorksInExecMode runs the host's writes in the pgx mode a transaction pooler needs
// (default_query_exec_mode=exec): the delete with its audit row, and an audit row the module
// asks for. In that mode pgx sends a []byte as bytea, which the json column refuses, so the
// host passes its JSON as a string.
func TestStoreWorksInExecMode(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL+"&default_query_exec_mode=exec")
	store := taskstore.New(pool, taskstore.Options{Actor: "exec-mode"})
	_, err := store.Create(ctx, "p", "t1", "write docs", "doing")
	require.NoError(t, err)
	res, err := store.Delete(ctx, "p", "t1")
	require.NoError(t, err)
	require.True(t, res.Deleted)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	require.NoError(t, store.WriteAuditTx(ctx, tx, outbox.AuditRecord{Action: outbox.AuditConsumerReplayed, ProjectID: "p",
		ConsumerID: "c", EventID: "task-deleted:t1:2024-01-01T00:00:00.000000Z", Sequence: 1, Attempts: 2, Actor: "op", Reason: "FN-1"}))
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, 2, pgtest.QueryInt(t, pool, `SELECT count(*) FROM run_audit WHERE metadata IS NOT NULL`))
}

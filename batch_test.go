package outbox_test

import (
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
)

// The batch form of the writer hook: the insert rides on the host's pgx.Batch.

func TestQueueTaskDeletedRecordsOnceInTheHostsBatch(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	w := newWriter(t, pool, outbox.Config{NotifyDisabled: true})
	d := outbox.TaskDeletion{ProjectID: "p", TaskID: "t1", DeletedAt: stamp(1), PriorColumn: "todo"}

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	b := &pgx.Batch{}
	b.Queue(`SELECT 1`) // the host's own statement in the same round trip
	first, err := w.QueueTaskDeleted(ctx, b, d)
	require.NoError(t, err)
	again, err := w.QueueTaskDeleted(ctx, b, d) // the same deletion twice in one batch
	require.NoError(t, err)
	_, _, err = first.Result(ctx, tx)
	require.ErrorContains(t, err, "results were not read")
	require.NoError(t, tx.SendBatch(ctx, b).Close())

	ev, inserted, err := first.Result(ctx, tx)
	require.NoError(t, err)
	require.True(t, inserted)
	require.Equal(t, outbox.TaskDeletedEventID("t1", stamp(1)), ev.EventID)
	require.Equal(t, w.ProcessID(), ev.WriterProcessID)
	require.False(t, ev.OccurredAt.IsZero())
	stored, inserted, err := again.Result(ctx, tx)
	require.NoError(t, err)
	require.False(t, inserted, "the second insert of one deletion records nothing")
	require.Equal(t, ev.OccurredAt, stored.OccurredAt, "and returns the stored event")
	require.NoError(t, tx.Commit(ctx))
	require.Equal(t, 1, pgtest.QueryInt(t, pool, `SELECT count(*) FROM lifecycle_event_log WHERE task_id = 't1'`))

	// A batch that rolls back records nothing.
	tx, err = pool.Begin(ctx)
	require.NoError(t, err)
	b = &pgx.Batch{}
	_, err = w.QueueTaskDeleted(ctx, b, outbox.TaskDeletion{ProjectID: "p", TaskID: "t2", DeletedAt: stamp(2)})
	require.NoError(t, err)
	require.NoError(t, tx.SendBatch(ctx, b).Close())
	require.NoError(t, tx.Rollback(ctx))
	require.Zero(t, pgtest.QueryInt(t, pool, `SELECT count(*) FROM lifecycle_event_log WHERE task_id = 't2'`))
}

func TestQueueTaskDeletedRefusesWhatRecordRefuses(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	w := newWriter(t, pool, outbox.Config{NotifyDisabled: true})
	b := &pgx.Batch{}

	observed := outbox.WithObserved(ctx, outbox.Observed{ConsumerID: "dash", EventID: "x"})
	_, err := w.QueueTaskDeleted(observed, b, outbox.TaskDeletion{ProjectID: "p", TaskID: "t1", DeletedAt: stamp(1)})
	var fence *outbox.FenceError
	require.ErrorAs(t, err, &fence)
	_, err = w.QueueTaskDeleted(ctx, b, outbox.TaskDeletion{ProjectID: "p q", TaskID: "t1", DeletedAt: stamp(1)})
	require.ErrorContains(t, err, "TaskDeletion.ProjectID")
	_, err = w.QueueTaskDeleted(ctx, nil, outbox.TaskDeletion{ProjectID: "p", TaskID: "t1", DeletedAt: stamp(1)})
	require.ErrorContains(t, err, "nil batch")
	require.Zero(t, b.Len(), "nothing was queued")

	off := newWriter(t, pool, outbox.Config{Disabled: true})
	q, err := off.QueueTaskDeleted(ctx, b, outbox.TaskDeletion{ProjectID: "p", TaskID: "t1", DeletedAt: stamp(1)})
	require.NoError(t, err)
	require.Zero(t, b.Len(), "a disabled writer queues nothing")
	_, inserted, err := q.Result(ctx, nil)
	require.NoError(t, err)
	require.False(t, inserted)
}

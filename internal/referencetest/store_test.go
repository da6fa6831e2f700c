package referencetest_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/example/taskstore"
	"fusion/outbox/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func setup(t *testing.T) (context.Context, *pgxpool.Pool, *taskstore.Store) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	pool := pgtest.NewPool(t)
	return ctx, pool, taskstore.New(pool, taskstore.Options{Actor: "host-test"})
}

func TestDeleteIsOneTransactionWithItsAuditRow(t *testing.T) {
	t.Parallel()
	ctx, pool, store := setup(t)
	_, err := store.Create(ctx, "p", "t1", "write docs", "doing")
	require.NoError(t, err)

	// Make the audit insert fail: the soft delete must roll back with it.
	_, err = pool.Exec(ctx, `ALTER TABLE run_audit ADD CONSTRAINT no_deletes CHECK (action <> 'task:deleted')`)
	require.NoError(t, err)
	_, err = store.Delete(ctx, "p", "t1")
	require.Error(t, err)
	task, err := store.Get(ctx, "p", "t1")
	require.NoError(t, err)
	require.Nil(t, task.DeletedAt, "no soft delete without its audit row")
	require.Zero(t, pgtest.QueryInt(t, pool, `SELECT count(*) FROM mailbox_notices`), "no notice for a delete that did not happen")

	_, err = pool.Exec(ctx, `ALTER TABLE run_audit DROP CONSTRAINT no_deletes`)
	require.NoError(t, err)
	heard := 0
	store.Emitter().On(func(_ context.Context, ev taskstore.TaskDeleted) {
		heard++
		require.False(t, ev.Observed, "the local event is not an observed one")
	})
	res, err := store.Delete(ctx, "p", "t1")
	require.NoError(t, err)
	require.True(t, res.Deleted)
	require.Equal(t, "doing", res.Task.Column, "the result holds the pre-delete snapshot")
	require.Equal(t, 1, pgtest.QueryInt(t, pool, `SELECT count(*) FROM run_audit WHERE task_id = 't1' AND action = 'task:deleted'`))
	require.Equal(t, 1, pgtest.QueryInt(t, pool, `SELECT count(*) FROM mailbox_notices WHERE task_id = 't1'`))
	require.Equal(t, 1, heard)
	require.False(t, store.Cache().Has("p", "t1"))

	again, err := store.Delete(ctx, "p", "t1")
	require.NoError(t, err)
	require.False(t, again.Deleted, "deleting a deleted task changes nothing")
	require.Equal(t, res.Task.DeletedAt.UTC(), again.Task.DeletedAt.UTC(), "deleted_at keeps the first transition")
	require.Equal(t, 1, pgtest.QueryInt(t, pool, `SELECT count(*) FROM run_audit`))
	require.Equal(t, 1, pgtest.QueryInt(t, pool, `SELECT count(*) FROM mailbox_notices`))
	require.Equal(t, 1, heard)

	_, err = store.Delete(ctx, "p", "missing")
	require.ErrorIs(t, err, taskstore.ErrTaskNotFound)
}

func TestArchiveIsNotADeletion(t *testing.T) {
	t.Parallel()
	ctx, pool, store := setup(t)
	_, err := store.Create(ctx, "p", "t1", "old", "done")
	require.NoError(t, err)
	archived, err := store.Archive(ctx, "p", "t1")
	require.NoError(t, err)
	require.True(t, archived.Archived)
	require.Nil(t, archived.DeletedAt)
	require.Zero(t, pgtest.QueryInt(t, pool, `SELECT count(*) FROM run_audit`))
	res, err := store.Delete(ctx, "p", "t1")
	require.NoError(t, err)
	require.True(t, res.Task.Archived, "the delete keeps the archived snapshot")
	require.Equal(t, "done", res.Task.Column)
}

func TestWriterOwnedPathsRefuseAnObservedContext(t *testing.T) {
	t.Parallel()
	ctx, pool, store := setup(t)
	_, err := store.Create(ctx, "p", "t1", "", "")
	require.NoError(t, err)
	observed := outbox.WithObserved(ctx, outbox.Observed{ConsumerID: "dash", EventID: "e"})

	_, err = store.Delete(observed, "p", "t1")
	require.ErrorIs(t, err, outbox.ErrObservedContext)
	require.ErrorIs(t, store.SendDeleteNotice(observed, taskstore.Task{ProjectID: "p", ID: "t1"}), outbox.ErrObservedContext)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	require.ErrorIs(t, store.WriteDeleteAuditTx(observed, tx, taskstore.Task{ProjectID: "p", ID: "t1"}), outbox.ErrObservedContext)
	require.NoError(t, tx.Commit(ctx))

	task, err := store.Get(ctx, "p", "t1")
	require.NoError(t, err)
	require.Nil(t, task.DeletedAt)
	require.Zero(t, pgtest.QueryInt(t, pool, `SELECT count(*) FROM run_audit`))
	require.Zero(t, pgtest.QueryInt(t, pool, `SELECT count(*) FROM mailbox_notices`))
}

func TestSettingsAndCache(t *testing.T) {
	t.Parallel()
	ctx, pool, store := setup(t)
	s := taskstore.NewSettings(pool, "node-1")
	_, found, err := s.Setting(ctx, "outbox.consumer_id")
	require.NoError(t, err)
	require.False(t, found)
	require.NoError(t, s.Set(ctx, "outbox.consumer_id", "dash"))
	require.NoError(t, s.Set(ctx, "outbox.consumer_id", "dash-2"))
	v, found, err := s.Setting(ctx, "outbox.consumer_id")
	require.NoError(t, err)
	require.True(t, found)
	require.Equal(t, "dash-2", v)
	_, found, err = taskstore.NewSettings(pool, "node-2").Setting(ctx, "outbox.consumer_id")
	require.NoError(t, err)
	require.False(t, found, "settings are scoped per node")

	ids, err := store.CreateMany(ctx, "p", "t", 3)
	require.NoError(t, err)
	other := taskstore.New(pool, taskstore.Options{})
	require.NoError(t, other.LoadCache(ctx, "p"))
	require.Equal(t, ids, other.Cache().Live("p"))
	removed, err := other.Cache().RemoveTask(ctx, "p", "t-1", time.Now())
	require.NoError(t, err)
	require.True(t, removed)
	removed, err = other.Cache().RemoveTask(ctx, "p", "t-1", time.Now())
	require.NoError(t, err)
	require.False(t, removed, "removal is idempotent")
}

func TestSelfHealingRunsTasksAtOpenAndOnSchedule(t *testing.T) {
	t.Parallel()
	var runs atomic.Int64
	ran := make(chan struct{}, 10)
	m := taskstore.NewSelfHealing([]outbox.MaintenanceTask{
		{Name: "counter", Run: func(context.Context) (fmt.Stringer, error) {
			runs.Add(1)
			ran <- struct{}{}
			return stringer("ok"), nil
		}},
		{Name: "broken", Run: func(context.Context) (fmt.Stringer, error) { return nil, errors.New("boom") }},
	}, 10*time.Millisecond, nil)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	m.Start(ctx)
	for range 3 { // at open, then on the schedule
		select {
		case <-ran:
		case <-ctx.Done():
			t.Fatal("the schedule never ran")
		}
	}
	require.NoError(t, m.Stop(ctx))
	results := m.LastResults()
	require.Len(t, results, 2)
	require.Equal(t, "ok", results[0].Summary)
	require.EqualError(t, results[1].Err, "boom", "a failing task is reported, and the others still run")
	require.GreaterOrEqual(t, runs.Load(), int64(3))
}

type stringer string

func (s stringer) String() string { return string(s) }

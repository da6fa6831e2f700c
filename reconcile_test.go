package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
)

// quietConfig scans once at start and then only when a test asks (outbox.ScanNow): no
// notifications, an hour between polls.
func quietConfig() outbox.Config {
	cfg := fastConfig()
	cfg.PollInterval = time.Hour
	cfg.FollowUpInterval = time.Hour // no follow-up scans either
	cfg.NotifyDisabled = true
	return cfg
}

// newConsumerWithLive builds a consumer for p whose reconciliation reads live tasks from live.
func newConsumerWithLive(t *testing.T, p *process, id outbox.ConsumerID, projects []string, cfg outbox.Config, live outbox.LiveTasks) *outbox.Consumer {
	t.Helper()
	d := outbox.NewDispatcher(outbox.DispatcherOptions{
		Listeners: []outbox.Listener{p.rec}, Cache: p.store.Cache(), SelfWriterID: p.writer.ProcessID(), Logger: zaptest.NewLogger(t),
	})
	c, err := outbox.NewConsumer(outbox.ConsumerOptions{
		ID: id, Pool: p.pool, Config: cfg, Projects: outbox.StaticProjects(projects), Dispatcher: d,
		LiveTasks: live, Cache: p.store.Cache(), Audit: p.store, Logger: zaptest.NewLogger(t),
	})
	require.NoError(t, err)
	return c
}

// TestOwnEventsReachTheCache: a process's own event skips its listeners (its local emitter
// told them) but is still applied to its cache, which may have been rebuilt from a snapshot
// older than the delete.
func TestOwnEventsReachTheCache(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := pgtest.NewDB(t)
	proc := startProcess(t, db.URL, processOpts{id: "engine", projects: []string{"p"}, cfg: fastConfig(), noStart: true})
	_, err := proc.store.CreateMany(ctx, "p", "t", 3)
	require.NoError(t, err)
	_, err = proc.store.Delete(ctx, "p", "t-2")
	require.NoError(t, err)
	// The cache holds t-2 again, as a rebuild from an older snapshot would leave it.
	require.NoError(t, proc.store.Cache().ReplaceLive(ctx, "p", []string{"t-1", "t-2", "t-3"}))

	proc.start(t)
	waitCursor(t, ctx, proc.pool, "p", "engine", 1)
	require.False(t, proc.store.Cache().Has("p", "t-2"), "the own event was applied to the cache")
	require.Empty(t, proc.rec.snapshot(), "and not delivered to the process's own listeners")
	require.Equal(t, int64(1), proc.consumer.Stats().Own)
}

// TestReconciliationDoesNotResurrectAnOwnDeletion interleaves, deterministically, a
// reconciliation with a delete made by the same process: the delete commits (and the store
// drops the task from the shared cache) after the reconciliation's snapshot was taken and
// before its live set replaces the cache. The task must not come back, not even until the
// event is dispatched: the consumer here scans once and then only when told to.
func TestReconciliationDoesNotResurrectAnOwnDeletion(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := pgtest.NewDB(t)
	other := seedDeletes(t, ctx, db.URL, "p", 4) // history the new cursor will not replay
	_, err := other.store.CreateMany(ctx, "p", "live", 3)
	require.NoError(t, err)
	_, err = outbox.Tick(ctx, other.pool) // numbered before the consumer starts: head 4
	require.NoError(t, err)

	cfg := quietConfig()
	cfg.NewCursor = outbox.NewCursorReconcile
	proc := startProcess(t, db.URL, processOpts{id: "engine", projects: []string{"p"}, cfg: cfg, noStart: true})
	require.True(t, proc.store.Cache().Has("p", "live-2"))
	deleted := make(chan error, 1)
	proc.consumer = newConsumerWithLive(t, proc, "engine", []string{"p"}, cfg, &racingLiveTasks{inner: proc.store, during: func() {
		// The snapshot (head 4, live-2 live) is open; this process deletes live-2 and, after
		// commit, removes it from its cache.
		_, err := proc.store.Delete(ctx, "p", "live-2")
		deleted <- err
	}})
	proc.start(t)
	require.NoError(t, <-deleted)
	waitCursor(t, ctx, proc.pool, "p", "engine", 4) // reconciled at the snapshot's head
	waitReconciled(t, ctx, proc.consumer, 1)
	require.Equal(t, []string{"live-1", "live-3"}, proc.store.Cache().Live("p"),
		"the reconciliation did not put back a task deleted after its snapshot")

	// The delete's own event, above the reconciled head, is applied and not re-delivered. It is
	// numbered by a tick (the consumer's own ticker ticks once per poll interval, an hour here).
	_, err = outbox.Tick(ctx, proc.pool)
	require.NoError(t, err)
	outbox.ScanNow(proc.consumer)
	waitCursor(t, ctx, proc.pool, "p", "engine", 5)
	require.Equal(t, []string{"live-1", "live-3"}, proc.store.Cache().Live("p"))
	require.Empty(t, proc.rec.snapshot())
	require.Equal(t, int64(1), proc.consumer.Stats().Own)
}

// TestRestoredDatabaseDoesNotSuppressNewEvents: a restore moves the project's head back
// under a running consumer. Whatever the consumer does about it (reconcile because its cursor
// is ahead of the head, or take a new lease on a restored cursor), new deletions that reuse
// the sequences above the restored head are new events, not re-deliveries.
func TestRestoredDatabaseDoesNotSuppressNewEvents(t *testing.T) {
	t.Parallel()
	// Each subtest takes its own deadline when it runs: parallel subtests wait for a free slot
	// after this function returns, and a deadline taken here could pass while they wait.
	var setupRestore func(t *testing.T, ctx context.Context, cfg outbox.Config, restoreCursor, sameLease bool) (*process, *process)
	subtestCtx := func(t *testing.T) context.Context {
		return ctxT(t)
	}

	// setup delivers 6 deletions to a running consumer and then "restores" the outbox to a
	// backup taken at head 3, in one transaction as a restore is: the events above it, the
	// ticks that numbered them and the head go back, and with restoreCursor the consumer's
	// cursor row too (at 3, under the previous, expired lease, so that taking it again gives
	// the epoch number it holds now). With sameLease the cursor goes back to 3 and the lease
	// stays as it is: the backup was taken while this instance held it.
	setup := func(t *testing.T, ctx context.Context, restoreCursor bool) (*process, *process) {
		return setupRestore(t, ctx, fastConfig(), restoreCursor, false)
	}
	setupRestore = func(t *testing.T, ctx context.Context, cfg outbox.Config, restoreCursor, sameLease bool) (*process, *process) {
		db := pgtest.NewDB(t)
		w := startProcess(t, db.URL, processOpts{projects: []string{"p"}, cfg: fastConfig()})
		_, err := w.store.CreateMany(ctx, "p", "t", 9)
		require.NoError(t, err)
		obs := startProcess(t, db.URL, processOpts{id: "dash", projects: []string{"p"}, cfg: cfg})
		deleteTasks := func(from, to int) {
			for i := from; i <= to; i++ {
				_, err := w.store.Delete(ctx, "p", fmt.Sprintf("t-%d", i))
				require.NoError(t, err)
			}
		}
		deleteTasks(1, 3)
		obs.rec.waitCount(t, ctx, 3)
		// The backup: its last tick numbered the project through 3 (nothing else was written).
		backupTick := pgtest.QueryInt(t, w.pool, `SELECT max(tick_id)::int FROM lifecycle_tick`)
		deleteTasks(4, 6)
		obs.rec.waitCount(t, ctx, 6)
		waitCursor(t, ctx, w.pool, "p", "dash", 6)
		restore := []string{
			`DELETE FROM lifecycle_event_log WHERE project_id = 'p' AND task_id IN ('t-4', 't-5', 't-6')`,
			fmt.Sprintf(`DELETE FROM lifecycle_tick_project WHERE tick_id > %d`, backupTick),
			fmt.Sprintf(`DELETE FROM lifecycle_tick WHERE tick_id > %d`, backupTick), // the head is where the last part ends: 3
		}
		switch {
		case restoreCursor:
			restore = append(restore, `UPDATE lifecycle_consumer_cursors SET last_acked_sequence = 3, lease_owner = 'dash@0000000000000000',
				lease_expires_at = now() - interval '1 hour', lease_epoch = lease_epoch - 1 WHERE project_id = 'p' AND consumer_id = 'dash'`)
		case sameLease:
			restore = append(restore, `UPDATE lifecycle_consumer_cursors SET last_acked_sequence = 3 WHERE project_id = 'p' AND consumer_id = 'dash'`)
		}
		require.NoError(t, pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
			for _, stmt := range restore {
				if _, err := tx.Exec(ctx, stmt); err != nil {
					return err
				}
			}
			return nil
		}))
		return w, obs
	}
	deleteNew := func(t *testing.T, ctx context.Context, w *process) {
		for i := 7; i <= 9; i++ {
			_, err := w.store.Delete(ctx, "p", fmt.Sprintf("t-%d", i))
			require.NoError(t, err)
		}
	}
	requireNewOnes := func(t *testing.T, ctx context.Context, obs *process) {
		evs := obs.rec.waitCount(t, ctx, 9)
		var tasks []string
		for _, ev := range evs[6:] {
			tasks = append(tasks, ev.TaskID)
		}
		require.Equal(t, []string{"t-7", "t-8", "t-9"}, tasks, "the new deletions reached the listener")
		for _, id := range tasks {
			require.False(t, obs.store.Cache().Has("p", id), "and the cache")
		}
	}

	t.Run("the cursor is ahead of the head: reconcile", func(t *testing.T) {
		t.Parallel()
		ctx := ctxT(t)
		w, obs := setup(t, ctx, false)
		outbox.ScanNow(obs.consumer)
		waitCursor(t, ctx, w.pool, "p", "dash", 3)
		waitReconciled(t, ctx, obs.consumer, 1)
		deleteNew(t, ctx, w)
		requireNewOnes(t, ctx, obs)
		waitCursor(t, ctx, w.pool, "p", "dash", 6)
	})

	t.Run("the cursor was restored too: a new lease", func(t *testing.T) {
		t.Parallel()
		ctx := ctxT(t)
		w, obs := setup(t, ctx, true)
		deleteNew(t, ctx, w)
		requireNewOnes(t, ctx, obs)
		waitCursor(t, ctx, w.pool, "p", "dash", 6)
	})

	// Issue 28: the cursor went back under the lease the consumer holds, and no scan ran
	// between the restore and the new deletions (no poll within the hour; the restore sends
	// no notification): the first scan finds the head back at or above its position and must
	// still see that it went below it, restart from the durable cursor and deliver the new
	// events, without reconciling (the cursor is where the restored history wants it).
	t.Run("the cursor was restored under the same lease", func(t *testing.T) {
		t.Parallel()
		ctx := subtestCtx(t)
		cfg := fastConfig()
		cfg.PollInterval = time.Hour
		w, obs := setupRestore(t, ctx, cfg, false, true)
		deleteNew(t, ctx, w)
		requireNewOnes(t, ctx, obs)
		waitCursor(t, ctx, w.pool, "p", "dash", 6)
		require.Zero(t, obs.consumer.Stats().Reconciliations)
	})
}

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
	"fusion/outbox/internal/testkit"
)

// quietConfig scans once at start and then only when a test asks (outbox.ScanNow): no
// notifications, an hour between polls.
func quietConfig() outbox.Config {
	cfg := testkit.FastConfig()
	cfg.PollInterval = time.Hour
	cfg.FollowUpInterval = time.Hour // no follow-up scans either
	cfg.NotifyDisabled = true
	return cfg
}

// newConsumerWithLive builds a consumer for p whose reconciliation reads live tasks from live.
func newConsumerWithLive(t *testing.T, p *testkit.Process, id outbox.ConsumerID, projects []string, cfg outbox.Config, live outbox.LiveTasks) *outbox.Consumer {
	t.Helper()
	d := outbox.NewDispatcher(outbox.DispatcherOptions{
		Listeners: []outbox.Listener{p.Rec}, Cache: p.Store.Cache(), SelfWriterID: p.Writer.ProcessID(), Logger: zaptest.NewLogger(t),
	})
	c, err := outbox.NewConsumer(outbox.ConsumerOptions{
		ID: id, Pool: p.Pool, Config: cfg, Projects: outbox.StaticProjects(projects), Dispatcher: d,
		LiveTasks: live, Cache: p.Store.Cache(), Audit: p.Store, Logger: zaptest.NewLogger(t),
	})
	require.NoError(t, err)
	return c
}

// TestOwnEventsReachTheCache: a process's own event skips its listeners (its local emitter
// told them) but is still applied to its cache, which may have been rebuilt from a snapshot
// older than the delete.
func TestOwnEventsReachTheCache(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	proc := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "engine", Projects: []string{"p"}, Config: testkit.FastConfig(), NoStart: true})
	_, err := proc.Store.CreateMany(ctx, "p", "t", 3)
	require.NoError(t, err)
	_, err = proc.Store.Delete(ctx, "p", "t-2")
	require.NoError(t, err)
	// The cache holds t-2 again, as a rebuild from an older snapshot would leave it.
	require.NoError(t, proc.Store.Cache().ReplaceLive(ctx, "p", []string{"t-1", "t-2", "t-3"}))

	proc.Start(t)
	testkit.WaitCursor(t, ctx, proc.Pool, "p", "engine", 1)
	require.False(t, proc.Store.Cache().Has("p", "t-2"), "the own event was applied to the cache")
	require.Empty(t, proc.Rec.Snapshot(), "and not delivered to the process's own listeners")
	require.Equal(t, int64(1), proc.Consumer.Stats().Own)
}

// TestReconciliationDoesNotResurrectAnOwnDeletion interleaves, deterministically, a
// reconciliation with a delete made by the same process: the delete commits (and the store
// drops the task from the shared cache) after the reconciliation's snapshot was taken and
// before its live set replaces the cache. The task must not come back, not even until the
// event is dispatched: the consumer here scans once and then only when told to.
func TestReconciliationDoesNotResurrectAnOwnDeletion(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	other := seedDeletes(t, ctx, db.URL, "p", 4) // history the new cursor will not replay
	_, err := other.Store.CreateMany(ctx, "p", "live", 3)
	require.NoError(t, err)
	_, err = outbox.Tick(ctx, other.Pool) // numbered before the consumer starts: head 4
	require.NoError(t, err)

	cfg := quietConfig()
	cfg.NewCursor = outbox.NewCursorReconcile
	proc := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "engine", Projects: []string{"p"}, Config: cfg, NoStart: true})
	require.True(t, proc.Store.Cache().Has("p", "live-2"))
	deleted := make(chan error, 1)
	proc.Consumer = newConsumerWithLive(t, proc, "engine", []string{"p"}, cfg, &racingLiveTasks{inner: proc.Store, during: func() {
		// The snapshot (head 4, live-2 live) is open; this process deletes live-2 and, after
		// commit, removes it from its cache.
		_, err := proc.Store.Delete(ctx, "p", "live-2")
		deleted <- err
	}})
	proc.Start(t)
	require.NoError(t, <-deleted)
	testkit.WaitCursor(t, ctx, proc.Pool, "p", "engine", 4) // reconciled at the snapshot's head
	waitReconciled(t, ctx, proc.Consumer, 1)
	require.Equal(t, []string{"live-1", "live-3"}, proc.Store.Cache().Live("p"),
		"the reconciliation did not put back a task deleted after its snapshot")

	// The delete's own event, above the reconciled head, is applied and not re-delivered. It is
	// numbered by a tick (the consumer's own ticker ticks once per poll interval, an hour here).
	_, err = outbox.Tick(ctx, proc.Pool)
	require.NoError(t, err)
	outbox.ScanNow(proc.Consumer)
	testkit.WaitCursor(t, ctx, proc.Pool, "p", "engine", 5)
	require.Equal(t, []string{"live-1", "live-3"}, proc.Store.Cache().Live("p"))
	require.Empty(t, proc.Rec.Snapshot())
	require.Equal(t, int64(1), proc.Consumer.Stats().Own)
}

// TestRestoredDatabaseDoesNotSuppressNewEvents: a restore moves the project's head back
// under a running consumer. Whatever the consumer does about it (reconcile because its cursor
// is ahead of the head, or take a new lease on a restored cursor), new deletions that reuse
// the sequences above the restored head are new events, not re-deliveries.
func TestRestoredDatabaseDoesNotSuppressNewEvents(t *testing.T) {
	t.Parallel()
	// Each subtest takes its own deadline when it runs: parallel subtests wait for a free slot
	// after this function returns, and a deadline taken here could pass while they wait.
	var setupRestore func(t *testing.T, ctx context.Context, cfg outbox.Config, restoreCursor, sameLease bool) (*testkit.Process, *testkit.Process)
	subtestCtx := func(t *testing.T) context.Context {
		return testkit.Ctx(t)
	}
	// tickNow numbers what committed in one tick and announces it, as the ticker would.
	tickNow := func(t *testing.T, ctx context.Context, w *testkit.Process) {
		_, err := outbox.Tick(ctx, w.Pool)
		require.NoError(t, err)
		_, err = w.Pool.Exec(ctx, `SELECT pg_notify('lifecycle_outbox_tick', 'p')`)
		require.NoError(t, err)
	}

	// setup delivers 6 deletions to a running consumer and then "restores" the outbox to a
	// backup taken at head 3, in one transaction as a restore is: the events above it, the
	// ticks that numbered them and the head go back, and with restoreCursor the consumer's
	// cursor row too (at 3, under the previous, expired lease, so that taking it again gives
	// the epoch number it holds now). With sameLease the cursor goes back to 3 and the lease
	// stays as it is: the backup was taken while this instance held it; and the test ticks, one
	// tick for each batch of deletions, while another session holds the ticker's election.
	setup := func(t *testing.T, ctx context.Context, restoreCursor bool) (*testkit.Process, *testkit.Process) {
		return setupRestore(t, ctx, testkit.FastConfig(), restoreCursor, false)
	}
	setupRestore = func(t *testing.T, ctx context.Context, cfg outbox.Config, restoreCursor, sameLease bool) (*testkit.Process, *testkit.Process) {
		db := pgtest.NewDB(t)
		w := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: []string{"p"}, Config: testkit.FastConfig()})
		_, err := w.Store.CreateMany(ctx, "p", "t", 9)
		require.NoError(t, err)
		if sameLease {
			holdTickerElection(t, ctx, db.URL)
		}
		obs := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "dash", Projects: []string{"p"}, Config: cfg})
		deleteTasks := func(from, to int) {
			for i := from; i <= to; i++ {
				_, err := w.Store.Delete(ctx, "p", fmt.Sprintf("t-%d", i))
				require.NoError(t, err)
			}
			if sameLease {
				tickNow(t, ctx, w)
			}
		}
		deleteTasks(1, 3)
		obs.Rec.WaitCount(t, ctx, 3)
		// The backup: its last tick numbered the project through 3 (nothing else was written).
		backupTick := pgtest.QueryInt(t, w.Pool, `SELECT max(tick_id)::int FROM lifecycle_tick`)
		deleteTasks(4, 6)
		obs.Rec.WaitCount(t, ctx, 6)
		testkit.WaitCursor(t, ctx, w.Pool, "p", "dash", 6)
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
		require.NoError(t, pgx.BeginFunc(ctx, w.Pool, func(tx pgx.Tx) error {
			for _, stmt := range restore {
				if _, err := tx.Exec(ctx, stmt); err != nil {
					return err
				}
			}
			return nil
		}))
		return w, obs
	}
	deleteNew := func(t *testing.T, ctx context.Context, w *testkit.Process) {
		for i := 7; i <= 9; i++ {
			_, err := w.Store.Delete(ctx, "p", fmt.Sprintf("t-%d", i))
			require.NoError(t, err)
		}
	}
	requireNewOnes := func(t *testing.T, ctx context.Context, obs *testkit.Process) {
		evs := obs.Rec.WaitCount(t, ctx, 9)
		var tasks []string
		for _, ev := range evs[6:] {
			tasks = append(tasks, ev.TaskID)
		}
		require.Equal(t, []string{"t-7", "t-8", "t-9"}, tasks, "the new deletions reached the listener")
		for _, id := range tasks {
			require.False(t, obs.Store.Cache().Has("p", id), "and the cache")
		}
	}

	t.Run("the cursor is ahead of the head: reconcile", func(t *testing.T) {
		t.Parallel()
		ctx := testkit.Ctx(t)
		w, obs := setup(t, ctx, false)
		outbox.ScanNow(obs.Consumer)
		testkit.WaitCursor(t, ctx, w.Pool, "p", "dash", 3)
		waitReconciled(t, ctx, obs.Consumer, 1)
		deleteNew(t, ctx, w)
		requireNewOnes(t, ctx, obs)
		testkit.WaitCursor(t, ctx, w.Pool, "p", "dash", 6)
	})

	t.Run("the cursor was restored too: a new lease", func(t *testing.T) {
		t.Parallel()
		ctx := testkit.Ctx(t)
		w, obs := setup(t, ctx, true)
		deleteNew(t, ctx, w)
		requireNewOnes(t, ctx, obs)
		testkit.WaitCursor(t, ctx, w.Pool, "p", "dash", 6)
	})

	// Issue 28: the cursor went back under the lease the consumer holds, and no scan ran
	// between the restore and the new deletions (no poll within the hour; the restore sends
	// no notification): the first scan finds the head back at its position (one tick numbered
	// the new deletions) and must still see that it went below it, restart from the durable
	// cursor and deliver the new events, without reconciling (the cursor is where the restored
	// history wants it).
	t.Run("the cursor was restored under the same lease", func(t *testing.T) {
		t.Parallel()
		ctx := subtestCtx(t)
		cfg := testkit.FastConfig()
		cfg.PollInterval = time.Hour
		w, obs := setupRestore(t, ctx, cfg, false, true)
		deleteNew(t, ctx, w)
		tickNow(t, ctx, w) // one tick for the three: the head goes from 3 to 6, the stream's position, at once
		requireNewOnes(t, ctx, obs)
		testkit.WaitCursor(t, ctx, w.Pool, "p", "dash", 6)
		require.Zero(t, obs.Consumer.Stats().Reconciliations)
	})
}

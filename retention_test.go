package outbox_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
	"fusion/outbox/outboxtest"
)

const month = 31 * 24 * time.Hour

func newRetention(t *testing.T, pool *pgxpool.Pool, cfg outbox.Config) *outbox.Retention {
	t.Helper()
	r, err := outbox.NewRetention(pool, cfg, zaptest.NewLogger(t), nil)
	require.NoError(t, err)
	return r
}

// insertOldEvents writes events 1..n of project "p", numbered and 40 days old (past the
// default retention window), and its head.
func insertOldEvents(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	ctx := ctxT(t)
	_, err := pool.Exec(ctx, `INSERT INTO lifecycle_outbox (project_id, sequence, event_type, task_id, deleted_at, archived, writer_process_id, payload_version, occurred_at)
		SELECT 'p', i, 'task:deleted', 'old-' || i, '2026-01-01T00:00:00Z', false, 'w', 1, now() - interval '40 days'
		FROM generate_series(1, $1) AS i`, n)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO lifecycle_outbox_heads (project_id, last_sequence) VALUES ('p', $1)`, n)
	require.NoError(t, err)
}

func outboxSequences(t *testing.T, pool *pgxpool.Pool, project string) []int64 {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT sequence FROM lifecycle_outbox WHERE project_id = $1 ORDER BY sequence`, project)
	require.NoError(t, err)
	defer rows.Close()
	var out []int64
	for rows.Next() {
		var s int64
		require.NoError(t, rows.Scan(&s))
		out = append(out, s)
	}
	return out
}

func floorOf(t *testing.T, pool *pgxpool.Pool, project string) int64 {
	t.Helper()
	var f int64
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT pruned_through FROM lifecycle_outbox_heads WHERE project_id = $1`, project).Scan(&f))
	return f
}

func seq(from, to int64) []int64 {
	var out []int64
	for i := from; i <= to; i++ {
		out = append(out, i)
	}
	return out
}

func TestRetentionKeepsWhatAnyoneStillNeeds(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := pgtest.NewDB(t)
	clock := outboxtest.NewFakeClock()
	cfg := fastConfig()
	cfg.Clock = clock
	cfg.LeaseTTL = 24 * 365 * time.Hour // the fake clock jumps months; keep leases out of the way
	cfg.HeartbeatInterval = time.Hour

	w := seedDeletes(t, ctx, db.URL, "p", 10)
	_, err := w.store.CreateMany(ctx, "p", "live", 3)
	require.NoError(t, err)
	fast := startProcess(t, db.URL, processOpts{id: "fast", projects: []string{"p"}, cfg: cfg})
	waitCursor(t, ctx, w.pool, "p", "fast", 10)
	fast.stop(t)
	// "slow" acknowledged 4 events and then went away.
	_, err = w.pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence) VALUES ('p', 'slow', 4)`)
	require.NoError(t, err)

	r := newRetention(t, w.pool, cfg)
	res, err := r.Sweep(ctx)
	require.NoError(t, err)
	require.Zero(t, res.Pruned(), "rows newer than the window stay even when acknowledged")

	clock.Advance(month)
	plans, err := r.Plan(ctx)
	require.NoError(t, err)
	require.Equal(t, []outbox.PrunePlan{{ProjectID: "p", Head: 10, Through: 4, Prunable: 4, HeldBy: "slow"}}, plans)
	res, err = r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"p": 4}, res.PrunedByProject)
	require.Equal(t, seq(5, 10), outboxSequences(t, w.pool, "p"), "rows the slow consumer has not acknowledged stay")
	require.Equal(t, int64(4), floorOf(t, w.pool, "p"))

	admin := outbox.NewAdmin(w.pool, outbox.AdminOptions{Audit: w.store, Clock: clock})
	retired, err := admin.RetireConsumer(ctx, outbox.RetireRequest{ConsumerID: "slow", Operator: outbox.Operator{Actor: "oncall", Reason: "FN-77"}})
	require.NoError(t, err)
	require.Equal(t, []string{"p"}, retired)
	require.Equal(t, 1, pgtest.QueryInt(t, w.pool, `SELECT count(*) FROM run_audit WHERE action = $1 AND actor = 'oncall'`, outbox.AuditConsumerRetired))
	res, err = r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(6), res.Pruned(), "retiring the laggard lets its rows go")
	require.Empty(t, outboxSequences(t, w.pool, "p"))
	require.Equal(t, int64(10), floorOf(t, w.pool, "p"))

	// A retired identity cannot start again silently.
	slow := startProcess(t, db.URL, processOpts{id: "slow", projects: []string{"p"}, cfg: cfg, noStart: true})
	require.ErrorIs(t, slow.consumer.Start(ctx), outbox.ErrConsumerRetired)

	// Reinstated (audited), it finds its cursor below the pruned floor and reconciles: its
	// cache, which missed every deletion, ends up with exactly the live tasks.
	_, err = admin.ReinstateConsumer(ctx, outbox.RetireRequest{ConsumerID: "slow", Operator: outbox.Operator{Actor: "oncall", Reason: "FN-78"}})
	require.NoError(t, err)
	slow = startProcess(t, db.URL, processOpts{id: "slow", projects: []string{"p"}, cfg: cfg, noStart: true})
	stale := []string{"live-1", "live-2", "live-3"}
	for i := range 10 {
		stale = append(stale, fmt.Sprintf("t-%d", i+1))
	}
	require.NoError(t, slow.store.Cache().ReplaceLive(ctx, "p", stale))
	slow.start(t)
	waitCursor(t, ctx, w.pool, "p", "slow", 10)
	require.Equal(t, []string{"live-1", "live-2", "live-3"}, slow.store.Cache().Live("p"), "no deletion lost across the pruned gap")
	_, err = w.store.Delete(ctx, "p", "live-2")
	require.NoError(t, err)
	evs := slow.rec.waitCount(t, ctx, 1)
	require.Equal(t, int64(11), evs[0].Sequence, "and it carries on with new events")
}

func TestRetentionOfDeadLetters(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := pgtest.NewDB(t)
	clock := outboxtest.NewFakeClock()
	cfg := fastConfig()
	cfg.Clock = clock
	cfg.MaxAttempts = 1
	cfg.LeaseTTL = 24 * 365 * time.Hour
	cfg.HeartbeatInterval = time.Hour

	w := seedDeletes(t, ctx, db.URL, "p", 3)
	var fixed atomic.Bool
	broken := startProcess(t, db.URL, processOpts{id: "broken", projects: []string{"p"}, cfg: cfg, noStart: true})
	broken.rec.setFail(func(ev outbox.ObservedEvent) error {
		if ev.Sequence <= 2 && !(fixed.Load() && ev.Sequence == 1) {
			return errListener
		}
		return nil
	})
	broken.start(t)
	waitCursor(t, ctx, w.pool, "p", "broken", 3)
	fixed.Store(true)
	admin := outbox.NewAdmin(w.pool, outbox.AdminOptions{Audit: w.store, Clock: clock})
	_, err := admin.RequestReplay(ctx, outbox.ReplayRequest{ProjectID: "p", ConsumerID: "broken", Sequence: 1, Operator: outbox.Operator{Actor: "oncall", Reason: "FN-1"}})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return deliveryOf(t, w.pool, "broken", 1).State == "resolved" }, waitLimit, 10*time.Millisecond)
	broken.stop(t)

	r := newRetention(t, w.pool, cfg)
	res, err := r.Sweep(ctx)
	require.NoError(t, err)
	require.Zero(t, res.DeadLettersPruned, "a resolved dead letter is kept for the retention period")

	clock.Advance(month)
	res, err = r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), res.DeadLettersPruned, "the resolved one goes after 30 days")
	require.Equal(t, "dead", deliveryOf(t, w.pool, "broken", 2).State, "the unresolved one stays")
	require.Equal(t, []int64{2}, outboxSequences(t, w.pool, "p"), "and so does the event it points at, for a replay")

	_, err = admin.RetireConsumer(ctx, outbox.RetireRequest{ConsumerID: "broken", Operator: outbox.Operator{Actor: "oncall", Reason: "decommissioned"}})
	require.NoError(t, err)
	res, err = r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), res.DeadLettersPruned, "retiring its consumer releases an unresolved dead letter")
	require.Empty(t, outboxSequences(t, w.pool, "p"))
}

func TestRetentionWorksInBoundedBatchesBesideWriters(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	const old = 50000
	insertOldEvents(t, pool, old)

	// Writers keep deleting in the same project throughout.
	store := testhost.New(pool, testhost.Options{Writer: newWriter(t, pool, outbox.Config{})})
	ids, err := store.CreateMany(ctx, "p", "new", 2000)
	require.NoError(t, err)
	stop := make(chan struct{})
	var deleted atomic.Int64
	writerDone := make(chan error, 1)
	go func() {
		for _, id := range ids {
			select {
			case <-stop:
				writerDone <- nil
				return
			default:
			}
			if _, err := store.Delete(ctx, "p", id); err != nil {
				writerDone <- err
				return
			}
			deleted.Add(1)
		}
		writerDone <- nil
	}()

	r := newRetention(t, pool, outbox.Config{RetentionBatchSize: 2000, RetentionBudget: 30000})
	first, err := r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(30000), first.Pruned())
	require.True(t, first.BudgetExhausted)
	require.Equal(t, 15, first.Batches, "bounded batches of RetentionBatchSize")
	second, err := r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(20000), second.Pruned())
	require.False(t, second.BudgetExhausted)
	close(stop)
	require.NoError(t, <-writerDone)
	require.Positive(t, deleted.Load(), "deletes committed while the sweep ran")

	heads, err := outbox.Sequence(ctx, pool, []string{"p"}, 10000)
	require.NoError(t, err)
	require.Equal(t, int64(old)+deleted.Load(), heads["p"].LastSequence, "the writers' events follow the pruned ones with no gap")
	require.Equal(t, int64(old), heads["p"].PrunedThrough)
	require.Equal(t, seq(old+1, old+deleted.Load()), outboxSequences(t, pool, "p"))
}

func TestPruneBatchDoesNotBlockTheDeleteTransaction(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	store := testhost.New(pool, testhost.Options{Writer: newWriter(t, pool, outbox.Config{NotifyDisabled: true})})
	ids, err := store.CreateMany(ctx, "p", "t", 20)
	require.NoError(t, err)
	for _, id := range ids[:10] {
		_, err := store.Delete(ctx, "p", id)
		require.NoError(t, err)
	}
	_, err = outbox.Sequence(ctx, pool, nil, 100)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE lifecycle_outbox SET occurred_at = occurred_at - interval '40 days'`)
	require.NoError(t, err)

	// One prune batch holds its locks, uncommitted.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var n, maxSeq int64
	require.NoError(t, tx.QueryRow(ctx, outbox.PruneBatchSQL, "p", 100, 0, time.Duration(0), 30*24*time.Hour).Scan(&n, &maxSeq))
	require.Equal(t, int64(10), n)
	require.Equal(t, int64(10), maxSeq)

	// A delete in the same project commits meanwhile.
	deadline, cancel := context.WithTimeout(ctx, waitLimit)
	defer cancel()
	for _, id := range ids[10:] {
		_, err := store.Delete(deadline, "p", id)
		require.NoError(t, err, "the delete transaction waited on the prune batch")
	}
	require.NoError(t, tx.Commit(ctx))
}

// TestSweepRechecksCursorsInEachBatch: the sweep's plan is computed once, but a cursor created
// or reinstated while it runs holds rows back from the next batch on: each batch re-reads the
// slowest live cursor inside its own transaction.
func TestSweepRechecksCursorsInEachBatch(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := pgtest.NewDB(t)
	clock := outboxtest.NewFakeClock()
	w := seedDeletes(t, ctx, db.URL, "p", 12)
	_, err := outbox.Sequence(ctx, w.pool, nil, 100)
	require.NoError(t, err)
	_, err = w.pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence, retired_at, retired_by, retired_reason)
		VALUES ('p', 'fast', 12, NULL, NULL, NULL), ('p', 'gone', 2, now(), 'oncall', 'FN-1')`)
	require.NoError(t, err)
	clock.Advance(month)

	r := newRetention(t, w.pool, outbox.Config{Clock: clock, RetentionBatchSize: 2})
	batches := 0
	outbox.BeforePruneBatch(r, func(project string) {
		batches++
		switch batches {
		case 2: // after 1-2 went: a new consumer appears at 5
			_, err := w.pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence) VALUES ('p', 'late', 5)`)
			require.NoError(t, err)
		case 3: // after 3-4 went: the retired one at 2 is reinstated
			_, err := w.pool.Exec(ctx, `UPDATE lifecycle_consumer_cursors SET retired_at = NULL, retired_by = NULL, retired_reason = NULL WHERE consumer_id = 'gone'`)
			require.NoError(t, err)
		}
	})
	res, err := r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, seq(5, 12), outboxSequences(t, w.pool, "p"), "nothing above a cursor that existed when its batch ran")
	require.Equal(t, int64(4), res.Pruned())
	require.Equal(t, int64(4), floorOf(t, w.pool, "p"))
}

// TestSweepPrunesOtherProjectsWhenOneFails: a project whose heads row another role holds
// (the threat model lets a consumer of that project do so) times out on its lock; the sweep
// still prunes every other project and returns a *ProjectErrors naming the one it skipped.
func TestSweepPrunesOtherProjectsWhenOneFails(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.NewPool(t)
	seedEvents(t, pool, "a", 5)
	seedEvents(t, pool, "b", 5)
	_, err := pool.Exec(ctx, `UPDATE lifecycle_outbox SET occurred_at = now() - interval '2 hours'`)
	require.NoError(t, err)
	holder, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `SELECT 1 FROM lifecycle_outbox_heads WHERE project_id = 'a' FOR UPDATE`)
	require.NoError(t, err)

	r := newRetention(t, pool, outbox.Config{RetentionWindow: time.Hour, LockTimeout: 100 * time.Millisecond})
	res, err := r.Sweep(ctx)
	var pe *outbox.ProjectErrors
	require.ErrorAs(t, err, &pe)
	require.Equal(t, []string{"a"}, pe.Projects())
	require.Equal(t, int64(5), res.PrunedByProject["b"], "b is pruned although a is locked")
	require.Empty(t, outboxSequences(t, pool, "b"))
	require.Len(t, outboxSequences(t, pool, "a"), 5, "a keeps its rows until its lock is free")
}

// TestSweepBatchesStartWhereTheLastOneEnded: while a snapshot from before the sweep lives (a
// long report, a replica's feedback), the index entries of the rows a batch deleted cannot be
// marked dead, so a batch that scanned from the bottom of the project again would step over all
// of them: a sweep of B batches read about B²/2 batches of entries. Each batch now starts above
// the last row the one before it deleted.
func TestSweepBatchesStartWhereTheLastOneEnded(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := pgtest.NewDB(t)
	admin := pgtest.Pool(t, db.URL)
	const rows, batch = 400, 20
	insertOldEvents(t, admin, rows)
	_, err := admin.Exec(ctx, `VACUUM ANALYZE lifecycle_outbox`)
	require.NoError(t, err)

	old, err := admin.Begin(ctx) // a snapshot from before the sweep, held throughout
	require.NoError(t, err)
	defer func() { _ = old.Rollback(ctx) }()
	_, err = old.Exec(ctx, `SET TRANSACTION ISOLATION LEVEL REPEATABLE READ`)
	require.NoError(t, err)
	require.Equal(t, rows, pgtest.QueryInt(t, old, `SELECT count(*)::int FROM lifecycle_outbox`))

	cfg, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	cfg.MaxConns = 1 // one session, whose statistics are flushed below
	pool := pgtest.PoolConfig(t, cfg)
	entriesRead := func() int {
		_, err := pool.Exec(ctx, `SELECT pg_catalog.pg_stat_force_next_flush()`)
		require.NoError(t, err)
		return pgtest.QueryInt(t, pool, `SELECT coalesce(idx_tup_read, 0)::int FROM pg_catalog.pg_stat_user_indexes WHERE indexrelname = 'lifecycle_outbox_project_sequence'`)
	}
	before := entriesRead()
	res, err := newRetention(t, pool, outbox.Config{RetentionBatchSize: batch, RetentionBudget: rows}).Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(rows), res.Pruned())
	read := entriesRead() - before
	// Batch k stepping over the k-1 batches deleted before it: batch * B(B+1)/2 entries in all
	// (6,300 read in this test when every batch started from the bottom; 2,500 now).
	steppedOver := batch * res.Batches * (res.Batches + 1) / 2
	t.Logf("index entries read by a sweep of %d batches of %d: %d", res.Batches, batch, read)
	require.Less(t, read, steppedOver, "batches stepped over the entries of the rows the sweep had deleted")
}

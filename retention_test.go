package outbox_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/outboxtest"
)

const month = 31 * 24 * time.Hour

// insertOldEvents writes events 1..n of project "p" into the frozen stream of before schema
// 18, numbered and 40 days old (past the default retention window), and its head.
func insertOldEvents(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	ctx := testkit.Ctx(t)
	_, err := pool.Exec(ctx, `INSERT INTO lifecycle_outbox (project_id, sequence, event_type, task_id, deleted_at, archived, writer_process_id, payload_version, occurred_at)
		SELECT 'p', i, 'task:deleted', 'old-' || i, '2026-01-01T00:00:00Z', false, 'w', 1, now() - interval '40 days'
		FROM generate_series(1, $1) AS i`, n)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO lifecycle_outbox_heads (project_id, last_sequence) VALUES ('p', $1)`, n)
	require.NoError(t, err)
}

// outboxSequences lists the sequences of project's events still stored, as a consumer reads
// them: the frozen stream, then the log tick by tick.
func outboxSequences(t *testing.T, pool *pgxpool.Pool, project string) []int64 {
	t.Helper()
	var out []int64
	for _, e := range readStream(t, context.Background(), pool, project) {
		out = append(out, e.Sequence)
	}
	return out
}

// seedTickedDeletes writes n deletions in project p through a writer process and ticks after
// each, so that each is a part of its own tick (retention removes a tick's part whole).
func seedTickedDeletes(t *testing.T, ctx context.Context, url, p string, n int) *testkit.Process {
	t.Helper()
	w := testkit.StartProcess(t, url, testkit.ProcessOpts{Projects: []string{p}})
	_, err := w.Store.CreateMany(ctx, p, "t", n)
	require.NoError(t, err)
	for i := range n {
		_, err := w.Store.Delete(ctx, p, fmt.Sprintf("t-%d", i+1))
		require.NoError(t, err)
		_, err = outbox.Tick(ctx, w.Pool)
		require.NoError(t, err)
	}
	return w
}

func TestRetentionKeepsWhatAnyoneStillNeeds(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	clock := outboxtest.NewFakeClock()
	cfg := testkit.FastConfig()
	cfg.Clock = clock
	cfg.LeaseTTL = 24 * 365 * time.Hour // the fake clock jumps months; keep leases out of the way
	cfg.HeartbeatInterval = time.Hour

	w := seedTickedDeletes(t, ctx, db.URL, "p", 10)
	_, err := w.Store.CreateMany(ctx, "p", "live", 3)
	require.NoError(t, err)
	fast := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "fast", Projects: []string{"p"}, Config: cfg})
	testkit.WaitCursor(t, ctx, w.Pool, "p", "fast", 10)
	fast.Stop(t)
	// "slow" acknowledged 4 events and then went away.
	_, err = w.Pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence) VALUES ('p', 'slow', 4)`)
	require.NoError(t, err)

	r := testkit.NewRetention(t, w.Pool, cfg)
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
	require.Equal(t, testkit.Seq(5, 10), outboxSequences(t, w.Pool, "p"), "rows the slow consumer has not acknowledged stay")
	require.Equal(t, int64(4), testkit.FloorOf(t, w.Pool, "p"))

	admin := outbox.NewAdmin(w.Pool, outbox.AdminOptions{Audit: w.Store, Clock: clock})
	retired, err := admin.RetireConsumer(ctx, outbox.RetireRequest{ConsumerID: "slow", Operator: outbox.Operator{Actor: "oncall", Reason: "FN-77"}})
	require.NoError(t, err)
	require.Equal(t, []string{"p"}, retired)
	require.Equal(t, 1, pgtest.QueryInt(t, w.Pool, `SELECT count(*) FROM run_audit WHERE action = $1 AND actor = 'oncall'`, outbox.AuditConsumerRetired))
	res, err = r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(6), res.Pruned(), "retiring the laggard lets its rows go")
	require.Empty(t, outboxSequences(t, w.Pool, "p"))
	require.Equal(t, int64(10), testkit.FloorOf(t, w.Pool, "p"))

	// A retired identity cannot start again silently.
	slow := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "slow", Projects: []string{"p"}, Config: cfg, NoStart: true})
	require.ErrorIs(t, slow.Consumer.Start(ctx), outbox.ErrConsumerRetired)

	// Reinstated (audited), it finds its cursor below the pruned floor and reconciles: its
	// cache, which missed every deletion, ends up with exactly the live tasks.
	_, err = admin.ReinstateConsumer(ctx, outbox.RetireRequest{ConsumerID: "slow", Operator: outbox.Operator{Actor: "oncall", Reason: "FN-78"}})
	require.NoError(t, err)
	slow = testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "slow", Projects: []string{"p"}, Config: cfg, NoStart: true})
	stale := []string{"live-1", "live-2", "live-3"}
	for i := range 10 {
		stale = append(stale, fmt.Sprintf("t-%d", i+1))
	}
	require.NoError(t, slow.Store.Cache().ReplaceLive(ctx, "p", stale))
	slow.Start(t)
	testkit.WaitCursor(t, ctx, w.Pool, "p", "slow", 10)
	require.Equal(t, []string{"live-1", "live-2", "live-3"}, slow.Store.Cache().Live("p"), "no deletion lost across the pruned gap")
	require.Equal(t, "cursor_below_pruned_floor", queryString(t, w.Pool,
		`SELECT coalesce(reconcile_reason, '') FROM lifecycle_consumer_cursors WHERE project_id = 'p' AND consumer_id = 'slow'`),
		"reconciled because its cursor was below the floor the sweep raised")
	_, err = w.Store.Delete(ctx, "p", "live-2")
	require.NoError(t, err)
	evs := slow.Rec.WaitCount(t, ctx, 1)
	require.Equal(t, int64(11), evs[0].Sequence, "and it carries on with new events")
}

func TestRetentionOfDeadLetters(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	clock := outboxtest.NewFakeClock()
	cfg := testkit.FastConfig()
	cfg.Clock = clock
	cfg.MaxAttempts = 1
	cfg.LeaseTTL = 24 * 365 * time.Hour
	cfg.HeartbeatInterval = time.Hour

	w := seedTickedDeletes(t, ctx, db.URL, "p", 3)
	var fixed atomic.Bool
	broken := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "broken", Projects: []string{"p"}, Config: cfg, NoStart: true})
	broken.Rec.SetFail(func(ev outbox.ObservedEvent) error {
		if ev.Sequence <= 2 && !(fixed.Load() && ev.Sequence == 1) {
			return testkit.ErrListener
		}
		return nil
	})
	broken.Start(t)
	testkit.WaitCursor(t, ctx, w.Pool, "p", "broken", 3)
	fixed.Store(true)
	admin := outbox.NewAdmin(w.Pool, outbox.AdminOptions{Audit: w.Store, Clock: clock})
	_, err := admin.RequestReplay(ctx, outbox.ReplayRequest{ProjectID: "p", ConsumerID: "broken", Sequence: 1, Operator: outbox.Operator{Actor: "oncall", Reason: "FN-1"}})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return testkit.DeliveryOf(t, w.Pool, "broken", 1).State == "resolved" }, testkit.WaitLimit, 10*time.Millisecond)
	broken.Stop(t)

	r := testkit.NewRetention(t, w.Pool, cfg)
	res, err := r.Sweep(ctx)
	require.NoError(t, err)
	require.Zero(t, res.DeadLettersPruned, "a resolved dead letter is kept for the retention period")

	clock.Advance(month)
	res, err = r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), res.DeadLettersPruned, "the resolved one goes after 30 days")
	require.Equal(t, "dead", testkit.DeliveryOf(t, w.Pool, "broken", 2).State, "the unresolved one stays")
	require.Equal(t, []int64{2}, outboxSequences(t, w.Pool, "p"), "and so does the event it points at, for a replay")

	_, err = admin.RetireConsumer(ctx, outbox.RetireRequest{ConsumerID: "broken", Operator: outbox.Operator{Actor: "oncall", Reason: "decommissioned"}})
	require.NoError(t, err)
	res, err = r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(1), res.DeadLettersPruned, "retiring its consumer releases an unresolved dead letter")
	require.Empty(t, outboxSequences(t, w.Pool, "p"))
}

func TestRetentionWorksInBoundedBatchesBesideWriters(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
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

	r := testkit.NewRetention(t, pool, outbox.Config{RetentionBatchSize: 2000, RetentionBudget: 30000})
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
	require.Equal(t, testkit.Seq(old+1, old+deleted.Load()), outboxSequences(t, pool, "p"))
}

func TestPruneBatchDoesNotBlockTheDeleteTransaction(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
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

	// One prune batch, on a clock 40 days ahead, holds its locks, uncommitted.
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var n, maxSeq int64
	require.NoError(t, tx.QueryRow(ctx, outbox.PruneBatchSQL, pgx.StrictNamedArgs{"project": "p", "limit": 100, "after": 0,
		"clock_offset": 40 * 24 * time.Hour, "window": 30 * 24 * time.Hour}).Scan(&n, &maxSeq))
	require.Equal(t, int64(10), n)
	require.Equal(t, int64(10), maxSeq)

	// A delete in the same project commits meanwhile.
	deadline, cancel := context.WithTimeout(ctx, testkit.WaitLimit)
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
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	clock := outboxtest.NewFakeClock()
	w := seedTickedDeletes(t, ctx, db.URL, "p", 12)
	_, err := w.Pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence, retired_at, retired_by, retired_reason)
		VALUES ('p', 'fast', 12, NULL, NULL, NULL), ('p', 'gone', 2, now(), 'oncall', 'FN-1')`)
	require.NoError(t, err)
	clock.Advance(month)

	r := testkit.NewRetention(t, w.Pool, outbox.Config{Clock: clock, RetentionBatchSize: 2})
	batches := 0
	outbox.BeforePruneBatch(r, func(project string) {
		batches++
		switch batches {
		case 2: // after 1-2 went: a new consumer appears at 5
			_, err := w.Pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence) VALUES ('p', 'late', 5)`)
			require.NoError(t, err)
		case 3: // after 3-4 went: the retired one at 2 is reinstated
			_, err := w.Pool.Exec(ctx, `UPDATE lifecycle_consumer_cursors SET retired_at = NULL, retired_by = NULL, retired_reason = NULL WHERE consumer_id = 'gone'`)
			require.NoError(t, err)
		}
	})
	res, err := r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, testkit.Seq(5, 12), outboxSequences(t, w.Pool, "p"), "nothing above a cursor that existed when its batch ran")
	require.Equal(t, int64(4), res.Pruned())
	require.Equal(t, int64(4), testkit.FloorOf(t, w.Pool, "p"))
}

// TestSweepPrunesOtherProjectsWhenOneFails: a project whose heads row another role holds
// (the threat model lets a consumer of that project do so) times out on its lock; the sweep
// still prunes every other project and returns a *ProjectErrors naming the one it skipped.
func TestSweepPrunesOtherProjectsWhenOneFails(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	testkit.SeedEvents(t, pool, "a", 5)
	testkit.SeedEvents(t, pool, "b", 5)
	clock := outboxtest.NewFakeClock()
	clock.Advance(2 * time.Hour)
	holder, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `SELECT 1 FROM lifecycle_outbox_heads WHERE project_id = 'a' FOR UPDATE`)
	require.NoError(t, err)

	r := testkit.NewRetention(t, pool, outbox.Config{RetentionWindow: time.Hour, LockTimeout: 100 * time.Millisecond, Clock: clock})
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
	ctx := testkit.Ctx(t)
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
	res, err := testkit.NewRetention(t, pool, outbox.Config{RetentionBatchSize: batch, RetentionBudget: rows}).Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(rows), res.Pruned())
	read := entriesRead() - before
	// Batch k stepping over the k-1 batches deleted before it: batch * B(B+1)/2 entries in all
	// (6,300 read in this test when every batch started from the bottom; 2,500 now).
	steppedOver := batch * res.Batches * (res.Batches + 1) / 2
	t.Logf("index entries read by a sweep of %d batches of %d: %d", res.Batches, batch, read)
	require.Less(t, read, steppedOver, "batches stepped over the entries of the rows the sweep had deleted")
}

// logEvents commits n events of project into the event log in one transaction, with task IDs
// prefix-1 .. prefix-n in that order.
func logEvents(t *testing.T, db outbox.DBTX, project, prefix string, n int) {
	t.Helper()
	_, err := db.Exec(testkit.Ctx(t), `
INSERT INTO lifecycle_event_log (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
SELECT $1, $2 || '-' || g, timestamptz '2030-01-01' + g * interval '1 second', 'task:deleted', false, 1, clock_timestamp(), 'writer-0123456789abcdef'
FROM generate_series(1, $3) g`, project, prefix, n)
	require.NoError(t, err)
}

// tickNow takes one tick and returns its ID.
func tickNow(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	res, err := outbox.Tick(testkit.Ctx(t), pool)
	require.NoError(t, err)
	require.Equal(t, 1, res.Ticks)
	return res.TickID
}

// tickIDs lists the stored ticks.
func tickIDs(t *testing.T, pool *pgxpool.Pool) []int64 {
	t.Helper()
	rows, err := pool.Query(testkit.Ctx(t), `SELECT tick_id FROM lifecycle_tick ORDER BY tick_id`)
	require.NoError(t, err)
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	return ids
}

// planOf is the plan of project among plans.
func planOf(t *testing.T, plans []outbox.PrunePlan, project string) outbox.PrunePlan {
	t.Helper()
	for _, p := range plans {
		if p.ProjectID == project {
			return p
		}
	}
	t.Fatalf("no plan for project %s in %+v", project, plans)
	return outbox.PrunePlan{}
}

// TestRetentionKeepsAPartACursorIsInside: an event's sequence is its rank in its project's part
// of its tick, so a part goes whole or not at all, and a live cursor inside a part keeps all of
// it: no event above a live cursor is ever removed.
func TestRetentionKeepsAPartACursorIsInside(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	for _, prefix := range []string{"a", "b", "c"} { // parts 1-3, 4-6 and 7-9
		logEvents(t, pool, "p", prefix, 3)
		tickNow(t, pool)
	}
	_, err := pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence) VALUES ('p', 'c', 5)`)
	require.NoError(t, err)
	clock := outboxtest.NewFakeClock()
	clock.Advance(month)
	r := testkit.NewRetention(t, pool, outbox.Config{Clock: clock})

	plans, err := r.Plan(ctx)
	require.NoError(t, err)
	require.Equal(t, []outbox.PrunePlan{{ProjectID: "p", Head: 9, Through: 5, Prunable: 3, HeldBy: "c"}}, plans)
	res, err := r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"p": 3}, res.PrunedByProject, "the plan and the sweep agree")
	require.Equal(t, testkit.Seq(4, 9), outboxSequences(t, pool, "p"), "the part holding the cursor stays whole, with 6 above the cursor")
	require.Equal(t, int64(3), testkit.FloorOf(t, pool, "p"))

	// Acknowledged to the end of the part, the part goes.
	_, err = pool.Exec(ctx, `UPDATE lifecycle_consumer_cursors SET last_acked_sequence = 6 WHERE consumer_id = 'c'`)
	require.NoError(t, err)
	plans, err = r.Plan(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(3), planOf(t, plans, "p").Prunable)
	res, err = r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"p": 3}, res.PrunedByProject)
	require.Equal(t, testkit.Seq(7, 9), outboxSequences(t, pool, "p"))
	require.Equal(t, int64(6), testkit.FloorOf(t, pool, "p"))
}

// TestRetentionRemovesAPartWholeAndTheRestKeepTheirSequences: parts of several events, one of
// them holding the event of a transaction that was still open at the tick before (its batch
// takes it from the transactions that tick saw open), a part a dead letter points into, and
// another project's parts in the same ticks. Pruning with batches smaller than a part removes
// every event of each part it takes and its count, leaves no event of another tick or project,
// and every remaining event reads with the sequence it had before.
func TestRetentionRemovesAPartWholeAndTheRestKeepTheirSequences(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)

	late, err := pool.Begin(ctx) // open across tick 2; its event is numbered by tick 3
	require.NoError(t, err)
	defer func() { _ = late.Rollback(ctx) }()
	logEvents(t, late, "p", "late", 1)
	logEvents(t, pool, "p", "a", 2)
	logEvents(t, pool, "q", "qa", 1)
	require.Equal(t, int64(2), tickNow(t, pool))
	require.NoError(t, late.Commit(ctx))
	logEvents(t, pool, "p", "b", 2)
	logEvents(t, pool, "q", "qb", 1)
	require.Equal(t, int64(3), tickNow(t, pool))
	logEvents(t, pool, "p", "c", 3)
	tickNow(t, pool)
	logEvents(t, pool, "p", "d", 1)
	tickNow(t, pool)

	before := readStream(t, context.Background(), pool, "p")
	require.Equal(t, []streamEvent{{1, "a-1"}, {2, "a-2"}, {3, "late-1"}, {4, "b-1"}, {5, "b-2"},
		{6, "c-1"}, {7, "c-2"}, {8, "c-3"}, {9, "d-1"}}, before)
	beforeQ := readStream(t, context.Background(), pool, "q")
	require.Len(t, beforeQ, 2)

	// p's consumer acknowledged everything but holds a dead letter at 4, inside tick 3's part;
	// q's has not read yet.
	_, err = pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence) VALUES ('p', 'c', 9), ('q', 'c', NULL)`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO lifecycle_consumer_deliveries (project_id, consumer_id, sequence, event_id, state, attempts, parked_at)
		VALUES ('p', 'c', 4, 'x', 'dead', 1, now())`)
	require.NoError(t, err)

	clock := outboxtest.NewFakeClock()
	clock.Advance(month)
	r := testkit.NewRetention(t, pool, outbox.Config{Clock: clock, RetentionBatchSize: 2})
	plans, err := r.Plan(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(6), planOf(t, plans, "p").Prunable)
	res, err := r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"p": 6}, res.PrunedByProject, "parts of 2, 3 and 1 events in batches of 2: none split")
	require.Equal(t, before[2:5], readStream(t, context.Background(), pool, "p"), "the held part keeps its events and their sequences")
	require.Equal(t, beforeQ, readStream(t, context.Background(), pool, "q"), "the other project's events in the same ticks stay")
	require.Equal(t, int64(9), testkit.FloorOf(t, pool, "p"))
	storedMatchCounted := func(project string) int {
		t.Helper()
		stored := pgtest.QueryInt(t, pool, `SELECT count(*)::int FROM lifecycle_event_log WHERE project_id = $1`, project)
		counted := pgtest.QueryInt(t, pool, `SELECT coalesce(sum(events), 0)::int FROM lifecycle_tick_project WHERE project_id = $1`, project)
		require.Equal(t, counted, stored, "the log holds exactly the events its remaining parts count in %s", project)
		return stored
	}
	require.Equal(t, 3, storedMatchCounted("p"))
	require.Equal(t, 2, storedMatchCounted("q"))

	// Resolved, the dead letter lets its part go: all of it, the late transaction's event too.
	_, err = pool.Exec(ctx, `UPDATE lifecycle_consumer_deliveries SET state = 'resolved', resolved_at = now() WHERE project_id = 'p'`)
	require.NoError(t, err)
	res, err = r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"p": 3}, res.PrunedByProject)
	require.Empty(t, readStream(t, context.Background(), pool, "p"))
	require.Zero(t, storedMatchCounted("p"))
	require.Equal(t, beforeQ, readStream(t, context.Background(), pool, "q"))
	require.Equal(t, int64(9), testkit.FloorOf(t, pool, "p"), "the floor never goes back")
}

// TestRetentionDeletesTheTicksNoPartNeeds: reading a part needs its tick and the one before;
// the ticks below those of the oldest remaining part go, a bounded number per call, and the
// newest always stays, since the ticker takes the next batch from it.
func TestRetentionDeletesTheTicksNoPartNeeds(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	for i := range 5 { // p's parts at ticks 2 to 6, q's at tick 4
		logEvents(t, pool, "p", fmt.Sprintf("p%d", i), 1)
		if i == 2 {
			logEvents(t, pool, "q", "q", 1)
		}
		tickNow(t, pool)
	}
	require.Equal(t, testkit.Seq(1, 6), tickIDs(t, pool))
	_, err := pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence) VALUES ('q', 'c', NULL)`)
	require.NoError(t, err)

	clock := outboxtest.NewFakeClock()
	clock.Advance(month)
	r := testkit.NewRetention(t, pool, outbox.Config{Clock: clock})
	res, err := r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"p": 5}, res.PrunedByProject)
	require.Equal(t, testkit.Seq(3, 6), tickIDs(t, pool), "q's part at tick 4 keeps ticks 3 and 4; the newest stays")
	require.Equal(t, []streamEvent{{1, "q-1"}}, readStream(t, context.Background(), pool, "q"))

	// Its consumer retired, q's part goes; one call deletes at most its limit of ticks.
	_, err = pool.Exec(ctx, `UPDATE lifecycle_consumer_cursors SET retired_at = now(), retired_by = 'oncall', retired_reason = 'FN-1'`)
	require.NoError(t, err)
	var n, maxSeq int64
	require.NoError(t, pool.QueryRow(ctx, outbox.PruneBatchSQL, pgx.StrictNamedArgs{"project": "q", "limit": 1, "after": 0,
		"clock_offset": month, "window": 30 * 24 * time.Hour}).Scan(&n, &maxSeq))
	require.Equal(t, []int64{1, 1}, []int64{n, maxSeq})
	require.Equal(t, testkit.Seq(4, 6), tickIDs(t, pool), "one tick for a limit of one")
	_, err = r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, []int64{6}, tickIDs(t, pool), "no part left: only the newest tick stays")

	// The ticker goes on from the tick kept, and the stream from the head.
	logEvents(t, pool, "p", "new", 1)
	require.Equal(t, int64(7), tickNow(t, pool))
	require.Equal(t, []streamEvent{{6, "new-1"}}, readStream(t, context.Background(), pool, "p"))
	require.Equal(t, []int64{6, 7}, tickIDs(t, pool))
}

// TestRetentionDoesNotWaitForTheTicker: deleting ticks conflicts with the ticker's lock on the
// tick table. A sweep that finds the ticker holding it prunes the events all the same and
// leaves the ticks to a later call, instead of waiting (and holding the ticker back behind it,
// or deadlocking with a ticker that waits for the heads row the sweep updated).
func TestRetentionDoesNotWaitForTheTicker(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	for _, prefix := range []string{"a", "b"} {
		logEvents(t, pool, "p", prefix, 1)
		tickNow(t, pool)
	}
	clock := outboxtest.NewFakeClock()
	clock.Advance(month)
	r := testkit.NewRetention(t, pool, outbox.Config{Clock: clock, LockTimeout: time.Minute, StatementTimeout: time.Minute})

	ticker, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = ticker.Rollback(ctx) }()
	_, err = ticker.Exec(ctx, `LOCK TABLE lifecycle_tick IN SHARE ROW EXCLUSIVE MODE`)
	require.NoError(t, err)
	sweepCtx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	res, err := r.Sweep(sweepCtx)
	require.NoError(t, err, "the sweep waited for the ticker's lock")
	require.Equal(t, map[string]int64{"p": 2}, res.PrunedByProject)
	require.Equal(t, testkit.Seq(1, 3), tickIDs(t, pool), "the ticks wait for a call that finds the table free")

	require.NoError(t, ticker.Rollback(ctx))
	_, err = r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, []int64{3}, tickIDs(t, pool))
}

// TestStreamReadsFromBelowThePrunedFloor: once the oldest parts are gone, a read that starts
// below the first stored part (the event stream's replay reads pages from aligned starts, a
// tool reads from 0) returns every stored event with its sequence, not just the first part.
func TestStreamReadsFromBelowThePrunedFloor(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	for _, prefix := range []string{"a", "b", "c", "d"} { // parts 1-2, 3-4, 5-6, 7-8
		logEvents(t, pool, "p", prefix, 2)
		tickNow(t, pool)
	}
	_, err := pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence) VALUES ('p', 'c', 4)`)
	require.NoError(t, err)
	clock := outboxtest.NewFakeClock()
	clock.Advance(month)
	_, err = testkit.NewRetention(t, pool, outbox.Config{Clock: clock}).Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(4), testkit.FloorOf(t, pool, "p"))
	for _, after := range []int64{0, 2, 4} {
		rows, err := pool.Query(ctx, `SELECT sequence FROM lifecycle_outbox_read('p', $1, 100, NULL, NULL, NULL)`, after)
		require.NoError(t, err)
		got, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		require.NoError(t, err)
		require.Equal(t, testkit.Seq(5, 8), got, "read after %d", after)
	}
}

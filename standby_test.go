package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/outboxtest"
)

// TestStandbyReads runs consumers that read from a real streaming hot standby (Config.ReadDSN).
// The subtests share one primary and standby pair (two server starts and a base backup) and
// run in order: the last one promotes the standby.
func TestStandbyReads(t *testing.T) {
	t.Parallel()
	pair := pgtest.StartPair(t)
	t.Run("DeliversEveryEventOnceInOrder", func(t *testing.T) { testStandbyDeliversInOrder(t, pair) })
	t.Run("PausedReplayIsWaitedForThenLeft", func(t *testing.T) { testStandbyPausedReplay(t, pair) })
	t.Run("WokenScanWaitsThenStartsWithItsTicks", func(t *testing.T) { testStandbyWokenScanWaits(t, pair) })
	t.Run("RecoveryConflictIsRetried", func(t *testing.T) { testStandbyRecoveryConflict(t, pair) })
	t.Run("NotifiedScansSendThePrimaryNothing", func(t *testing.T) { testStandbyScansLeaveThePrimary(t, pair) })
	t.Run("ForgedTickAnnouncementIsChecked", func(t *testing.T) { testStandbyForgedTick(t, pair) })
	t.Run("KilledStandby", func(t *testing.T) { testStandbyKilled(t, pair) })
	t.Run("Promotion", func(t *testing.T) { testStandbyPromoted(t, pair) }) // last: the pair is gone after it
}

var standbyProjects = []string{"alpha", "beta", "gamma"}

// standbyWriter starts a writer-only process on the pair's primary with n tasks in each
// project, t-1 .. t-n.
func standbyWriter(t *testing.T, url string, n int) *testkit.Process {
	t.Helper()
	w := testkit.StartProcess(t, url, testkit.ProcessOpts{Projects: standbyProjects})
	for _, p := range standbyProjects {
		_, err := w.Store.CreateMany(testkit.Ctx(t), p, "t", n)
		require.NoError(t, err)
	}
	return w
}

// deleteRound deletes task t-i of every project, for i in [from, to].
func deleteRound(t *testing.T, w *testkit.Process, from, to int) {
	t.Helper()
	for i := from; i <= to; i++ {
		for _, p := range standbyProjects {
			_, err := w.Store.Delete(testkit.Ctx(t), p, fmt.Sprintf("t-%d", i))
			require.NoError(t, err)
		}
	}
}

// requireInOrder checks that evs hold, for each project, the sequences 1..n exactly once and in
// order.
func requireInOrder(t *testing.T, evs []outbox.ObservedEvent, n int) {
	t.Helper()
	next := map[string]int64{}
	for _, ev := range evs {
		require.Equal(t, next[ev.ProjectID]+1, ev.Sequence, "project %s: events once, in order", ev.ProjectID)
		next[ev.ProjectID] = ev.Sequence
	}
	for _, p := range standbyProjects {
		require.EqualValues(t, n, next[p], "project %s: every event", p)
	}
}

// readCalls counts the calls of the module's readers on a server's database (track_functions).
func readCalls(t *testing.T, url string) int {
	t.Helper()
	pool := pgtest.Pool(t, url)
	defer pool.Close()
	return pgtest.QueryInt(t, pool, `SELECT coalesce(sum(calls), 0)::int FROM pg_stat_user_functions
WHERE funcname IN ('lifecycle_outbox_read', 'lifecycle_outbox_read_parts', 'lifecycle_outbox_read_ticks')`)
}

// requireCursorsWithin checks that no cursor of consumer on pool passes what rec delivered.
func requireCursorsWithin(t *testing.T, pool *pgxpool.Pool, consumer string, rec *testkit.Recorder) {
	t.Helper()
	delivered := map[string]int64{}
	for _, ev := range rec.Snapshot() {
		delivered[ev.ProjectID] = max(delivered[ev.ProjectID], ev.Sequence)
	}
	for _, p := range standbyProjects {
		require.LessOrEqual(t, testkit.CursorOf(t, pool, p, consumer), delivered[p], "project %s: the cursor never passes what was delivered", p)
	}
}

func testStandbyDeliversInOrder(t *testing.T, pair *pgtest.Pair) {
	ctx := testkit.Ctx(t)
	db := pair.NewDB(t)
	w := standbyWriter(t, db.URL, 40)
	cfg := testkit.FastConfig()
	cfg.ReadDSN = db.StandbyURL
	c := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "standby-reader", Projects: standbyProjects, Config: cfg})
	// A second consumer of the same process reads through the same standby pool.
	c2, rec2 := startConsumer(t, c.Pool, "standby-reader-2", standbyProjects, cfg, nil)
	require.Equal(t, 2, outbox.StandbyPoolUsers(db.StandbyURL), "one standby pool for the process's consumers")
	deleteRound(t, w, 1, 20)
	c.Rec.WaitCount(t, ctx, 60)
	deleteRound(t, w, 21, 40)
	requireInOrder(t, c.Rec.WaitCount(t, ctx, 120), 40)
	requireInOrder(t, rec2.WaitCount(t, ctx, 120), 40)
	for _, st := range []outbox.Stats{c.Consumer.Stats(), c2.Stats()} {
		require.True(t, st.ReadingFromStandby)
		require.Zero(t, st.ReadFallbacks, "the standby kept up")
		require.Zero(t, st.Failures)
	}
	t.Logf("reads shared on the standby: %d", c.Consumer.Stats().SharedReads+c2.Stats().SharedReads)
	stopConsumer(t, c2)
	require.Equal(t, 1, outbox.StandbyPoolUsers(db.StandbyURL), "a stopped consumer gives the pool back")
	// The events came from the standby: its readers were called, the primary's never.
	require.Eventually(t, func() bool { return readCalls(t, db.StandbyURL) > 0 }, testkit.WaitLimit, 50*time.Millisecond,
		"the standby served the reads")
	require.Zero(t, readCalls(t, db.URL), "the primary served no read")
	requireCursorsWithin(t, c.Pool, "standby-reader", c.Rec)
	requireCursorsWithin(t, c.Pool, "standby-reader-2", rec2)
}

func testStandbyPausedReplay(t *testing.T, pair *pgtest.Pair) {
	ctx := testkit.Ctx(t)
	db := pair.NewDB(t)
	w := standbyWriter(t, db.URL, 60)
	clock := outboxtest.NewFakeClock()
	cfg := metricsConfig() // LeaseTTL 30s: advancing the clock by ReadMaxLag keeps the leases
	cfg.Clock = clock
	cfg.ReadDSN = db.StandbyURL
	cfg.ReadMaxLag = 7 * time.Second
	// Scans start on notifications only: what is delivered while replay is paused was woken
	// by a tick's notification and waited for, not found by a poll.
	cfg.PollInterval = time.Hour
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	require.NoError(t, err)
	c := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "paused-reader", Projects: standbyProjects, Config: cfg, Metrics: m})
	deleteRound(t, w, 1, 10)
	c.Rec.WaitCount(t, ctx, 30)

	pair.PauseReplay(t)
	deleteRound(t, w, 11, 20)
	// The notified scan waits for the standby to replay the tick, on the consumer's clock.
	_, err = clock.WaitForTimer(ctx, cfg.ReadMaxLag)
	require.NoError(t, err)
	st := c.Consumer.Stats()
	require.True(t, st.StandbyWaiting)
	require.Positive(t, st.StandbyLagTicks)
	require.Len(t, c.Rec.Snapshot(), 30, "nothing delivered past what the standby has")
	requireCursorsWithin(t, c.Pool, "paused-reader", c.Rec)

	lag, err := outbox.CompareStandby(ctx, c.Pool, pgtest.Pool(t, db.StandbyURL))
	require.NoError(t, err)
	require.Positive(t, lag.Ticks, "the figures outboxctl status shows")
	require.True(t, lag.InRecovery)
	require.Less(t, lag.StandbyTick, lag.PrimaryTick)

	clock.Advance(cfg.ReadMaxLag) // the wait runs out: the scan reads from the primary
	requireInOrder(t, c.Rec.WaitCount(t, ctx, 60), 20)
	st = c.Consumer.Stats()
	require.EqualValues(t, 1, st.ReadFallbacks)
	require.False(t, st.ReadingFromStandby)
	require.Zero(t, st.ReadReturns)
	requireCursorsWithin(t, c.Pool, "paused-reader", c.Rec)

	deleteRound(t, w, 21, 25) // still paused: read from the primary, without waiting
	requireInOrder(t, c.Rec.WaitCount(t, ctx, 75), 25)
	require.Equal(t, st.StandbyWaits, c.Consumer.Stats().StandbyWaits, "a fallen-back consumer does not wait")

	pair.ResumeReplay(t)
	require.NoError(t, pair.WaitReplayed(t))
	// The next scans probe the standby, find it caught up, and read from it again. A probe
	// races the tick that woke its scan to the standby, so it may take a few.
	for i := 26; c.Consumer.Stats().ReadReturns == 0; i++ {
		require.LessOrEqual(t, i, 55, "the consumer went back to the standby")
		deleteRound(t, w, i, i)
		c.Rec.WaitCount(t, ctx, 3*i)
	}
	st = c.Consumer.Stats()
	require.True(t, st.ReadingFromStandby)
	require.EqualValues(t, 1, st.ReadReturns)
	require.Zero(t, st.StandbyLagTicks)
	require.NoError(t, pair.WaitReplayed(t))
	lag, err = outbox.CompareStandby(ctx, c.Pool, pgtest.Pool(t, db.StandbyURL))
	require.NoError(t, err)
	require.Zero(t, lag.Ticks)
	require.Zero(t, lag.Lag)
	n := len(c.Rec.Snapshot()) / 3
	deleteRound(t, w, n+1, 60)
	requireInOrder(t, c.Rec.WaitCount(t, ctx, 180), 60)
	require.Zero(t, c.Consumer.Stats().Failures)
	requireCursorsWithin(t, c.Pool, "paused-reader", c.Rec)

	fams := scrape(t, reg)
	require.Contains(t, fams, "outbox_read_fallbacks_total")
	require.EqualValues(t, 1, fams["outbox_read_fallbacks_total"].GetMetric()[0].GetCounter().GetValue())
	require.Equal(t, "lag", labelValue(fams["outbox_read_fallbacks_total"].GetMetric()[0], "reason"))
	require.EqualValues(t, 1, fams["outbox_read_returns_total"].GetMetric()[0].GetCounter().GetValue())
	require.Zero(t, fams["outbox_read_standby_lag_ticks"].GetMetric()[0].GetGauge().GetValue())
}

// testStandbyWokenScanWaits: a scan woken by a tick the standby has not replayed yet (replay
// paused; a notification usually comes before the replay) waits for it, and then starts with
// its ticks on the standby all the same: no read of heads, no fallback.
func testStandbyWokenScanWaits(t *testing.T, pair *pgtest.Pair) {
	ctx := testkit.Ctx(t)
	db := pair.NewDB(t)
	w := standbyWriter(t, db.URL, 10)
	cfg := metricsConfig()
	// The wait must not run out: ReadMaxLag on a clock that does not move. Notified scans only.
	cfg.Clock, cfg.ReadDSN, cfg.ReadMaxLag = outboxtest.NewFakeClock(), db.StandbyURL, 10*time.Minute
	cfg.PollInterval, cfg.TickFallbackInterval = time.Hour, time.Hour
	c := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "waiting-reader", Projects: standbyProjects, Config: cfg})
	deleteRound(t, w, 1, 5)
	c.Rec.WaitCount(t, ctx, 15)

	pair.PauseReplay(t)
	deleteRound(t, w, 6, 6)
	require.Eventually(t, func() bool { return c.Consumer.Stats().StandbyWaiting }, testkit.WaitLimit, 5*time.Millisecond,
		"the woken scan waits for the standby")
	before := c.Consumer.Stats()
	require.Len(t, c.Rec.Snapshot(), 15, "nothing delivered past what the standby has")
	pair.ResumeReplay(t)
	requireInOrder(t, c.Rec.WaitCount(t, ctx, 18), 6)
	st := c.Consumer.Stats()
	require.Greater(t, st.TickStarts, before.TickStarts, "the scan that waited started with its ticks")
	require.Zero(t, st.ReadFallbacks)
	require.True(t, st.ReadingFromStandby)
	require.Zero(t, st.StandbyLagTicks)
	requireCursorsWithin(t, c.Pool, "waiting-reader", c.Rec)
}

// testStandbyRecoveryConflict: replay cancels a consumer's read on the standby for a conflict
// with recovery; the read is tried again and the events are delivered, none counted as failed.
// The conflict is made without races: the primary holds exclusive locks on the tables the
// scan's first read on the standby takes after lifecycle_tick (lifecycle_outbox_heads for a
// read of heads, lifecycle_tick_project for a scan that starts with its ticks), so the read,
// started by a notification, waits on the standby for replay while holding its lock on
// lifecycle_tick; then the primary locks lifecycle_tick exclusively, and replay, which must take
// that lock, cancels the read after max_standby_streaming_delay.
func testStandbyRecoveryConflict(t *testing.T, pair *pgtest.Pair) {
	ctx := testkit.Ctx(t)
	db := pair.NewDB(t)
	w := standbyWriter(t, db.URL, 20)
	cfg := testkit.FastConfig()
	cfg.ReadDSN = db.StandbyURL
	// No poll and no idle tick while the lock is held: the one scan is the notified one, and
	// the ticker does not queue behind the lock (it would hold the primary's tick table).
	cfg.PollInterval = time.Hour
	c := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "conflict-reader", Projects: standbyProjects, Config: cfg})
	deleteRound(t, w, 1, 5)
	c.Rec.WaitCount(t, ctx, 15)

	standbyAdmin := pgtest.Pool(t, pair.Standby.URL("postgres"))
	_, err := standbyAdmin.Exec(ctx, `ALTER SYSTEM SET max_standby_streaming_delay = '50ms'`)
	require.NoError(t, err)
	_, err = standbyAdmin.Exec(ctx, `SELECT pg_reload_conf()`)
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_, _ = standbyAdmin.Exec(ctx, `ALTER SYSTEM RESET max_standby_streaming_delay`)
		_, _ = standbyAdmin.Exec(ctx, `SELECT pg_reload_conf()`)
	})

	primary := pgtest.Pool(t, db.URL)
	hold, err := primary.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = hold.Rollback(context.Background()) }()
	_, err = hold.Exec(ctx, `LOCK TABLE lifecycle_outbox_heads, lifecycle_tick_project IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	require.NoError(t, pair.WaitReplayed(t)) // the standby's startup process holds it too

	_, err = primary.Exec(ctx, `SELECT pg_notify($1, 'alpha')`, cfg.WithDefaults().TickChannel)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		return pgtest.QueryInt(t, standbyAdmin, `SELECT count(*)::int FROM pg_stat_activity
WHERE datname = $1 AND wait_event_type = 'Lock'`, db.Name) > 0
	}, testkit.WaitLimit, 5*time.Millisecond, "the consumer's read of heads waits on the standby for replay's lock")

	_, err = primary.Exec(ctx, `BEGIN; LOCK TABLE lifecycle_tick IN ACCESS EXCLUSIVE MODE; COMMIT`)
	require.NoError(t, err)
	require.Eventually(t, func() bool { return c.Consumer.Stats().ReadConflicts > 0 }, testkit.WaitLimit, 5*time.Millisecond,
		"replay cancelled the read")
	require.NoError(t, hold.Commit(ctx))

	deleteRound(t, w, 6, 20)
	requireInOrder(t, c.Rec.WaitCount(t, ctx, 60), 20)
	st := c.Consumer.Stats()
	require.Zero(t, st.Failures, "a cancelled read is no failure of an event")
	require.Zero(t, st.ReadFallbacks, "nor a reason to leave the standby")
	// The cancelled backend reports the conflict when it next flushes its statistics, which an
	// idle backend may put off for up to 10s (PostgreSQL 15's PGSTAT_IDLE_INTERVAL).
	require.Eventually(t, func() bool {
		return pgtest.QueryInt(t, standbyAdmin, `SELECT (confl_lock + confl_deadlock)::int FROM pg_stat_database_conflicts
WHERE datname = $1`, db.Name) > 0
	}, testkit.WaitLimit, 50*time.Millisecond, "the standby counts the conflict")
	requireCursorsWithin(t, c.Pool, "conflict-reader", c.Rec)
}

// testStandbyScansLeaveThePrimary: the scans a consumer reading from the standby makes on the
// ticker's notifications send the primary no statement: they wait for the tick the
// notifications announce, not for one read there, and know their open deliveries. Only an
// announced tick the standby had not replayed within its grace is checked there (counted).
func testStandbyScansLeaveThePrimary(t *testing.T, pair *pgtest.Pair) {
	ctx := testkit.Ctx(t)
	db := pair.NewDB(t)
	w := standbyWriter(t, db.URL, 20)
	cfg := testkit.FastConfig()
	cfg.ReadDSN = db.StandbyURL
	// Notified scans only: no poll, no periodic read of open deliveries within the test.
	cfg.PollInterval, cfg.TickFallbackInterval = time.Hour, time.Hour
	ctr := newStmtCounter()
	c, rec := startConsumer(t, countedPool(t, db.URL, ctr), "quiet-reader", standbyProjects, cfg, nil)
	deleteRound(t, w, 1, 2)
	rec.WaitCount(t, ctx, 6)

	before, scans, checks, starts := ctr.counts(), c.Stats().Scans, c.Stats().TickChecks, c.Stats().TickStarts
	deleteRound(t, w, 3, 20)
	requireInOrder(t, rec.WaitCount(t, ctx, 60), 20)
	got := ctr.since(before)
	st := c.Stats()
	t.Logf("%d scans, %d started with their ticks on the standby; statements on the primary: %v", st.Scans-scans, st.TickStarts-starts, got)
	require.Greater(t, st.Scans, scans)
	// A scan woken once the standby has replayed its tick starts with one statement there
	// (startByTick); one woken earlier reads heads and waits. Both are timing, so only some.
	require.Greater(t, st.TickStarts, starts, "woken scans on the standby start with their ticks")
	for _, name := range []string{"loopHeadsSQL", "openDeliveriesSQL", "openWithTickSQL", "readEventsSQL", "readFirstEventsSQL", "readTicksSQL", "readTicksSinceSQL"} {
		require.Zero(t, got[name], "%s on the primary", name)
	}
	require.EqualValues(t, st.TickChecks-checks, got["newestTickSQL"], "the primary's tick is read only to check an announcement")
	require.Zero(t, st.ReadFallbacks)
	requireCursorsWithin(t, pgtest.Pool(t, db.URL), "quiet-reader", rec)
}

// testStandbyForgedTick: a tick announced on the tick channel that the primary does not have
// (anyone who may connect can send one) makes the scan it starts check the primary's newest
// tick once the standby has not replayed it within its grace, and read from the standby: no
// wait for ReadMaxLag (an hour of a clock that does not move here), no fallback.
func testStandbyForgedTick(t *testing.T, pair *pgtest.Pair) {
	ctx := testkit.Ctx(t)
	db := pair.NewDB(t)
	w := standbyWriter(t, db.URL, 10)
	clock := outboxtest.NewFakeClock()
	cfg := metricsConfig()
	cfg.Clock, cfg.ReadDSN, cfg.ReadMaxLag = clock, db.StandbyURL, 10*time.Minute
	c := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "forged-reader", Projects: standbyProjects, Config: cfg})
	deleteRound(t, w, 1, 5)
	c.Rec.WaitCount(t, ctx, 15)

	checks := c.Consumer.Stats().TickChecks
	primary := pgtest.Pool(t, db.URL)
	channel := cfg.WithDefaults().TickChannel
	_, err := primary.Exec(ctx, `SELECT pg_notify($1, 'tick/999999999'), pg_notify($1, 'alpha')`, channel)
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		st := c.Consumer.Stats()
		return st.TickChecks > checks && !st.StandbyWaiting
	}, testkit.WaitLimit, 5*time.Millisecond, "the forged tick was checked on the primary, and the scan went on")
	st := c.Consumer.Stats()
	require.Zero(t, st.ReadFallbacks, "a forged announcement is no reason to leave the standby")
	require.True(t, st.ReadingFromStandby)

	deleteRound(t, w, 6, 10)
	requireInOrder(t, c.Rec.WaitCount(t, ctx, 30), 10)
	require.Zero(t, c.Consumer.Stats().ReadFallbacks)
	requireCursorsWithin(t, c.Pool, "forged-reader", c.Rec)
}

func testStandbyKilled(t *testing.T, pair *pgtest.Pair) {
	ctx := testkit.Ctx(t)
	db := pair.NewDB(t)
	w := standbyWriter(t, db.URL, 60)
	cfg := testkit.FastConfig()
	cfg.ReadDSN = db.StandbyURL
	// How soon an unreachable standby is probed again, and how long a connection to it may
	// take: at 100 ms, a connection that took longer on a busy machine left the standby once
	// before it was killed (ReadFallbacks 2 where the kill makes 1).
	cfg.ReadMaxLag = time.Second
	c := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "killed-reader", Projects: standbyProjects, Config: cfg})
	deleteRound(t, w, 1, 10)
	c.Rec.WaitCount(t, ctx, 30)

	require.NoError(t, pair.Standby.Kill(ctx))
	t.Cleanup(func() {
		if pair.Standby.IsStandby() {
			_ = pair.Standby.StartServer(context.Background())
		}
	})
	deleteRound(t, w, 11, 20) // delivered from the primary
	requireInOrder(t, c.Rec.WaitCount(t, ctx, 60), 20)
	st := c.Consumer.Stats()
	require.EqualValues(t, 1, st.ReadFallbacks)
	require.False(t, st.ReadingFromStandby)

	require.NoError(t, pair.Standby.StartServer(ctx))
	require.NoError(t, pair.WaitReplayed(t))
	for i := 21; c.Consumer.Stats().ReadReturns == 0; i++ {
		require.LessOrEqual(t, i, 55, "the consumer went back to the standby")
		deleteRound(t, w, i, i)
		c.Rec.WaitCount(t, ctx, 3*i)
		if c.Consumer.Stats().ReadReturns == 0 {
			// An unreachable standby is probed again ReadMaxLag after it failed, on the real
			// clock: this is that interval passing, not a wait for something to happen.
			time.Sleep(cfg.ReadMaxLag)
		}
	}
	n := len(c.Rec.Snapshot()) / 3
	deleteRound(t, w, n+1, 60)
	requireInOrder(t, c.Rec.WaitCount(t, ctx, 180), 60)
	require.True(t, c.Consumer.Stats().ReadingFromStandby)
	require.Zero(t, c.Consumer.Stats().Failures)
	requireCursorsWithin(t, c.Pool, "killed-reader", c.Rec)
}

// testStandbyPromoted: a consumer reads from the standby while the primary is stopped and the
// standby promoted; a consumer of the same identity, restarted on the promoted server,
// continues from the cursor the standby had replayed: nothing lost, each consumer's deliveries
// in order. Ticks and transaction IDs survive a physical failover, so the promoted server's
// ticks number what is written on it after the old ones.
func testStandbyPromoted(t *testing.T, pair *pgtest.Pair) {
	ctx := testkit.Ctx(t)
	db := pair.NewDB(t)
	w := standbyWriter(t, db.URL, 30)
	cfg := testkit.FastConfig()
	cfg.ReadDSN = db.StandbyURL
	c1 := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "failover-reader", Projects: standbyProjects, Config: cfg})
	deleteRound(t, w, 1, 10)
	c1.Rec.WaitCount(t, ctx, 30)
	deleteRound(t, w, 11, 20)
	require.NoError(t, pair.WaitReplayed(t)) // the standby has every committed deletion

	require.NoError(t, pair.Primary.Kill(ctx)) // the primary crashes, the consumer still runs
	require.NoError(t, pair.Standby.Promote(ctx))
	c1.Stop(t) // its cursor writes fail now; the restarted consumer takes over

	promoted := db.StandbyURL
	cfg2 := testkit.FastConfig()
	c2 := testkit.StartProcess(t, promoted, testkit.ProcessOpts{ID: "failover-reader", Projects: standbyProjects, Config: cfg2})
	w2 := testkit.StartProcess(t, promoted, testkit.ProcessOpts{Projects: standbyProjects})
	deleteRound(t, w2, 21, 30)
	c2.Rec.WaitFor(t, ctx, "every event after the failover", func(evs []outbox.ObservedEvent) bool {
		return len(evs) > 0 && lastOf(evs, "alpha") == 30 && lastOf(evs, "beta") == 30 && lastOf(evs, "gamma") == 30
	})
	// Each consumer delivered in order; together, every event, the second continuing from a
	// cursor at or below what the first delivered (at-least-once across the failover).
	first, second := c1.Rec.Snapshot(), c2.Rec.Snapshot()
	next := map[string]int64{}
	for _, ev := range first {
		require.Equal(t, next[ev.ProjectID]+1, ev.Sequence, "project %s: in order before the failover", ev.ProjectID)
		next[ev.ProjectID] = ev.Sequence
	}
	for _, p := range standbyProjects {
		var seqs []int64
		for _, ev := range second {
			if ev.ProjectID == p {
				seqs = append(seqs, ev.Sequence)
			}
		}
		require.NotEmpty(t, seqs)
		require.LessOrEqual(t, seqs[0], lastOf(first, p)+1, "project %s: nothing skipped across the failover", p)
		for i := 1; i < len(seqs); i++ {
			require.Equal(t, seqs[i-1]+1, seqs[i], "project %s: in order after the failover", p)
		}
		require.EqualValues(t, 30, seqs[len(seqs)-1])
	}
	require.Zero(t, c2.Consumer.Stats().Failures)
}

func lastOf(evs []outbox.ObservedEvent, project string) int64 {
	var last int64
	for _, ev := range evs {
		if ev.ProjectID == project {
			last = max(last, ev.Sequence)
		}
	}
	return last
}

func labelValue(m *dto.Metric, name string) string {
	for _, l := range m.GetLabel() {
		if l.GetName() == name {
			return l.GetValue()
		}
	}
	return ""
}

// TestReadDSNOnAServerNotInRecoveryIsLeft: a ReadDSN that reaches a server not in recovery (a
// promoted standby, or the primary by mistake) serves no read: the consumer reads from the
// primary, says so once and counts it, and delivers every event.
func TestReadDSNOnAServerNotInRecoveryIsLeft(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	w := standbyWriter(t, db.URL, 10)
	cfg := testkit.FastConfig()
	cfg.ReadDSN = db.URL
	c := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "misread", Projects: standbyProjects, Config: cfg})
	deleteRound(t, w, 1, 10)
	requireInOrder(t, c.Rec.WaitCount(t, ctx, 30), 10)
	st := c.Consumer.Stats()
	require.EqualValues(t, 1, st.ReadFallbacks)
	require.Zero(t, st.ReadReturns, "never taken for a standby")
	require.False(t, st.ReadingFromStandby)
}

package outbox_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/outboxtest"
)

// The tests of what a consumer reads of its open deliveries (retries, replay requests): only
// when they may have changed. Each test fails without the mechanism it names.

// stmtCounter counts the statements a pool sends, by the name of the package's constant
// (outbox.Statements), "other" for any other.
type stmtCounter struct {
	mu     sync.Mutex
	byName map[string]int
	names  map[string]string // SQL -> constant name
}

func newStmtCounter() *stmtCounter {
	c := &stmtCounter{byName: map[string]int{}, names: map[string]string{}}
	for name, sql := range outbox.Statements {
		c.names[sql] = name
	}
	return c
}

func (c *stmtCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	name, ok := c.names[d.SQL]
	if !ok {
		name = "other"
	}
	c.byName[name]++
	return ctx
}

func (c *stmtCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// counts returns the counts so far.
func (c *stmtCounter) counts() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[string]int, len(c.byName))
	for k, v := range c.byName {
		out[k] = v
	}
	return out
}

// since returns what was counted after before (a counts result), leaving out what did not move.
func (c *stmtCounter) since(before map[string]int) map[string]int {
	out := map[string]int{}
	for k, v := range c.counts() {
		if d := v - before[k]; d != 0 {
			out[k] = d
		}
	}
	return out
}

func total(counts map[string]int) int {
	n := 0
	for _, v := range counts {
		n += v
	}
	return n
}

// countedPool opens a pool on url whose statements c counts.
func countedPool(t *testing.T, url string, c *stmtCounter) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.ConnConfig.Tracer = c
	return pgtest.PoolConfig(t, cfg)
}

// TestIdlePollIsOneStatement: an idle consumer's poll is its read of heads and nothing else;
// once TickFallbackInterval has passed on its clock, the next poll also reads its open
// deliveries (the bound on a lost replay hint), and then the polls are one statement again.
// Before, every poll read the open deliveries too.
func TestIdlePollIsOneStatement(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctr := newStmtCounter()
	clock := outboxtest.NewFakeClock()
	cfg := testkit.FastConfig()
	cfg.Clock, cfg.TickFallbackInterval, cfg.LeaseTTL = clock, 2*time.Hour, 24*time.Hour
	pool := countedPool(t, db.URL, ctr)
	c, atRest := startPolledConsumer(t, pool, "idle", cfg)
	atRest("after its first scan")
	// The new cursor is positioned by an acknowledgement AckInterval after the first scan,
	// written in the background: it is not a poll's.
	testkit.WaitCursor(t, testkit.Ctx(t), pool, "p", "idle", 0)
	// Without notifications every consumer ticks once per PollInterval (an hour here), the
	// first time at its start: that tick is not a poll's.
	require.Eventually(t, func() bool { return ctr.counts()["tickSQL"] == 1 }, testkit.WaitLimit, time.Millisecond)
	poll := func(what string) map[string]int {
		t.Helper()
		before := ctr.counts()
		outbox.ScanNow(c)
		atRest("after " + what)
		return ctr.since(before)
	}
	for i := 1; i <= 5; i++ {
		require.Equal(t, map[string]int{"loopHeadsSQL": 1}, poll("a poll"), "poll %d: the read of heads only", i)
	}
	reads := c.Stats().OpenReads
	clock.Advance(2 * time.Hour)
	require.Equal(t, map[string]int{"loopHeadsSQL": 1, "openDeliveriesSQL": 1}, poll("the poll after TickFallbackInterval"),
		"the open deliveries are read again once TickFallbackInterval has passed")
	require.Equal(t, reads+1, c.Stats().OpenReads)
	require.Equal(t, map[string]int{"loopHeadsSQL": 1}, poll("the next poll"))
}

// TestIdleConsumerStatementsPerPollInterval: an idle consumer of 20 projects, with
// notifications and its ticker elected, sends at most two statements per PollInterval, every
// timer at its default ratio to PollInterval (TickFallbackInterval 5, HeartbeatInterval 10): at
// the default 1s, at most 2 statements a second. (Its poll, one read of heads; a read of open
// deliveries and an idle tick per TickFallbackInterval; a lease renewal per heartbeat. Before,
// each poll also read the open deliveries and the elected ticker ticked once per PollInterval:
// 3.1.) The window is measured, not waited out: it ends after 30 polls, and every timer only
// fires less often on a slower machine.
func TestIdleConsumerStatementsPerPollInterval(t *testing.T) {
	t.Parallel()
	db := pgtest.NewDB(t)
	ctr := newStmtCounter()
	cfg := outbox.Config{PollInterval: 100 * time.Millisecond, LeaseTTL: 3 * time.Second, HeartbeatInterval: time.Second,
		NewCursor: outbox.NewCursorOldest}
	projects := make([]string, 20)
	for i := range projects {
		projects[i] = "proj-" + string(rune('a'+i))
	}
	c, _ := startConsumer(t, countedPool(t, db.URL, ctr), "idle", projects, cfg, nil)
	require.Eventually(t, func() bool { return outbox.TickerElected(c) && c.WakeupsWorking() && c.Stats().Scans >= 3 },
		testkit.WaitLimit, 5*time.Millisecond, "elected, listening and past its first polls")

	before, scans, started := ctr.counts(), c.Stats().Scans, time.Now()
	require.Eventually(t, func() bool { return c.Stats().Scans >= scans+30 }, testkit.WaitLimit, time.Millisecond, "30 polls")
	elapsed := time.Since(started)
	got := ctr.since(before)
	intervals := float64(elapsed) / float64(cfg.PollInterval)
	t.Logf("%d statements in %v (%.1f poll intervals, %d scans): %v", total(got), elapsed, intervals, c.Stats().Scans-scans, got)
	require.LessOrEqual(t, float64(total(got)), 2*intervals, "statements per PollInterval: %v", got)
}

// TestReplayHintWakesAnIdleConsumer: an operator's replay request reaches an idle consumer
// through its hint: the consumer, which polls once an hour and whose clock does not move,
// reads its open deliveries once and replays the dead letter.
func TestReplayHintWakesAnIdleConsumer(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	w := seedDeletes(t, ctx, db.URL, "p", 1)
	clock := outboxtest.NewFakeClock()
	cfg := retryConfig(clock) // PollInterval an hour
	cfg.MaxAttempts = 1
	broken, fix := brokenObserver(t, db.URL, cfg)
	rested := restsOf(broken.Consumer)
	broken.Start(t)
	require.Eventually(t, func() bool { return deliveryOfProject(t, w.Pool, "p", "broken", 1) == "dead" }, testkit.WaitLimit, 5*time.Millisecond)
	rested(t, ctx)
	reads := broken.Consumer.Stats().OpenReads

	fix()
	requestReplay(t, ctx, w, "broken", 1)
	requireReplayed(t, ctx, w, broken)
	require.Equal(t, reads+1, broken.Consumer.Stats().OpenReads, "one read of the open deliveries, for the hint")
	require.Zero(t, clock.Offset(), "the consumer's clock did not move: no periodic read")
}

// TestLostReplayHintIsReadWithinTickFallbackInterval: a consumer that does not hear the hint
// (here it does not listen at all) polls without reading its open deliveries until
// TickFallbackInterval has passed on its clock, and then replays the dead letter.
func TestLostReplayHintIsReadWithinTickFallbackInterval(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	w := seedDeletes(t, ctx, db.URL, "p", 1)
	clock := outboxtest.NewFakeClock()
	cfg := retryConfig(clock)
	cfg.MaxAttempts, cfg.NotifyDisabled = 1, true
	cfg.PollInterval, cfg.TickFallbackInterval = 50*time.Millisecond, time.Hour
	broken, fix := brokenObserver(t, db.URL, cfg)
	broken.Start(t)
	require.Eventually(t, func() bool { return deliveryOfProject(t, w.Pool, "p", "broken", 1) == "dead" }, testkit.WaitLimit, 5*time.Millisecond)

	fix()
	requestReplay(t, ctx, w, "broken", 1)
	scans := broken.Consumer.Stats().Scans
	require.Eventually(t, func() bool { return broken.Consumer.Stats().Scans >= scans+3 }, testkit.WaitLimit, time.Millisecond, "three polls")
	require.Equal(t, "replay_requested", testkit.DeliveryOf(t, w.Pool, "broken", 1).State, "the polls use what the consumer knows")
	require.Empty(t, replays(broken.Rec.Snapshot()))

	clock.Advance(time.Hour)
	requireReplayed(t, ctx, w, broken)
}

// TestRetryOfAnotherProcessIsHonouredAfterTakeover: instance B of an identity knows it has no
// open delivery; frozen past its lease, it loses the project to instance A of the same identity,
// which fails an event and persists its retry, then stops. B takes the lease again and must
// read what A wrote: it waits for the retry to fall due and delivers the event as its second
// attempt, rather than at once as a first.
func TestRetryOfAnotherProcessIsHonouredAfterTakeover(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	clock := outboxtest.NewFakeClock()
	cfg := retryConfig(clock) // a day's lease; polls and heartbeats once an hour
	cfg.RetrySchedule = []time.Duration{time.Hour}
	w := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: []string{"p"}})
	_, err := w.Store.CreateMany(ctx, "p", "t", 1)
	require.NoError(t, err)

	b := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "engine", Projects: []string{"p"}, Config: cfg})
	require.Eventually(t, func() bool { return b.Consumer.Stats().OpenReads >= 1 }, testkit.WaitLimit, 5*time.Millisecond, "B read its open deliveries")
	outbox.PauseHeartbeat(b.Consumer, true)
	clock.Advance(25 * time.Hour) // B's lease runs out

	a := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "engine", Projects: []string{"p"}, Config: cfg, NoStart: true})
	a.Rec.SetFail(func(outbox.ObservedEvent) error { return testkit.ErrListener })
	a.Start(t)
	require.Equal(t, a.Consumer.LeaseOwner(), leaseOwnerOf(t, w.Pool, "p", "engine"), "A took the project over")
	_, err = w.Store.Delete(ctx, "p", "t-1")
	require.NoError(t, err)
	require.Eventually(t, func() bool { return deliveryOfProject(t, w.Pool, "p", "engine", 1) == "retrying" }, testkit.WaitLimit, 5*time.Millisecond)
	a.Stop(t) // releases the lease
	require.Empty(t, clock.Waiters(), "A left no timer")

	reads := b.Consumer.Stats().OpenReads
	outbox.HeartbeatNow(ctx, b.Consumer) // B's renewal finds the lease gone; it takes it again
	require.Equal(t, b.Consumer.LeaseOwner(), leaseOwnerOf(t, w.Pool, "p", "engine"), "B took the project back")
	var wait time.Duration
	for wait == 0 {
		require.Empty(t, b.Rec.Snapshot(), "B delivered the event before its retry fell due")
		if ws := clock.Waiters(); len(ws) > 0 {
			wait = ws[0] - clock.Offset()
			break
		}
		select {
		case <-ctx.Done():
			t.Fatal("B never armed the retry A persisted")
		case <-time.After(time.Millisecond):
		}
	}
	require.Greater(t, b.Consumer.Stats().OpenReads, reads, "B read its open deliveries on taking the lease")
	require.LessOrEqual(t, wait, time.Hour, "what is left of A's backoff (an hour after its first attempt)")
	clock.Advance(wait)
	evs := b.Rec.WaitCount(t, ctx, 1)
	require.Equal(t, 2, evs[0].Attempt, "A's attempt counted")
	testkit.WaitCursor(t, ctx, w.Pool, "p", "engine", 1)
	require.Eventually(t, func() bool { return deliveryOfProject(t, w.Pool, "p", "engine", 1) == "resolved" }, testkit.WaitLimit, 5*time.Millisecond)
}

// TestEventWithoutAHintIsTickedByAPoll: an event committed without a hint to the ticker (its
// writer died between its commit and its hint) is delivered after the next poll of the
// consumer whose ticker is elected, which finds it committed and not ticked, in any project,
// and ticks; the elected ticker, idle, ticks only once per TickFallbackInterval (here an hour)
// on its own. Before, it ticked once per PollInterval for this.
func TestEventWithoutAHintIsTickedByAPoll(t *testing.T) {
	t.Parallel()
	cfg := testkit.FastConfig()
	cfg.TickFallbackInterval = time.Hour
	t.Run("of its own project", func(t *testing.T) {
		t.Parallel()
		ctx := testkit.Ctx(t)
		db := pgtest.NewDB(t)
		c, rec := startConsumer(t, pgtest.Pool(t, db.URL), "c", []string{"p"}, cfg, nil)
		require.Eventually(t, func() bool { return outbox.TickerElected(c) && c.Stats().Scans >= 2 }, testkit.WaitLimit, 5*time.Millisecond)
		_, err := pgtest.Pool(t, db.URL).Exec(ctx, insertLogRow, "p", "t0")
		require.NoError(t, err)
		rec.WaitCount(t, ctx, 1)
		require.Positive(t, c.Stats().TickHints)
	})
	t.Run("of a project another consumer observes", func(t *testing.T) {
		t.Parallel()
		ctx := testkit.Ctx(t)
		lp := newLeastPrivilege(t)
		leaderPool, _ := lp.component(t, "leader", consumerGrant("leader", "other"))
		leader, _ := startConsumer(t, leaderPool, "leader", []string{"other"}, cfg, nil)
		require.Eventually(t, func() bool { return outbox.TickerElected(leader) }, testkit.WaitLimit, 5*time.Millisecond)
		pool, _ := lp.component(t, "c", consumerGrant("c", "p"))
		c, rec := startConsumer(t, pool, "c", []string{"p"}, cfg, nil)
		require.Eventually(t, func() bool { return c.Stats().Scans >= 2 }, testkit.WaitLimit, 5*time.Millisecond)
		_, err := lp.owner.Exec(ctx, insertLogRow, "p", "t0")
		require.NoError(t, err)
		rec.WaitCount(t, ctx, 1)
		require.False(t, outbox.TickerElected(c))
		require.Zero(t, c.Stats().TickHints, "only the elected ticker's consumer asks")
		require.Positive(t, leader.Stats().TickHints, "the leader's role cannot read project p's events, and its question covers them")
	})
}

// brokenObserver builds (without starting) consumer "broken" of project "p", whose listener
// fails until fix is called.
func brokenObserver(t *testing.T, url string, cfg outbox.Config) (p *testkit.Process, fix func()) {
	t.Helper()
	p = testkit.StartProcess(t, url, testkit.ProcessOpts{ID: "broken", Projects: []string{"p"}, Config: cfg, NoStart: true})
	var mu sync.Mutex
	fixed := false
	p.Rec.SetFail(func(ev outbox.ObservedEvent) error {
		mu.Lock()
		defer mu.Unlock()
		if !fixed {
			return testkit.ErrListener
		}
		return nil
	})
	return p, func() {
		mu.Lock()
		defer mu.Unlock()
		fixed = true
	}
}

// restsOf has c's loop report when it rests (see OnLoopRest); call before Start. The function
// it returns waits for the next rest.
func restsOf(c *outbox.Consumer) func(t *testing.T, ctx context.Context) {
	rests := make(chan struct{}, 1)
	outbox.OnLoopRest(c, func() {
		select {
		case rests <- struct{}{}:
		default:
		}
	})
	return func(t *testing.T, ctx context.Context) {
		t.Helper()
		select {
		case <-rests:
		case <-ctx.Done():
			t.Fatal("the loop never came to rest")
		}
	}
}

func requestReplay(t *testing.T, ctx context.Context, w *testkit.Process, consumer string, seq int64) {
	t.Helper()
	admin := outbox.NewAdmin(w.Pool, outbox.AdminOptions{Audit: w.Store})
	_, err := admin.RequestReplay(ctx, outbox.ReplayRequest{ProjectID: "p", ConsumerID: consumer, Sequence: seq,
		Operator: outbox.Operator{Actor: "oncall@example.com", Reason: "FN-1"}})
	require.NoError(t, err)
}

func replays(evs []outbox.ObservedEvent) []outbox.ObservedEvent {
	var out []outbox.ObservedEvent
	for _, ev := range evs {
		if ev.Replay {
			out = append(out, ev)
		}
	}
	return out
}

// requireReplayed waits until obs replayed event 1 and resolved its dead letter.
func requireReplayed(t *testing.T, ctx context.Context, w, obs *testkit.Process) {
	t.Helper()
	obs.Rec.WaitFor(t, ctx, "the replay", func(evs []outbox.ObservedEvent) bool { return len(replays(evs)) > 0 })
	require.Eventually(t, func() bool { return deliveryOfProject(t, w.Pool, "p", "broken", 1) == "resolved" }, testkit.WaitLimit, 5*time.Millisecond)
	// The resolution commits before the consumer counts it: wait for the count, then check it
	// is exactly one.
	require.Eventually(t, func() bool { return obs.Consumer.Stats().Replayed >= 1 }, testkit.WaitLimit, time.Millisecond)
	require.EqualValues(t, 1, obs.Consumer.Stats().Replayed)
}

func leaseOwnerOf(t *testing.T, pool *pgxpool.Pool, project, consumer string) string {
	t.Helper()
	var owner *string
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT lease_owner FROM lifecycle_consumer_cursors
		WHERE project_id = $1 AND consumer_id = $2`, project, consumer).Scan(&owner))
	if owner == nil {
		return ""
	}
	return *owner
}

package outbox_test

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/outboxtest"
)

// Follow-up scans, off by default (FollowUpWindow 0): a consumer configured with a window scans a
// project that found events again every FollowUpInterval for FollowUpWindow, so it finds events
// of ticks nobody announced.

// TestFollowUpScansFindUnannouncedEvents: after one announced tick, the next events are numbered
// by ticks that nobody announces (outbox.Tick, while another session holds the ticker's election,
// so the consumer's own ticker never ticks on them) and with an hour-long poll: only follow-up
// scans can find them.
func TestFollowUpScansFindUnannouncedEvents(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	holdTickerElection(t, ctx, db.URL)
	cfg := testkit.FastConfig()
	cfg.PollInterval, cfg.FollowUpInterval, cfg.FollowUpWindow = time.Hour, 2*time.Millisecond, time.Minute
	c, rec := startConsumer(t, pool, "c1", []string{"p"}, cfg, nil)
	require.Eventually(t, func() bool { return c.Stats().Scans >= 1 }, testkit.WaitLimit, time.Millisecond, "the first scan")

	_, err := pool.Exec(ctx, insertLogRow, "p", "t0")
	require.NoError(t, err)
	_, err = outbox.Tick(ctx, pool)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `SELECT pg_notify('lifecycle_outbox_tick', 'p')`)
	require.NoError(t, err)
	rec.WaitCount(t, ctx, 1)
	ticks := c.Stats().Ticks
	for i := 1; i <= 4; i++ {
		_, err := pool.Exec(ctx, insertLogRow, "p", fmt.Sprintf("t%d", i))
		require.NoError(t, err)
		res, err := outbox.Tick(ctx, pool) // no notification
		require.NoError(t, err)
		require.Equal(t, int64(1), res.Events)
		rec.WaitCount(t, ctx, i+1)
	}
	require.Equal(t, ticks, c.Stats().Ticks, "the consumer's own ticker numbered none of them")
}

// TestNoFollowUpScansWhileWaitingOnARetry: a project whose head-of-line event waits for its
// next attempt makes no progress, so its open delivery does not keep it busy: the loop does
// not scan it every FollowUpInterval until the retry falls due.
func TestNoFollowUpScansWhileWaitingOnARetry(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	clock := outboxtest.NewFakeClock()
	cfg := testkit.FastConfig()
	cfg.PollInterval, cfg.Clock = time.Hour, clock
	cfg.FollowUpInterval, cfg.FollowUpWindow = time.Millisecond, 20*time.Millisecond
	c, rec := startConsumer(t, pool, "c1", []string{"p"}, cfg, nil)
	rec.SetFail(func(outbox.ObservedEvent) error { return errors.New("listener down") })
	_, err := pool.Exec(ctx, insertLogRow, "p", "t0")
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `SELECT pg_notify('lifecycle_outbox', 'p')`) // the writer's hint: the ticker ticks and announces
	require.NoError(t, err)
	_, err = waitForRetry(ctx, clock) // the event failed once and waits 1s on the fake clock
	require.NoError(t, err)

	// The follow-ups the scan that delivered the event earned end with its 20ms window: at most
	// 20 of them, however late they run on a busy machine, below the 50 that tell a spin.
	before := c.Stats().Scans
	require.Never(t, func() bool { return c.Stats().Scans-before >= 50 }, time.Second, 10*time.Millisecond,
		"a project waiting on a retry is scanned again and again")
}

// TestWriterStaysQuietWithinTheGap: commits in a burst are announced on the edge and then at
// most once per NotifyGap, not once per commit.
func TestWriterStaysQuietWithinTheGap(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	const gap = 200 * time.Millisecond
	w := newWriter(t, pool, outbox.Config{NotifyGap: gap})
	store := testhost.New(pool, testhost.Options{Writer: w, Logger: zaptest.NewLogger(t)})

	listener, err := pgx.Connect(ctx, db.URL)
	require.NoError(t, err)
	defer listener.Close(ctx)
	_, err = listener.Exec(ctx, `LISTEN lifecycle_outbox`)
	require.NoError(t, err)

	ids, err := store.CreateMany(ctx, "proj-n", "t", 40)
	require.NoError(t, err)
	started := time.Now()
	for _, id := range ids {
		_, err := store.Delete(ctx, "proj-n", id)
		require.NoError(t, err)
	}
	elapsed := time.Since(started)
	require.NoError(t, w.Close(ctx)) // every wake-up in flight has been sent

	got := len(receivedNotifications(t, ctx, listener))
	require.GreaterOrEqual(t, got, 1, "the first commit is announced")
	require.LessOrEqual(t, got, int(elapsed/gap)+2, "one on the edge, then at most one per gap (%d commits in %s)", len(ids), elapsed)
}

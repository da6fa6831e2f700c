package outbox_test

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
)

// What an idle consumer costs: one scan per poll and nothing between polls. A scan of an idle
// project is one statement, its read of heads (its open deliveries are read again only once
// per TickFallbackInterval: open_deliveries_test.go counts the statements), so the scans per
// poll are its cost.

// TestIdleConsumerScansOncePerPoll counts the scans of an idle consumer (NOTIFY off) between
// two moments its loop is at rest with nothing armed but the poll interval. The polls are
// asked for (ScanNow, what the poll timer does) rather than waited for, so the count does not
// depend on how fast the machine runs: the first scan and each poll must cost one scan. (It
// also ran while another instance held the project as its sequencer, whose holds once counted
// as progress; no instance numbers or holds a project now.)
func TestIdleConsumerScansOncePerPoll(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	c, atRest := startPolledConsumer(t, pool, "idle", testkit.FastConfig())
	atRest("after its first scan")
	require.Equal(t, int64(1), c.Stats().Scans, "the first scan of an idle consumer: scans until the loop rests")
	for poll := 1; poll <= 5; poll++ {
		before := c.Stats().Scans
		outbox.ScanNow(c)
		atRest("after a poll")
		require.Equal(t, int64(1), c.Stats().Scans-before, "poll %d of an idle consumer: scans until the loop rests again", poll)
	}
}

// TestOneScanDrainsAProjectPastBatchSize pins what Config.BatchSize says: it bounds a read,
// not a scan. One scan reads a project batch after batch up to the head it found, so a
// backlog of several batches is delivered by the scan that found it, not one batch per poll.
func TestOneScanDrainsAProjectPastBatchSize(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	_, err := pool.Exec(ctx, insertPendingRows, "p", "t", 35)
	require.NoError(t, err)
	_, err = outbox.Tick(ctx, pool) // numbered before the consumer's first scan
	require.NoError(t, err)
	cfg := testkit.FastConfig()
	cfg.BatchSize, cfg.NotifyDisabled, cfg.PollInterval = 10, true, time.Hour
	cfg.FollowUpInterval, cfg.FollowUpWindow = time.Hour, time.Hour // no follow-up scan within the test
	cfg.LeaseTTL, cfg.HeartbeatInterval = time.Hour, 20*time.Minute
	c, rec := startConsumer(t, pool, "drain", []string{"p"}, cfg, nil)
	rec.WaitCount(t, ctx, 35)
	require.Equal(t, int64(1), c.Stats().Scans, "four batches of 10, one scan")
	testkit.WaitCursor(t, ctx, pool, "p", "drain", 35)
}

// TestAScanThatFoundEventsArmsNoFollowUp: by default a consumer scans a project only when woken
// for it or polled. A scan that delivered events leaves nothing armed but the acknowledgement
// (AckInterval later) and the poll, so from the asked-for scan to the loop's next rest there is
// that one scan. (With follow-up scans on, as every consumer had before they became optional,
// the project was scanned again every FollowUpInterval for FollowUpWindow.)
func TestAScanThatFoundEventsArmsNoFollowUp(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	require.Zero(t, testkit.FastConfig().WithDefaults().FollowUpWindow, "follow-up scans are off by default")
	c, atRest := startPolledConsumer(t, pool, "busy", testkit.FastConfig())
	atRest("after its first scan")
	_, err := pool.Exec(ctx, insertPendingRows, "p", "t", 5)
	require.NoError(t, err)
	_, err = outbox.Tick(ctx, pool)
	require.NoError(t, err)
	before := c.Stats().Scans
	outbox.ScanNow(c)
	atRest("after the scan that found events")
	require.Equal(t, int64(5), c.Stats().Delivered, "the scan delivered the events")
	require.Equal(t, int64(1), c.Stats().Scans-before, "scans from the one asked for until the loop rests")
}

// startPolledConsumer starts consumer id of project "p" with cfg, changed so that only asked-for
// scans run (no notifications, an hour-long poll, no heartbeat within the test). atRest waits
// until the loop rests with nothing armed but the poll interval.
func startPolledConsumer(t *testing.T, pool *pgxpool.Pool, id string, cfg outbox.Config) (c *outbox.Consumer, atRest func(what string)) {
	t.Helper()
	ctx := testkit.Ctx(t)
	cfg.NotifyDisabled, cfg.PollInterval = true, time.Hour
	cfg.LeaseTTL, cfg.HeartbeatInterval = max(cfg.LeaseTTL, time.Hour), 20*time.Minute // no heartbeat asks for a scan
	c, err := outbox.NewConsumer(outbox.ConsumerOptions{ID: outbox.ConsumerID(id), Pool: pool, Config: cfg, Projects: outbox.StaticProjects{"p"},
		Dispatcher: outbox.NewDispatcher(outbox.DispatcherOptions{NoLocalWriter: true}), Logger: zaptest.NewLogger(t)})
	require.NoError(t, err)
	rests := make(chan struct{}, 1)
	outbox.OnLoopRest(c, func() {
		select {
		case rests <- struct{}{}:
		default:
		}
	})
	require.NoError(t, c.Start(ctx))
	t.Cleanup(func() { stopConsumer(t, c) })
	return c, func(what string) {
		t.Helper()
		select {
		case <-rests:
		case <-ctx.Done():
			t.Fatalf("the loop never came to rest %s (%d scans)", what, c.Stats().Scans)
		}
	}
}

package outbox_test

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/outboxtest"
)

// TestSkippedProjectWaitingOnARetryDoesNotSpin: a project whose head-of-line event waits for a
// retry, and whose sequencer then fails (a hostile preset sequence), is skipped; its due retry
// must not fire the loop's retry timer at once on every turn. Without the fix the consumer ran
// hundreds of full scans a second; with it the failed step rescans about once a second.
func TestSkippedProjectWaitingOnARetryDoesNotSpin(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.NewPool(t)
	seedEvents(t, pool, "a", 1)
	seedEvents(t, pool, "b", 1)
	clock := outboxtest.NewFakeClock()
	cfg := fastConfig()
	cfg.PollInterval, cfg.Clock = time.Hour, clock // only the retry timer and failures wake the loop
	c, rec := startConsumer(t, pool, "c1", []string{"a", "b"}, cfg, nil)
	rec.setFail(func(ev outbox.ObservedEvent) error {
		if ev.ProjectID == "a" {
			return errors.New("listener down")
		}
		return nil
	})
	_, err := waitForRetry(ctx, clock) // a's event 1 failed once and waits 1s
	require.NoError(t, err)

	// a's sequencer now fails: a row preset at the sequence it would number next, and a pending row.
	for _, stmt := range []string{
		`INSERT INTO lifecycle_outbox (project_id, task_id, deleted_at, sequence, event_type, archived, payload_version, occurred_at, writer_process_id)
		 VALUES ('a', 'preset', '2026-01-02T03:04:05Z', 2, 'task:deleted', false, 1, now(), 'writer-0123456789abcdef')`,
		`INSERT INTO lifecycle_outbox (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
		 VALUES ('a', 'pending', '2026-01-02T03:04:06Z', 'task:deleted', false, 1, now(), 'writer-0123456789abcdef')`,
	} {
		_, err := pool.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	before := c.Stats().Scans
	clock.Advance(2 * time.Second) // a's retry falls due; the scan it starts skips a
	require.Eventually(t, func() bool { return c.Stats().Scans > before }, waitLimit, time.Millisecond, "the due retry starts a scan")
	require.Never(t, func() bool { return c.Stats().Scans-before >= 50 }, 3*time.Second, 10*time.Millisecond,
		"a skipped project's due retry keeps the loop scanning")
}

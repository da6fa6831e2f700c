package outbox_test

import (
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/outboxtest"
)

// TestSkippedProjectWaitingOnARetryDoesNotSpin: a project whose head-of-line event waits for a
// retry, and whose open deliveries then cannot be read (a policy that raises for its rows,
// standing in for whatever one project's rows may do to the server), is skipped; its due retry
// must not fire the loop's retry timer at once on every turn. Without the fix the consumer ran
// hundreds of full scans a second; with it the failed step rescans about once a second.
func TestSkippedProjectWaitingOnARetryDoesNotSpin(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilege(t)
	writer, _ := lp.component(t, "writer", writerGrant("a", "b"))
	deleteTasksAs(t, lp, writer, "a", 1)
	deleteTasksAs(t, lp, writer, "b", 1)
	consumer, role := lp.component(t, "consumer", consumerGrant("c1", "a", "b"))
	clock := outboxtest.NewFakeClock()
	cfg := testkit.FastConfig()
	cfg.PollInterval, cfg.Clock = time.Hour, clock // only the retry timer and failures wake the loop
	c, rec := startConsumer(t, consumer, "c1", []string{"a", "b"}, cfg, nil)
	rec.SetFail(func(ev outbox.ObservedEvent) error {
		if ev.ProjectID == "a" {
			return errors.New("listener down")
		}
		return nil
	})
	_, err := waitForRetry(ctx, clock) // a's event 1 failed once and waits 1s
	require.NoError(t, err)

	// a's open deliveries now cannot be read: every scan skips a at that step.
	for _, stmt := range []string{
		`CREATE FUNCTION refuse_delivery_read(p text) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    IF p = 'a' THEN
        RAISE EXCEPTION 'the deliveries of a cannot be read';
    END IF;
    RETURN true;
END $$`,
		`CREATE POLICY refuse_delivery_read ON lifecycle_consumer_deliveries AS RESTRICTIVE FOR SELECT TO ` + pgx.Identifier{role}.Sanitize() +
			` USING (refuse_delivery_read(project_id))`,
	} {
		_, err := lp.owner.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	before := c.Stats().Scans
	clock.Advance(2 * time.Second) // a's retry falls due; the scan it starts skips a
	require.Eventually(t, func() bool { return c.Stats().Scans > before }, testkit.WaitLimit, time.Millisecond, "the due retry starts a scan")
	require.Never(t, func() bool { return c.Stats().Scans-before >= 50 }, 3*time.Second, 10*time.Millisecond,
		"a skipped project's due retry keeps the loop scanning")
}

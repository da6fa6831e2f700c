package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/outboxtest"
)

// TestBacklogBatchesAreReadAhead: a stream with a backlog of full batches reads each next
// batch while it dispatches the one before (Stats.Prefetched), and every event still arrives
// once, in order.
func TestBacklogBatchesAreReadAhead(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	seeder := pgtest.Pool(t, db.URL)
	testkit.SeedEvents(t, seeder, "p", 55)
	cfg := testkit.FastConfig()
	cfg.BatchSize = 10
	c, rec := startConsumer(t, pgtest.Pool(t, db.URL), "c1", []string{"p"}, cfg, nil)
	rec.WaitCount(t, ctx, 55)
	testkit.WaitCursor(t, ctx, seeder, "p", "c1", 55)
	require.Equal(t, upTo(55), sequencesByProject(rec.Snapshot())["p"], "every event once, in order")
	// Five full batches with more behind each: the batches from 11 on were read ahead.
	require.EqualValues(t, 5, c.Stats().Prefetched, "batches read while the one before was dispatched")
}

// TestReadAheadIsDroppedWhenTheStreamStops: a listener fails the 15th event, in the second
// batch, while the third is being read ahead. The stream stops at the failure; nothing past it
// is handed over, the batch read ahead is not taken, and once the retry falls due (on the
// injected clock) the stream goes on from the failed event, every event once, in order.
func TestReadAheadIsDroppedWhenTheStreamStops(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	seeder := pgtest.Pool(t, db.URL)
	testkit.SeedEvents(t, seeder, "p", 55)
	clock := outboxtest.NewFakeClock()
	cfg := retryConfig(clock)
	cfg.BatchSize = 10
	cfg.RetrySchedule = []time.Duration{time.Hour}
	rec := testkit.NewRecorder()
	rec.SetFail(func(ev outbox.ObservedEvent) error {
		if ev.Sequence == 15 && ev.Attempt == 1 {
			return testkit.ErrListener
		}
		return nil
	})
	c := startRecording(t, pgtest.Pool(t, db.URL), "c1", []string{"p"}, cfg, nil, rec)
	waitCtx, cancel := context.WithTimeout(ctx, testkit.WaitLimit)
	defer cancel()

	wait, err := clock.WaitForTimer(waitCtx, time.Minute) // the retry, an hour ahead less the real time spent
	require.NoError(t, err)
	testkit.WaitCursor(t, waitCtx, seeder, "p", "c1", 14)
	require.Equal(t, upTo(14), sequencesByProject(rec.Snapshot())["p"], "nothing past the failed event is handed over")
	require.EqualValues(t, 1, c.Stats().Prefetched, "only the second batch was taken from a read ahead")

	clock.Advance(wait)
	evs := rec.WaitCount(t, waitCtx, 55)
	testkit.WaitCursor(t, waitCtx, seeder, "p", "c1", 55)
	require.Equal(t, upTo(55), sequencesByProject(rec.Snapshot())["p"], "every event once, in order")
	for _, ev := range evs {
		if ev.Sequence == 15 {
			require.Equal(t, 2, ev.Attempt, "the failed event comes again as its second attempt")
		}
	}
}

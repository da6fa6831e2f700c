package outbox_test

import (
	"context"
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
)

// joinTracer holds each read of heads or first batches, once armed, until another consumer
// waits for it (or a bound passes), so that the test sees a read shared without depending on
// how two consumers' scans happen to line up in time.
type joinTracer struct {
	pool  atomic.Pointer[pgxpool.Pool]
	holds atomic.Int64 // how many more reads to hold
	held  atomic.Int64
}

func (j *joinTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if d.SQL != outbox.Statements["loopHeadsSQL"] && d.SQL != outbox.Statements["readFirstEventsSQL"] && d.SQL != outbox.Statements["readTicksSQL"] &&
		d.SQL != outbox.Statements["readTicksSinceSQL"] {
		return ctx
	}
	if j.holds.Add(-1) < 0 {
		return ctx
	}
	j.held.Add(1)
	deadline := time.Now().Add(3 * time.Second) // a bound on the hold, not on the test
	for outbox.SharedWaiters(j.pool.Load()) == 0 && time.Now().Before(deadline) && ctx.Err() == nil {
		time.Sleep(time.Millisecond)
	}
	return ctx
}

func (j *joinTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// TestConsumersOfOnePoolShareTheirReads: two consumers of the same projects on one pool take
// the heads and first batches of a tick from one statement, and each still delivers every
// event once, in order. A consumer on a pool of its own shares nothing.
func TestConsumersOfOnePoolShareTheirReads(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	tr := &joinTracer{}
	pc, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	pc.ConnConfig.Tracer = tr
	pool := pgtest.PoolConfig(t, pc)
	tr.pool.Store(pool)
	cfg := testkit.FastConfig()
	// Scans on notifications only: a poll (the elected ticker's reads heads with another
	// statement) would take the holds.
	cfg.TickFallbackInterval, cfg.PollInterval = time.Hour, time.Hour
	projects := []string{"p1", "p2", "p3"}
	c1, rec1 := startConsumer(t, pool, "one", projects, cfg, nil)
	c2, rec2 := startConsumer(t, pool, "two", projects, cfg, nil)
	alone, recAlone := startConsumer(t, pgtest.Pool(t, db.URL), "alone", projects, cfg, nil)

	w, err := outbox.NewWriter(pgtest.Pool(t, db.URL), outbox.Config{}, nil)
	require.NoError(t, err)
	store := testhost.New(pgtest.Pool(t, db.URL), testhost.Options{Writer: w})
	deleteAll := func(task string) {
		for _, p := range projects {
			_, err := store.Delete(ctx, p, task)
			require.NoError(t, err)
		}
	}
	for _, p := range projects {
		_, err := store.CreateMany(ctx, p, "t", 4)
		require.NoError(t, err)
	}
	deleteAll("t-1")
	deleteAll("t-2")
	for _, rec := range []*testkit.Recorder{rec1, rec2, recAlone} {
		rec.WaitCount(t, ctx, 6)
	}
	// Both consumers of the pool are caught up on the same tick: the next ticks wake them to
	// the same reads.
	tr.holds.Store(4)
	deleteAll("t-3")
	deleteAll("t-4")
	for _, rec := range []*testkit.Recorder{rec1, rec2, recAlone} {
		evs := rec.WaitCount(t, ctx, 12)
		require.Len(t, evs, 12, "each event once")
		for _, p := range projects {
			require.Equal(t, upTo(4), sequencesByProject(evs)[p], "project %s in order", p)
		}
	}
	tr.holds.Store(0)
	require.Positive(t, tr.held.Load(), "reads of the shared pool were held")
	require.Positive(t, c1.Stats().SharedReads+c2.Stats().SharedReads, "a read was shared")
	require.Zero(t, alone.Stats().SharedReads, "a pool of its own shares nothing")
}

package outbox_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
	"fusion/outbox/internal/testkit"
)

// TestConsumersOfOnePoolShareOneLISTEN: three consumers on one pool listen on one connection
// (the server wakes one backend per notification, not three), each is woken by it, all of them
// come back when that connection is killed, one stopping leaves the others listening, and the
// last one closes it.
func TestConsumersOfOnePoolShareOneLISTEN(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	pc, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	pc.ConnConfig.RuntimeParams["application_name"] = "hub-pool"
	pool := pgtest.PoolConfig(t, pc)
	admin := pgtest.Pool(t, db.URL)

	cfg := testkit.FastConfig()
	// Only a wake-up delivers within the test: no poll, no fallback tick read.
	cfg.PollInterval, cfg.TickFallbackInterval = time.Hour, time.Hour
	cs := map[outbox.ConsumerID]*outbox.Consumer{}
	recs := map[outbox.ConsumerID]*testkit.Recorder{}
	for _, id := range []outbox.ConsumerID{"one", "two", "three"} {
		cs[id], recs[id] = startConsumer(t, pool, id, []string{"p"}, cfg, nil)
	}
	listeners := func() (n int, pids []int32) {
		rows, err := admin.Query(ctx, `SELECT pid FROM pg_stat_activity
			WHERE application_name = 'hub-pool' AND query = 'LISTEN "lifecycle_outbox_tick"'`)
		require.NoError(t, err)
		defer rows.Close()
		for rows.Next() {
			var pid int32
			require.NoError(t, rows.Scan(&pid))
			pids = append(pids, pid)
		}
		require.NoError(t, rows.Err())
		return len(pids), pids
	}
	working := func(ids ...outbox.ConsumerID) {
		t.Helper()
		require.Eventually(t, func() bool {
			for _, id := range ids {
				if cs[id].Wakeups() != outbox.WakeupsWorking {
					return false
				}
			}
			return true
		}, testkit.WaitLimit, 5*time.Millisecond, "every consumer's self-test passes on the shared connection")
	}
	working("one", "two", "three")
	n, pids := listeners()
	require.Equal(t, 1, n, "one LISTEN connection for the three consumers")

	w, err := outbox.NewWriter(pgtest.Pool(t, db.URL), outbox.Config{}, nil)
	require.NoError(t, err)
	store := testhost.New(pgtest.Pool(t, db.URL), testhost.Options{Writer: w})
	_, err = store.CreateMany(ctx, "p", "t", 3)
	require.NoError(t, err)
	deleteAndWait := func(task string, want int, ids ...outbox.ConsumerID) {
		t.Helper()
		_, err := store.Delete(ctx, "p", task)
		require.NoError(t, err)
		for _, id := range ids {
			require.Len(t, recs[id].WaitCount(t, ctx, want), want, "consumer %s", id)
		}
	}
	deleteAndWait("t-1", 1, "one", "two", "three")

	// Kill the shared connection: it comes back once, for everyone, and wakes them all.
	var killed bool
	require.NoError(t, admin.QueryRow(ctx, `SELECT pg_terminate_backend($1)`, pids[0]).Scan(&killed))
	require.True(t, killed)
	require.Eventually(t, func() bool {
		n, now := listeners()
		return n == 1 && now[0] != pids[0]
	}, testkit.WaitLimit, 5*time.Millisecond, "the shared LISTEN connection is made again")
	deleteAndWait("t-2", 2, "one", "two", "three")

	// One consumer leaving keeps the connection for the others.
	stopConsumer(t, cs["one"])
	n, _ = listeners()
	require.Equal(t, 1, n)
	deleteAndWait("t-3", 3, "two", "three")

	// The last one closes it.
	stopConsumer(t, cs["two"])
	stopConsumer(t, cs["three"])
	require.Eventually(t, func() bool { n, _ := listeners(); return n == 0 }, testkit.WaitLimit, 5*time.Millisecond,
		"no LISTEN connection left behind")
	stopCtx, cancel := context.WithTimeout(ctx, testkit.WaitLimit)
	defer cancel()
	require.NoError(t, cs["one"].Stop(stopCtx), "stopping again is harmless")
}

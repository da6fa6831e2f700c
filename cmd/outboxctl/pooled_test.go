package main_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
)

// TestThroughPgBouncer runs the binary against a DSN that goes through PgBouncer in
// transaction mode (with default_query_exec_mode=exec, as the README says), while the writer
// and the consumer go through it too: status, dead letters, a replay, a prune dry run and the
// schema check all work there.
func TestThroughPgBouncer(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	db := pgtest.NewDB(t)
	pooled := pgtest.PooledURL(t, db)
	pool := pgtest.PooledPool(t, pooled)
	w, err := outbox.NewWriter(pool, outbox.Config{TransactionPooler: true}, nil)
	require.NoError(t, err)
	defer func() { _ = w.Close(ctx) }()
	store := testhost.New(pool, testhost.Options{Writer: w})
	_, err = store.CreateMany(ctx, "alpha", "t", 3)
	require.NoError(t, err)
	for i := 1; i <= 3; i++ {
		_, err := store.Delete(ctx, "alpha", fmt.Sprintf("t-%d", i))
		require.NoError(t, err)
	}
	p := startConsumer(t, pooled, "engine", []string{"alpha"}, 1, func(ev outbox.ObservedEvent) bool { return ev.Sequence == 2 })
	waitCursor(t, ctx, pool, "alpha", "engine", 3)

	st := decode[[]outbox.ConsumerStatus](t, ctl(t, nil, "status", "--dsn", pooled, "--json"))
	require.Len(t, st, 1)
	require.Equal(t, int64(3), st[0].Head)
	dead := decode[[]outbox.DeadLetter](t, ctl(t, nil, "dead-letters", "--dsn", pooled, "--json"))
	require.Len(t, dead, 1)
	p.heal()
	r := ctl(t, nil, "replay", "--dsn", pooled, "--project", "alpha", "--consumer", "engine", "--reason", "FN-17", "--yes", "2")
	require.Equal(t, 0, r.code, "%s", r)
	waitUntil(t, ctx, "the replay", func() bool { return len(p.replays()) == 1 })
	r = ctl(t, nil, "prune", "--dsn", pooled, "--dry-run")
	require.Equal(t, 0, r.code, "%s", r)
	r = ctl(t, nil, "verify", "--dsn", pooled)
	require.Equal(t, 0, r.code, "%s", r)
}

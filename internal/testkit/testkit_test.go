package testkit_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// TestSeedEvents: seeded events are numbered from 1 in their project, named prefix-1 on, and
// deleted a second apart from the start of 2030 (SeedEvents) or 2031 (SeedMore), as the tests
// that seed them expect.
func TestSeedEvents(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.Pool(t, pgtest.NewDB(t).URL)
	testkit.SeedEvents(t, pool, "p", 3)
	testkit.SeedMore(t, pool, "p", "late", 2)
	testkit.SeedEvents(t, pool, "q", 1)
	type row struct {
		Project string
		Seq     int64
		TaskID  string
		Deleted string
	}
	var got []row
	for _, project := range []string{"p", "q"} {
		rows, err := pool.Query(ctx, `SELECT $1::text, sequence, task_id, to_char(deleted_at, 'YYYY-MM-DD HH24:MI:SS')
			FROM lifecycle_outbox_read($1, 0, 100, NULL, NULL, NULL)`, project)
		require.NoError(t, err)
		evs, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
		require.NoError(t, err)
		got = append(got, evs...)
	}
	require.Equal(t, []row{
		{"p", 1, "seed-1", "2030-01-01 00:00:01"},
		{"p", 2, "seed-2", "2030-01-01 00:00:02"},
		{"p", 3, "seed-3", "2030-01-01 00:00:03"},
		{"p", 4, "late-1", "2031-01-01 00:00:01"},
		{"p", 5, "late-2", "2031-01-01 00:00:02"},
		{"q", 1, "seed-1", "2030-01-01 00:00:01"},
	}, got)
}

// TestSessionStates: each pattern catches what it names and lets through its safe form.
func TestSessionStates(t *testing.T) {
	for _, c := range []struct {
		s         testkit.SessionState
		bad, fine string
	}{
		{testkit.SessionSet, "SET search_path = x", "SET LOCAL search_path = x"},
		{testkit.SessionSetConf, "SELECT set_config('a.b', 'c', false)", "SELECT set_config('a.b', 'c', true)"},
		{testkit.SessionLock, "SELECT pg_try_advisory_lock(1)", "SELECT pg_advisory_xact_lock(1)"},
		{testkit.SessionTemp, "CREATE TEMP TABLE x (a int)", "CREATE TABLE x (a int)"},
		{testkit.SessionPrepare, "PREPARE s AS SELECT 1", "SELECT 1"},
		{testkit.SessionListen, "LISTEN hints", "SELECT 'listen'"},
	} {
		require.Regexp(t, c.s.Re, c.bad, c.s.What)
		require.NotRegexp(t, c.s.Re, c.fine, c.s.What)
	}
	require.Len(t, testkit.SessionStates, 6)
}

// TestSentText: pgx numbers @name parameters in the order of their first use, and sends a
// statement without them as it is.
func TestSentText(t *testing.T) {
	require.Equal(t, "SELECT $1, $2, $1", testkit.SentText(t, "SELECT @b, @a, @b"))
	const numbered = "SELECT $1 WHERE a = '@x'"
	require.Equal(t, numbered, testkit.SentText(t, numbered))
}

func TestSeq(t *testing.T) {
	require.Equal(t, []int64{3, 4, 5}, testkit.Seq(3, 5))
	require.Empty(t, testkit.Seq(2, 1))
}

// TestCtx: a test's context is bounded, and ends with the test.
func TestCtx(t *testing.T) {
	var ctx context.Context
	t.Run("inner", func(t *testing.T) {
		ctx = testkit.Ctx(t)
		deadline, ok := ctx.Deadline()
		require.True(t, ok)
		require.Greater(t, time.Until(deadline), testkit.WaitLimit)
	})
	require.ErrorIs(t, ctx.Err(), context.Canceled)
}

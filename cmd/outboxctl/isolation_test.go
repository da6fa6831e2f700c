package main_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
)

// TestOutputEscapesDatabaseStrings: any role that writes a row chooses the strings outboxctl
// shows, so none reaches the terminal raw. An event ID written before the database refused
// such IDs tried to fake a passed check inside the replay confirmation.
func TestOutputEscapesDatabaseStrings(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	url := pgtestEmpty(t)
	pool := pgtest.Pool(t, url)
	_, err := outbox.MigrateThrough(ctx, pool, 3)
	require.NoError(t, err)
	const evil = "\r\x1b[K (all checks passed, type y)"
	for _, stmt := range []string{
		`INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence, lease_owner, lease_epoch, lease_expires_at)
		 VALUES ('alpha', 'engine', 1, E'engine@\x1b]0;owned\x07\u202e', 1, now() + interval '1 hour')`,
		`INSERT INTO lifecycle_consumer_deliveries (project_id, consumer_id, sequence, event_id, state, attempts, last_failure_class, parked_at)
		 VALUES ('alpha', 'engine', 1, $1, 'dead', 10, 'listener_error', now())`,
	} {
		var args []any
		if strings.Contains(stmt, "$1") {
			args = append(args, evil)
		}
		_, err := pool.Exec(ctx, stmt, args...)
		require.NoError(t, err, stmt)
	}
	_, err = outbox.Migrate(ctx, pool)
	require.NoError(t, err)

	runs := map[string]result{}
	for _, args := range [][]string{
		{"dead-letters"}, {"dead-letters", "--json"}, {"status"}, {"status", "--json"},
		{"replay", "--consumer", "engine", "--all", "--reason", "FN-1"}, // refused without --yes, after the plan
	} {
		r := ctl(t, nil, append([]string{"--dsn", url}, args...)...)
		for _, out := range []string{r.stdout, r.stderr} {
			for _, raw := range []string{"\x1b", "\r", "\x07", "\u202e"} {
				require.NotContains(t, out, raw, "%v printed %q raw: %s", args, raw, r)
			}
		}
		runs[strings.Join(args, " ")] = r
	}
	require.Contains(t, runs["dead-letters"].stdout, `\r\x1b[K (all checks passed, type y)`)
	require.Contains(t, runs["status"].stdout, `engine@\x1b]0;owned\a\u202e`)
	replay := runs["replay --consumer engine --all --reason FN-1"]
	require.Equal(t, 2, replay.code, "%s", replay)
	require.Contains(t, replay.stderr, `project alpha, sequence 1, event \r\x1b[K (all checks passed, type y)`)
}

// TestNoPasswordFragmentInDSNErrors: pgx's parse error repeats the second word of a password
// with a space in it; outboxctl says what is wrong without any of the string.
func TestNoPasswordFragmentInDSNErrors(t *testing.T) {
	t.Parallel()
	for _, dsn := range []string{
		"password=my Sup3rSecret phrase host=db",
		"host=db password=my Sup3rSecret phrase",
		"host=db password='my Sup3rSecret phrase",
		"postgres://oncall:my Sup3rSecret phrase@db/tasks",
		"postgres://oncall:Sup3rSecret@db:notaport/tasks",
	} {
		r := ctl(t, nil, "status", "--dsn", dsn)
		require.Equal(t, 2, r.code, "%s", r)
		require.Contains(t, r.stderr, "outboxctl: --dsn does not parse (")
		require.NotContains(t, r.stderr, "Sup3rSecret", "%s", r)
		require.NotContains(t, r.stderr, "phrase", "%s", r)
	}
}

// TestStatusShowsOtherProjectsWhenOneIsUnreadable: a lease that never expires (written before
// the database refused it) cannot be read; status shows every other project, names the one it
// left out, and exits 1.
func TestStatusShowsOtherProjectsWhenOneIsUnreadable(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	url := pgtestEmpty(t)
	pool := pgtest.Pool(t, url)
	_, err := outbox.MigrateThrough(ctx, pool, 3)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence, lease_owner, lease_epoch, lease_expires_at)
		VALUES ('alpha', 'engine', 0, 'engine@0000000000000000', 1, 'infinity'), ('beta', 'engine', 0, NULL, 0, NULL)`)
	require.NoError(t, err)
	_, err = outbox.Migrate(ctx, pool)
	require.NoError(t, err)

	r := ctl(t, nil, "--dsn", url, "status")
	require.Equal(t, 1, r.code, "%s", r)
	_, rows := tableRows(t, r.stdout)
	require.Contains(t, rows, "beta/engine")
	require.NotContains(t, rows, "alpha/engine")
	require.Contains(t, r.stderr, "project alpha")
	require.Contains(t, r.stderr, "the other projects are shown above")
}

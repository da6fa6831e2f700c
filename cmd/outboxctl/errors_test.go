package main_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"

	"fusion/outbox/internal/pgtest"
)

func pgtestEmpty(t *testing.T) string {
	t.Helper()
	return pgtest.NewEmptyDB(t).URL
}

func TestBadUsageExitsTwo(t *testing.T) {
	t.Parallel()
	dsn := []string{"DATABASE_URL=postgres://nobody@/nowhere?host=/nonexistent"} // never reached
	for _, c := range []struct {
		name string
		args []string
		want string
	}{
		{"no command", nil, "outboxctl: a command is required\n"},
		{"unknown command", []string{"stauts"}, "outboxctl: unknown command \"stauts\" for \"outboxctl\""},
		{"unknown flag", []string{"status", "--verbose"}, "outboxctl: unknown flag: --verbose\nRun 'outboxctl status --help' for usage.\n"},
		{"bad flag value", []string{"status", "--timeout", "soon"}, "invalid argument \"soon\" for \"--timeout\""},
		{"non-positive timeout", []string{"status", "--timeout", "0s"}, "--timeout must be positive"},
		{"unexpected argument", []string{"status", "alpha"}, "unknown command \"alpha\" for \"outboxctl status\""},
		{"missing --reason", []string{"retire", "--consumer", "c"}, "required flag(s) \"reason\" not set"},
		{"missing --consumer", []string{"retire", "--reason", "FN-1"}, "retire needs --consumer"},
		{"missing --project", []string{"replay", "--consumer", "c", "--reason", "FN-1", "1"}, "replay needs --project"},
		{"missing sequence", []string{"replay", "--project", "p", "--consumer", "c", "--reason", "FN-1"}, "replay needs the SEQUENCE"},
		{"bad sequence", []string{"replay", "--project", "p", "--consumer", "c", "--reason", "FN-1", "two"}, "SEQUENCE must be a positive integer (got \"two\")"},
		{"bad consumer ID", []string{"status", "--consumer", "two words"}, "--consumer: consumer ID \"two words\" contains whitespace"},
		{"bad actor", []string{"retire", "--consumer", "c", "--reason", "FN-1", "--actor", "Jane Doe"}, "--actor must be an identifier"},
		{"dry run and --yes", []string{"prune", "--dry-run", "--yes"}, "[dry-run yes] were all set"},
		{"short window", []string{"prune", "--dry-run", "--retention-window", "5m"}, "--retention-window must be at least 1h"},
		{"filter on migrate", []string{"migrate", "--project", "p"}, "migrate does not take --project"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			r := ctl(t, dsn, c.args...)
			require.Equal(t, 2, r.code, "%s", r)
			require.Contains(t, r.stderr, c.want)
			require.Contains(t, r.stderr, "--help' for usage.")
			require.Empty(t, r.stdout)
		})
	}
}

func TestConnectionErrors(t *testing.T) {
	t.Parallel()
	t.Run("no database given", func(t *testing.T) {
		r := ctl(t, nil, "status")
		require.Equal(t, 2, r.code, "%s", r)
		require.Contains(t, r.stderr, "outboxctl: no database given: pass --dsn or set DATABASE_URL\n")
	})
	t.Run("a DSN that does not parse", func(t *testing.T) {
		for _, dsn := range []string{"postgres://oncall:hunter2@db:notaport/tasks", "host=db password=hunter2 port=notaport", "this is not a dsn"} {
			r := ctl(t, nil, "status", "--dsn", dsn)
			require.Equal(t, 1, r.code, "%s", r)
			require.Contains(t, r.stderr, "outboxctl: the DSN does not parse (")
			require.Contains(t, r.stderr, "give a URL such as postgres://user@host:5432/dbname")
			require.NotContains(t, r.stderr, "hunter2", "the password is never echoed")
		}
	})
	t.Run("an unreachable database", func(t *testing.T) {
		r := ctl(t, nil, "status", "--dsn", "host=/nonexistent/outboxctl port=5432 dbname=tasks user=oncall connect_timeout=5")
		require.Equal(t, 1, r.code, "%s", r)
		require.Contains(t, r.stderr, `outboxctl: cannot connect to database "tasks" on /nonexistent/outboxctl:5432 as user "oncall": `)
	})
	t.Run("a schema ahead of this build", func(t *testing.T) {
		db := pgtest.NewDB(t)
		pool := pgtest.Pool(t, db.URL)
		_, err := pool.Exec(context.Background(), `INSERT INTO lifecycle_outbox_schema (version, name, checksum) VALUES (6, 'future', 'f00')`)
		require.NoError(t, err)
		r := ctl(t, nil, "dead-letters", "--dsn", db.URL)
		require.Equal(t, 1, r.code, "%s", r)
		require.Contains(t, r.stderr, "database schema is ahead of this build: database has version 6 (future), this build knows up to 5; this outboxctl is older")
	})
}

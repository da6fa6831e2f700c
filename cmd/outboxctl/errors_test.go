package main_test

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
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
			require.Equal(t, 2, r.code, "an invalid flag value is bad usage, as --help says: %s", r)
			require.Contains(t, r.stderr, "outboxctl: --dsn does not parse (")
			require.Contains(t, r.stderr, "give a URL such as postgres://user@host:5432/dbname")
			require.Contains(t, r.stderr, "Run 'outboxctl status --help' for usage.")
			require.NotContains(t, r.stderr, "hunter2", "the password is never echoed")
			require.NotContains(t, r.stderr, dsn, "the DSN is never echoed")
		}
		r := ctl(t, []string{"DATABASE_URL=postgres://oncall:hunter2@db:notaport/tasks"}, "status")
		require.Equal(t, 2, r.code, "%s", r)
		require.Contains(t, r.stderr, "outboxctl: $DATABASE_URL does not parse (the port is not a number from 1 to 65535)")
		require.NotContains(t, r.stderr, "hunter2", "the password is never echoed")
	})
	t.Run("no server at a socket directory", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "nonexistent")
		r := ctl(t, nil, "status", "--dsn", "host="+dir+" port=5432 dbname=tasks user=oncall password=hunter2 connect_timeout=5")
		require.Equal(t, 1, r.code, "%s", r)
		requireOneLine(t, r.stderr)
		require.Equal(t, 1, strings.Count(r.stderr, dir), "the socket path once: %s", r.stderr)
		require.Equal(t, fmt.Sprintf("outboxctl: cannot connect to database \"tasks\" as user \"oncall\" at %s/.s.PGSQL.5432: dial error: connect: no such file or directory\n", dir), r.stderr)
		require.NotContains(t, r.stderr, "hunter2")

		r = ctl(t, nil, "status", "--dsn", "host="+dir+" user=oncall connect_timeout=5")
		require.Equal(t, 1, r.code, "%s", r)
		requireOneLine(t, r.stderr)
		require.NotContains(t, r.stderr, `database ""`)
		require.NotContains(t, r.stderr, "database", "no database named, none printed")
		require.Equal(t, 1, strings.Count(r.stderr, dir), "the socket path once: %s", r.stderr)
	})
	t.Run("a closed TCP port", func(t *testing.T) {
		const addr = "127.0.0.1:1" // a privileged port nothing listens on
		r := ctl(t, nil, "status", "--dsn", "postgres://oncall:hunter2@"+addr+"/?connect_timeout=5")
		require.Equal(t, 1, r.code, "%s", r)
		requireOneLine(t, r.stderr)
		require.Equal(t, 1, strings.Count(r.stderr, addr), "the address once: %s", r.stderr)
		require.Equal(t, 1, strings.Count(r.stderr, "connection refused"), "the cause once (sslmode=prefer tries twice): %s", r.stderr)
		require.Equal(t, fmt.Sprintf("outboxctl: cannot connect as user \"oncall\" at %s: dial error: connect: connection refused\n", addr), r.stderr)
		require.NotContains(t, r.stderr, "hunter2")
	})
	t.Run("a database the server does not have", func(t *testing.T) {
		db := pgtest.NewEmptyDB(t)
		url := strings.Replace(db.URL, "/"+db.Name, "/"+db.Name+"_missing", 1)
		require.NotEqual(t, db.URL, url)
		r := ctl(t, nil, "status", "--dsn", url)
		require.Equal(t, 1, r.code, "%s", r)
		requireOneLine(t, r.stderr)
		require.Equal(t, 1, strings.Count(r.stderr, "server error: FATAL: database \""+db.Name+"_missing\" does not exist (SQLSTATE 3D000)"),
			"the server's cause once: %s", r.stderr)
		require.Contains(t, r.stderr, "outboxctl: cannot connect to database \""+db.Name+"_missing\" as user ")
	})
	t.Run("a schema ahead of this build", func(t *testing.T) {
		db := pgtest.NewDB(t)
		pool := pgtest.Pool(t, db.URL)
		_, err := pool.Exec(context.Background(), `INSERT INTO lifecycle_outbox_schema (version, name, checksum) VALUES ($1, 'future', 'f00')`, outbox.SchemaVersion+1)
		require.NoError(t, err)
		r := ctl(t, nil, "dead-letters", "--dsn", db.URL)
		require.Equal(t, 1, r.code, "%s", r)
		require.Contains(t, r.stderr, fmt.Sprintf("database schema is ahead of this build: database has version %d (future), this build knows up to %d; this outboxctl is older",
			outbox.SchemaVersion+1, outbox.SchemaVersion))
	})
}

// requireOneLine checks that an error message is one line, without a newline escaped into it.
func requireOneLine(t *testing.T, stderr string) {
	t.Helper()
	require.Equal(t, 1, strings.Count(stderr, "\n"), "one line: %q", stderr)
	require.True(t, strings.HasSuffix(stderr, "\n"), "%q", stderr)
	require.NotContains(t, stderr, `\n`, "no literal \\n")
}

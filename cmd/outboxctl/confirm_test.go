package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
)

// On a terminal the operator is asked; the answer decides. (The tests in package main_test
// run the binary with stdin not a terminal, where --yes is required.)
func TestInteractiveConfirmation(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmptyDB(t)
	migrate := func(answer string) (int, string, string) {
		var stdout, stderr bytes.Buffer
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		code := run(ctx, []string{"--dsn", db.URL, "migrate"}, console{
			stdin: strings.NewReader(answer), stdout: &stdout, stderr: &stderr,
			getenv: func(string) string { return "" }, isTerminal: func() bool { return true },
		})
		return code, stdout.String(), stderr.String()
	}
	verify := func() error {
		pool := pgtest.Pool(t, db.URL)
		return outbox.VerifySchema(context.Background(), pool)
	}

	for _, answer := range []string{"n\n", "\n", "", "maybe\n"} {
		code, stdout, stderr := migrate(answer)
		require.Equal(t, exitFailure, code, "answer %q", answer)
		require.Empty(t, stdout)
		require.Contains(t, stderr, "outboxctl will apply 5 migrations")
		require.Contains(t, stderr, "Migrate? [y/N] ")
		require.True(t, strings.HasSuffix(stderr, "outboxctl: not confirmed: nothing was changed\n"), "%q", stderr)
		require.ErrorIs(t, verify(), outbox.ErrSchemaBehind, "answer %q changed nothing", answer)
	}
	code, stdout, stderr := migrate("yes\n")
	require.Equal(t, exitOK, code, "%s", stderr)
	require.Equal(t, "applied migrations 1, 2, 3, 4, 5; the schema is at version 5\n", stdout)
	require.NoError(t, verify())
}

func TestOperatorDefaultsToTheOSUser(t *testing.T) {
	t.Parallel()
	f := changeFlags{reason: "FN-1"}
	op, err := f.operator()
	require.NoError(t, err)
	require.NotEmpty(t, op.Actor)
	require.Equal(t, "FN-1", op.Reason)
}

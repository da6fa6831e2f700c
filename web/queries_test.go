package web_test

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/web"
)

// The package's own SQL gets the checks the core's gets (internal/testkit, as queries_test.go
// and pooler_path_test.go at the module root use them): every statement prepares against the
// migrated schema, and none keeps session state on a pooled connection.

func TestEveryStatementPrepares(t *testing.T) {
	t.Parallel()
	testkit.PrepareEveryStatement(t, testkit.Ctx(t), web.Statements)
}

// TestNoSessionStateInTheSource: the event stream reads through the host's pool, which may sit
// behind a transaction pooler, so it sets nothing at session level, takes no session lock,
// creates no temporary table, prepares no named statement and never LISTENs.
func TestNoSessionStateInTheSource(t *testing.T) {
	t.Parallel()
	testkit.RequireNoSessionState(t, web.Statements, nil)
	for _, name := range testkit.GoFiles(t) {
		testkit.RequireNoSessionStateInSource(t, name, false, false)
	}
}

// TestMaxIDLenIsTheCoresLimit holds the bound of a request's query to the core's identifier
// rules.
func TestMaxIDLenIsTheCoresLimit(t *testing.T) {
	require.NoError(t, outbox.ValidateProjectID(strings.Repeat("a", web.MaxIDLen)))
	require.Error(t, outbox.ValidateProjectID(strings.Repeat("a", web.MaxIDLen+1)))
}

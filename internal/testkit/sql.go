package testkit

import (
	"context"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"fusion/outbox/internal/pgtest"
)

// The checks every package's SQL gets, over the map of its statements by the name of their
// constants that its export_test.go exports as Statements: every statement prepares against the
// migrated schema, and none keeps session state on a pooled connection. They read the package's
// source from the directory the test runs in, which go test makes the package's own.

// GoFiles lists the package's Go files, its tests aside, sorted.
func GoFiles(t testing.TB) []string {
	t.Helper()
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	var out []string
	for _, f := range files {
		if !strings.HasSuffix(f, "_test.go") {
			out = append(out, f)
		}
	}
	sort.Strings(out)
	return out
}

// SQLConstants lists the package's constants whose names end in SQL, read from its source.
func SQLConstants(t testing.TB) []string {
	t.Helper()
	var names []string
	fset := token.NewFileSet()
	for _, f := range GoFiles(t) {
		file, err := parser.ParseFile(fset, f, nil, 0)
		require.NoError(t, err)
		for _, decl := range file.Decls {
			gen, ok := decl.(*ast.GenDecl)
			if !ok || gen.Tok != token.CONST {
				continue
			}
			for _, spec := range gen.Specs {
				for _, n := range spec.(*ast.ValueSpec).Names {
					if strings.HasSuffix(n.Name, "SQL") {
						names = append(names, n.Name)
					}
				}
			}
		}
	}
	sort.Strings(names)
	return names
}

// PrepareEveryStatement requires statements to list every SQL constant of the package, and
// prepares each, as pgx sends it (SentText), against a new migrated database, so a typo, a
// renamed column or a type mismatch fails there rather than in production. It returns their
// descriptions by name.
func PrepareEveryStatement(t testing.TB, ctx context.Context, statements map[string]string) map[string]*pgconn.StatementDescription {
	t.Helper()
	names := SQLConstants(t)
	var listed []string
	for name := range statements {
		listed = append(listed, name)
	}
	sort.Strings(listed)
	require.Equal(t, names, listed, "export_test.go's Statements must list every SQL constant")

	conn, err := pgx.Connect(ctx, pgtest.NewDB(t).URL)
	require.NoError(t, err)
	defer conn.Close(ctx)
	described := map[string]*pgconn.StatementDescription{}
	for _, name := range names {
		sd, err := conn.Prepare(ctx, name, SentText(t, statements[name]))
		require.NoError(t, err, name)
		described[name] = sd
	}
	return described
}

// SentText is the text pgx sends for sql: its @name parameters rewritten to $n, numbered in
// the order of their first use, as pgx.NamedArgs does at a call site. A statement without
// @name parameters is sent as it is.
func SentText(t testing.TB, sql string) string {
	t.Helper()
	sent, _, err := pgx.NamedArgs{}.RewriteQuery(context.Background(), nil, sql, nil)
	require.NoError(t, err)
	return sent
}

// SessionState is something a statement run on a pooled connection must not do: behind a
// transaction pooler the next transaction on that server connection may be another client's.
type SessionState struct {
	What string
	Re   *regexp.Regexp
}

// What a pooled statement must not do.
var (
	SessionSet     = SessionState{"a session-level SET (use set_config(name, value, true) or SET LOCAL)", regexp.MustCompile(`(?is)^\s*(SET|RESET)\s+(SESSION\s+)?[a-z_.]+\s*(=|TO\b)`)}
	SessionSetConf = SessionState{"set_config at session level", regexp.MustCompile(`(?i)set_config\([^)]*,\s*false\s*\)`)}
	SessionLock    = SessionState{"a session advisory lock (use pg_advisory_xact_lock)", regexp.MustCompile(`(?i)pg_(try_)?advisory_lock(_shared)?\s*\(`)}
	SessionTemp    = SessionState{"a temporary table", regexp.MustCompile(`(?i)CREATE\s+(GLOBAL\s+|LOCAL\s+)?TEMP(ORARY)?\s`)}
	SessionPrepare = SessionState{"a named prepared statement", regexp.MustCompile(`(?i)\bPREPARE\s+[a-z_]`)}
	SessionListen  = SessionState{"LISTEN", regexp.MustCompile(`(?i)\bLISTEN\s+`)}
	// SessionStates lists them all.
	SessionStates = []SessionState{SessionSet, SessionSetConf, SessionLock, SessionTemp, SessionPrepare, SessionListen}
)

// RequireNoSessionState fails for every statement that does one of SessionStates, but for what
// allowed (which may be nil) allows the statement of that name.
func RequireNoSessionState(t testing.TB, statements map[string]string, allowed func(name string, s SessionState) bool) {
	t.Helper()
	for name, sql := range statements {
		for _, s := range SessionStates {
			if allowed != nil && allowed(name, s) {
				continue
			}
			require.False(t, s.Re.MatchString(sql), "%s contains %s", name, s.What)
		}
	}
}

// RequireNoSessionStateInSource reads the package's Go file name and fails if it calls Prepare
// (named prepared statements do not survive a transaction pooler) or, unless told it may,
// LISTENs or takes a session advisory lock outside the SQL constants. It returns the source.
func RequireNoSessionStateInSource(t testing.TB, name string, mayListen, mayLock bool) string {
	t.Helper()
	b, err := os.ReadFile(name)
	require.NoError(t, err)
	src := string(b)
	require.NotContains(t, src, ".Prepare(", "%s: named prepared statements do not survive a transaction pooler", name)
	if !mayListen {
		require.NotRegexp(t, `"(UN)?LISTEN `, src, "%s: LISTEN belongs to a dedicated connection (the core's listen.go)", name)
	}
	if !mayLock {
		require.NotRegexp(t, `(?i)pg_(try_)?advisory_lock(_shared)?\(`, src, "%s: session advisory lock", name)
	}
	return src
}

package web

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
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
)

// The package's own SQL gets the checks the core's gets (queries_test.go and
// pooler_path_test.go at the module root): every statement prepares against the migrated
// schema, and none keeps session state on a pooled connection.

// statements is every SQL statement the package runs, by the name of its constant.
var statements = map[string]string{
	"sseHeadSQL": sseHeadSQL,
	"ssePageSQL": ssePageSQL,
}

// sqlConstants lists the package's constants whose names end in SQL, read from its source.
func sqlConstants(t *testing.T) []string {
	t.Helper()
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	var names []string
	fset := token.NewFileSet()
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
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

func TestEveryStatementPrepares(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	names := sqlConstants(t)
	var listed []string
	for name := range statements {
		listed = append(listed, name)
	}
	sort.Strings(listed)
	require.Equal(t, names, listed, "queries_test.go's statements must list every SQL constant")

	conn, err := pgx.Connect(ctx, pgtest.NewDB(t).URL)
	require.NoError(t, err)
	defer conn.Close(ctx)
	for _, name := range names {
		_, err := conn.Prepare(ctx, name, statements[name])
		require.NoError(t, err, name)
	}
}

// TestNoSessionStateInTheSource: the event stream reads through the host's pool, which may sit
// behind a transaction pooler, so it sets nothing at session level, takes no session lock,
// creates no temporary table, prepares no named statement and never LISTENs.
func TestNoSessionStateInTheSource(t *testing.T) {
	t.Parallel()
	forbidden := []struct {
		what string
		re   *regexp.Regexp
	}{
		{"a session-level SET", regexp.MustCompile(`(?is)^\s*(SET|RESET)\s+(SESSION\s+)?[a-z_.]+\s*(=|TO\b)`)},
		{"set_config at session level", regexp.MustCompile(`(?i)set_config\([^)]*,\s*false\s*\)`)},
		{"a session advisory lock", regexp.MustCompile(`(?i)pg_(try_)?advisory_lock(_shared)?\s*\(`)},
		{"a temporary table", regexp.MustCompile(`(?i)CREATE\s+(GLOBAL\s+|LOCAL\s+)?TEMP(ORARY)?\s`)},
		{"a named prepared statement", regexp.MustCompile(`(?i)\bPREPARE\s+[a-z_]`)},
		{"LISTEN", regexp.MustCompile(`(?i)\bLISTEN\s+`)},
	}
	for name, sql := range statements {
		for _, f := range forbidden {
			require.False(t, f.re.MatchString(sql), "%s contains %s", name, f.what)
		}
	}
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		b, err := os.ReadFile(name)
		require.NoError(t, err)
		src := string(b)
		require.NotContains(t, src, ".Prepare(", "%s: named prepared statements do not survive a transaction pooler", name)
		require.NotRegexp(t, `"(UN)?LISTEN `, src, "%s: the event stream does not LISTEN", name)
		require.NotRegexp(t, `(?i)pg_(try_)?advisory_lock(_shared)?\(`, src, "%s: session advisory lock", name)
	}
}

// TestMaxIDLenIsTheCoresLimit holds the bound of a request's query to the core's identifier
// rules.
func TestMaxIDLenIsTheCoresLimit(t *testing.T) {
	require.NoError(t, outbox.ValidateProjectID(strings.Repeat("a", maxIDLen)))
	require.Error(t, outbox.ValidateProjectID(strings.Repeat("a", maxIDLen+1)))
}

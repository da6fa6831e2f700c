package outbox_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
)

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

// TestEveryStatementPrepares prepares every statement the package runs against the migrated
// schema, so a typo, a renamed column or a type mismatch fails here rather than in production.
func TestEveryStatementPrepares(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	names := sqlConstants(t)
	var listed []string
	for name := range outbox.Statements {
		listed = append(listed, name)
	}
	sort.Strings(listed)
	require.Equal(t, names, listed, "export_test.go's Statements must list every SQL constant")

	conn, err := pgx.Connect(ctx, pgtest.NewDB(t).URL)
	require.NoError(t, err)
	defer conn.Close(ctx)
	for _, name := range names {
		_, err := conn.Prepare(ctx, name, outbox.Statements[name])
		require.NoError(t, err, name)
	}
}

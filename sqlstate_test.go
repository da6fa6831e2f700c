package outbox_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgerrcode"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
)

// raisedCode finds the SQLSTATE of a RAISE in the schema's functions.
var raisedCode = regexp.MustCompile(`ERRCODE\s*=\s*'([0-9A-Z]{5})'`)

// moduleCode finds one of the module's own SQLSTATEs (class LX) named in the docs.
var moduleCode = regexp.MustCompile("`(LX[0-9A-Z]{3})`")

// TestModuleSQLStates: every SQLSTATE the current schema (schema.sql) raises is one Go knows:
// the module's own class LX declared in sqlstate.go, or a standard one pgerrcode names; the
// docs name no module code Go does not declare; and every declared code is still raised. No
// database needed.
func TestModuleSQLStates(t *testing.T) {
	t.Parallel()
	declared := sqlstateConstants(t)
	require.Equal(t, declared, outbox.ModuleSQLStates, "export_sqlstate_test.go's ModuleSQLStates must list sqlstate.go's constants")
	known := map[string]bool{}
	for name, code := range declared {
		require.Regexp(t, `^LX[0-9A-Z]{3}$`, code, "%s is not in the module's class LX", name)
		require.False(t, known[code], "%s: %s is declared twice", name, code)
		known[code] = true
	}

	schema, err := os.ReadFile("schema.sql")
	require.NoError(t, err)
	raised := map[string]bool{}
	for _, m := range raisedCode.FindAllStringSubmatch(string(schema), -1) {
		code := m[1]
		raised[code] = true
		if strings.HasPrefix(code, "LX") {
			require.True(t, known[code], "schema.sql raises %s, which sqlstate.go does not declare", code)
		} else {
			require.NotEmpty(t, pgerrcode.Name(code), "schema.sql raises %s, which is neither the module's (class LX) nor a standard SQLSTATE", code)
		}
	}
	for name, code := range declared {
		require.True(t, raised[code], "%s (%s) is declared but schema.sql no longer raises it", name, code)
	}

	docs, err := os.ReadFile("docs/operations.md")
	require.NoError(t, err)
	for _, m := range moduleCode.FindAllStringSubmatch(string(docs), -1) {
		require.True(t, known[m[1]], "docs/operations.md names %s, which sqlstate.go does not declare", m[1])
	}
}

// sqlstateConstants reads sqlstate.go's constants: name and SQLSTATE.
func sqlstateConstants(t *testing.T) map[string]string {
	t.Helper()
	file, err := parser.ParseFile(token.NewFileSet(), "sqlstate.go", nil, 0)
	require.NoError(t, err)
	out := map[string]string{}
	for _, decl := range file.Decls {
		gen, ok := decl.(*ast.GenDecl)
		if !ok || gen.Tok != token.CONST {
			continue
		}
		for _, spec := range gen.Specs {
			vs := spec.(*ast.ValueSpec)
			for i, n := range vs.Names {
				lit, ok := vs.Values[i].(*ast.BasicLit)
				require.True(t, ok && lit.Kind == token.STRING, "%s must be a string literal", n.Name)
				code, err := strconv.Unquote(lit.Value)
				require.NoError(t, err)
				out[n.Name] = code
			}
		}
	}
	require.NotEmpty(t, out, "sqlstate.go declares no SQLSTATE")
	return out
}

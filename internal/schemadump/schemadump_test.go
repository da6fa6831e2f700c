package schemadump_test

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"fusion/outbox"
	"fusion/outbox/internal/pgcluster"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/schemadump"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

// update rewrites schema.sql instead of comparing it: `make schema`.
var update = flag.Bool("update", false, "rewrite schema.sql from a freshly migrated database")

// schemaFile is schema.sql at the module root, from this package's directory.
var schemaFile = filepath.Join("..", "..", "schema.sql")

// bookkeepingTable is the table in which the module's migration applier records versions.
const bookkeepingTable = "lifecycle_outbox_schema"

// TestSchemaSQLIsCurrent migrates an empty database with the module's migrations only, dumps
// it and checks that schema.sql is exactly that dump, formatted.
func TestSchemaSQLIsCurrent(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	db := pgtest.NewEmptyDB(t)
	conn, err := pgx.Connect(ctx, db.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if _, err := outbox.Migrate(ctx, conn); err != nil {
		t.Fatal(err)
	}
	var schema string
	var major int
	if err := conn.QueryRow(ctx, `SELECT pg_catalog.current_schema(),
	    pg_catalog.current_setting('server_version_num')::integer OPERATOR(pg_catalog./) 10000`).Scan(&schema, &major); err != nil {
		t.Fatal(err)
	}

	dump := pgDump(t, ctx, db)
	got, err := schemadump.Format(dump, schemadump.Options{
		Header:           header(major),
		Schema:           schema,
		BookkeepingTable: bookkeepingTable,
	})
	if err != nil {
		t.Fatalf("format the dump: %v", err)
	}
	if *update {
		if err := os.WriteFile(schemaFile, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("wrote %s (%d lines)", schemaFile, strings.Count(got, "\n"))
		return
	}
	want, err := os.ReadFile(schemaFile)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	if string(want) != got {
		t.Fatalf("schema.sql is not the schema a freshly migrated database has; run `make schema` and review `git diff schema.sql`.\n%s",
			diffSummary(string(want), got))
	}
}

// header is schema.sql's opening comment.
func header(major int) string {
	return fmt.Sprintf(`The outbox module's whole schema as a freshly migrated database has it (schema version %d).

GENERATED: do not edit. `+"`make schema`"+` rewrites this file: it applies migrations/*.up.sql to an
empty throwaway database on PostgreSQL %d and formats pg_dump's schema-only dump of it
(internal/schemadump). TestSchemaSQLIsCurrent there fails, under `+"`make test`"+`, when it differs.

This file is for reading. The module never applies it: the numbered migrations (Migrate,
outboxctl migrate) stay the only way to build or change a database.

Names are unqualified, as the migrations write them: the objects live in the schema the
migrations run in (here public, which the functions' pinned search_path names).
Privileges: only what PUBLIC may do appears. Grants to the writer, consumer and operator
roles (GrantWriterRole, GrantConsumerRole, GrantOperatorRole, and the migrations' own grants
to roles that already held the module's privileges when they ran) name roles a deployment
creates, so they are left out, as are owners.`, outbox.SchemaVersion, major)
}

// pgDump dumps db's schema with the installed pg_dump: the throwaway cluster's own tools when
// the tests run on one, else the pg_dump of the newest installed server or on PATH.
func pgDump(t *testing.T, ctx context.Context, db pgtest.DB) string {
	t.Helper()
	var cmd *exec.Cmd
	if c := pgtest.Cluster(t); c != nil {
		cmd = c.Command(ctx, "pg_dump", append(schemadump.Args, "--dbname="+c.DSN(db.Name))...)
	} else {
		bin := "pg_dump"
		if dir, err := pgcluster.FindBinDir(); err == nil {
			bin = filepath.Join(dir, "pg_dump")
		}
		path, err := exec.LookPath(bin)
		if err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("CI=true and no pg_dump: %v", err)
			}
			t.Skipf("no pg_dump to dump the schema with: %v", err)
		}
		cmd = exec.CommandContext(ctx, path, append(schemadump.Args, "--dbname="+db.URL)...)
	}
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("pg_dump: %v: %s", err, stderr.String())
	}
	return out.String()
}

// diffSummary lists the lines that differ between the committed file and the fresh dump,
// as runs of removed (-) and added (+) lines headed by their line numbers, at most maxShown
// lines in all.
func diffSummary(want, got string) string {
	if want == "" {
		return "schema.sql is missing or empty"
	}
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	var b strings.Builder
	ops := lineDiff(w, g)
	removed, added := 0, 0
	for _, op := range ops {
		switch op.kind {
		case '-':
			removed++
		case '+':
			added++
		}
	}
	changed := removed + added
	fmt.Fprintf(&b, "schema.sql has %d lines, the fresh dump %d; %d lines of schema.sql (-) are not in the dump, which has %d others (+):\n",
		len(w), len(g), removed, added)
	const maxShown = 40
	shown := 0
	for i := 0; i < len(ops); i++ {
		if ops[i].kind == ' ' {
			continue
		}
		if shown == maxShown {
			fmt.Fprintf(&b, "... and %d more\n", changed-shown)
			break
		}
		fmt.Fprintf(&b, "@@ schema.sql line %d, fresh dump line %d\n", ops[i].w+1, ops[i].g+1)
		for ; i < len(ops) && ops[i].kind != ' ' && shown < maxShown; i++ {
			fmt.Fprintf(&b, "%c %s\n", ops[i].kind, ops[i].line)
			shown++
		}
		i-- // the loop's i++ steps past the run
	}
	return b.String()
}

// diffOp is one line of a line diff: kept (' '), only in schema.sql ('-') or only in the dump
// ('+'), with the line numbers (from 0) it is at in each.
type diffOp struct {
	kind rune
	line string
	w, g int
}

// lineDiff is a longest-common-subsequence diff of the lines between the two texts' common
// head and tail. Past a size it would be slow for, the whole middle is one change.
func lineDiff(w, g []string) []diffOp {
	pre := 0
	for pre < len(w) && pre < len(g) && w[pre] == g[pre] {
		pre++
	}
	suf := 0
	for suf < len(w)-pre && suf < len(g)-pre && w[len(w)-1-suf] == g[len(g)-1-suf] {
		suf++
	}
	mw, mg := w[pre:len(w)-suf], g[pre:len(g)-suf]
	var ops []diffOp
	if len(mw)*len(mg) > 16<<20 {
		for i, l := range mw {
			ops = append(ops, diffOp{'-', l, pre + i, pre})
		}
		for j, l := range mg {
			ops = append(ops, diffOp{'+', l, pre + len(mw), pre + j})
		}
		return ops
	}
	// lcs[i][j] is the length of the longest common subsequence of mw[i:] and mg[j:].
	lcs := make([][]int32, len(mw)+1)
	for i := range lcs {
		lcs[i] = make([]int32, len(mg)+1)
	}
	for i := len(mw) - 1; i >= 0; i-- {
		for j := len(mg) - 1; j >= 0; j-- {
			if mw[i] == mg[j] {
				lcs[i][j] = lcs[i+1][j+1] + 1
			} else {
				lcs[i][j] = max(lcs[i+1][j], lcs[i][j+1])
			}
		}
	}
	i, j := 0, 0
	for i < len(mw) || j < len(mg) {
		switch {
		case i < len(mw) && j < len(mg) && mw[i] == mg[j]:
			ops = append(ops, diffOp{' ', mw[i], pre + i, pre + j})
			i, j = i+1, j+1
		case j == len(mg) || (i < len(mw) && lcs[i+1][j] >= lcs[i][j+1]):
			ops = append(ops, diffOp{'-', mw[i], pre + i, pre + j})
			i++
		default:
			ops = append(ops, diffOp{'+', mg[j], pre + i, pre + j})
			j++
		}
	}
	return ops
}

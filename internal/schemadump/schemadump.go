// Package schemadump turns pg_dump's schema-only output of a freshly migrated database into
// schema.sql: the outbox module's whole current schema in one readable file, for reviewers.
//
// The module never applies that file; its migrations stay the only way to build a database.
// The test of this package regenerates the file from a throwaway database and fails when the
// committed copy differs (`make schema` rewrites it).
//
// Format reorders pg_dump's entries into sections (types and domains; tables with their keys,
// indexes and identity columns; functions; row-level security; views; the migrations'
// bookkeeping table), drops what varies between runs or machines (the SET preamble, version
// lines, the \restrict key, pg_dump's per-entry comments, owners) and keeps, of the
// privileges, only those of PUBLIC: grants to roles name roles a deployment creates.
package schemadump

import (
	"errors"
	"fmt"
	"regexp"
	"sort"
	"strings"
)

// Args are pg_dump's options for the dump Format expects; the caller adds the connection.
// Privileges and comments are dumped (Format keeps the privileges of PUBLIC); owners,
// tablespaces and table access methods are not.
var Args = []string{
	"--schema-only", "--no-owner", "--no-tablespaces", "--no-table-access-method",
	"--no-security-labels", "--no-publications", "--no-subscriptions",
}

// Options describe the database that was dumped.
type Options struct {
	// Header is the file's opening comment, without the comment markers: each line gets "-- ".
	Header string
	// Schema is the schema the migrations ran in ("public"). Its qualifier is dropped from
	// names outside function bodies, so the file reads as the migrations are written.
	Schema string
	// BookkeepingTable is the migration applier's own table, shown in a section of its own.
	BookkeepingTable string
}

// entry is one object of pg_dump's table of contents, with its statements.
type entry struct {
	name, kind, schema string
	text               string
	pos                int // position in pg_dump's output, which orders dependencies first
}

// entryHeader is the comment pg_dump puts before each entry's statements.
var entryHeader = regexp.MustCompile(`(?m)^--\n-- Name: (.*); Type: (.*); Schema: (.*); Owner: .*\n--\n`)

// parse splits a plain-format pg_dump into its entries, dropping the preamble before the first.
func parse(dump string) ([]entry, error) {
	dump = strings.ReplaceAll(dump, "\r\n", "\n")
	locs := entryHeader.FindAllStringSubmatchIndex(dump, -1)
	if len(locs) == 0 {
		return nil, errors.New("no entries: is this pg_dump's plain-format output?")
	}
	var out []entry
	for i, l := range locs {
		end := len(dump)
		if i+1 < len(locs) {
			end = locs[i+1][0]
		}
		out = append(out, entry{
			name:   dump[l[2]:l[3]],
			kind:   dump[l[4]:l[5]],
			schema: dump[l[6]:l[7]],
			text:   dump[l[1]:end],
			pos:    i,
		})
	}
	return out, nil
}

// trailer is what pg_dump writes after an entry's statements, or between entries: session
// settings for the entries that follow, the end marker, the \restrict key.
var trailer = regexp.MustCompile(`^(SET [a-z_]+ = .*;|SELECT pg_catalog\.set_config\(.*\);|\\(un)?restrict .*|--|-- PostgreSQL database dump complete|)$`)

// clean trims an entry's text to its own statements.
func clean(text string) string {
	lines := strings.Split(text, "\n")
	for len(lines) > 0 && trailer.MatchString(lines[len(lines)-1]) {
		lines = lines[:len(lines)-1]
	}
	for len(lines) > 0 && lines[0] == "" {
		lines = lines[1:]
	}
	return strings.Join(lines, "\n")
}

// publicPrivilege matches a GRANT or REVOKE whose grantee is PUBLIC.
var publicPrivilege = regexp.MustCompile(`^(GRANT|REVOKE) .* (TO|FROM) PUBLIC;$`)

// keepPublic keeps an ACL entry's statements about PUBLIC; the others name roles.
func keepPublic(text string) string {
	var kept []string
	for _, line := range strings.Split(text, "\n") {
		if publicPrivilege.MatchString(line) {
			kept = append(kept, line)
		}
	}
	return strings.Join(kept, "\n")
}

// unqualify drops "schema." before names, except inside a function's body, which pg_dump
// prints as written (dollar-quoted, after a line "    AS $...").
func unqualify(e entry, schema string) string {
	if schema == "" {
		return e.text
	}
	qualified := regexp.MustCompile(`(^|[^A-Za-z0-9_."$])` + regexp.QuoteMeta(schema) + `\.`)
	lines := strings.Split(e.text, "\n")
	for i, line := range lines {
		if isRoutine(e.kind) && strings.HasPrefix(line, "    AS $") {
			break
		}
		lines[i] = qualified.ReplaceAllString(line, "$1")
	}
	return strings.Join(lines, "\n")
}

func isRoutine(kind string) bool {
	return kind == "FUNCTION" || kind == "PROCEDURE" || kind == "AGGREGATE"
}

// Sections of the file, in order.
const (
	secTypes = iota
	secTables
	secFunctions
	secSecurity
	secViews
	secBookkeeping
	secOther
	numSections
)

var sectionTitles = [numSections]string{
	secTypes:       "Types and domains",
	secTables:      "Tables, each with its identity column, keys, checks added later, foreign keys and indexes",
	secFunctions:   "Functions, each with its settings (search_path, plan_cache_mode, ...) and what PUBLIC may do with it",
	secSecurity:    "Row-level security: enabled per table (FORCE is in each CREATE TABLE's group above), then its policies",
	secViews:       "Views",
	secBookkeeping: "Migration bookkeeping: the applier's table of applied versions and checksums",
	secOther:       "Other objects",
}

// placement says where an entry goes: its section, the object it belongs with, and its rank
// within that object's group.
type placement struct {
	section int
	object  string
	rank    int
}

var (
	indexOn     = regexp.MustCompile(`(?m)^CREATE (?:UNIQUE )?INDEX \S+ ON (?:ONLY )?(\S+) `)
	alterTable  = regexp.MustCompile(`(?m)^ALTER TABLE (?:ONLY )?(\S+)`)
	routineName = regexp.MustCompile(`^([^(]+)\(`)
)

// unqualified strips a schema qualifier from a name as pg_dump prints it in a statement.
func unqualified(name, schema string) string {
	return strings.TrimPrefix(name, schema+".")
}

// firstWord is the table of a "table object" entry name (constraints, policies, triggers).
func firstWord(s string) string {
	if i := strings.IndexByte(s, ' '); i >= 0 {
		return s[:i]
	}
	return s
}

// place decides where e goes; kinds maps each object name seen so far to its main entry kind.
func place(e entry, opt Options, kinds map[string]string) placement {
	table := func(name string) placement {
		if name == opt.BookkeepingTable {
			return placement{secBookkeeping, name, 0}
		}
		return placement{secTables, name, 0}
	}
	switch e.kind {
	case "DOMAIN", "TYPE":
		return placement{secTypes, e.name, 0}
	case "TABLE":
		return table(e.name)
	case "SEQUENCE", "DEFAULT", "SEQUENCE OWNED BY":
		p := placement{secOther, e.name, 0}
		if m := alterTable.FindStringSubmatch(e.text); m != nil {
			p = table(unqualified(m[1], e.schema))
		} else if e.kind == "DEFAULT" {
			p = table(firstWord(e.name))
		}
		if p.section != secOther {
			p.rank = 1
		}
		return p
	case "CONSTRAINT", "CHECK CONSTRAINT":
		p := table(firstWord(e.name))
		p.rank = 2
		return p
	case "FK CONSTRAINT":
		p := table(firstWord(e.name))
		p.rank = 3
		return p
	case "INDEX":
		if m := indexOn.FindStringSubmatch(e.text); m != nil {
			p := table(unqualified(m[1], e.schema))
			p.rank = 4
			return p
		}
	case "TRIGGER":
		p := table(firstWord(e.name))
		p.rank = 5
		return p
	case "ROW SECURITY":
		return placement{secSecurity, e.name, 0}
	case "POLICY":
		return placement{secSecurity, firstWord(e.name), 1}
	case "VIEW", "MATERIALIZED VIEW":
		return placement{secViews, e.name, 0}
	case "FUNCTION", "PROCEDURE", "AGGREGATE":
		if m := routineName.FindStringSubmatch(e.name); m != nil {
			return placement{secFunctions, m[1], 0}
		}
		return placement{secFunctions, e.name, 0}
	case "COMMENT", "ACL":
		// The name is "KIND object", e.g. "TABLE t", "COLUMN t.c", "FUNCTION f(a integer)".
		kind, obj, _ := strings.Cut(e.name, " ")
		switch kind {
		case "COLUMN":
			obj, _, _ = strings.Cut(obj, ".")
		case "FUNCTION", "PROCEDURE", "AGGREGATE":
			if m := routineName.FindStringSubmatch(obj); m != nil {
				obj = m[1]
			}
		case "CONSTRAINT", "POLICY", "TRIGGER":
			// "CONSTRAINT c ON t": belongs with t.
			if _, t, ok := strings.Cut(obj, " ON "); ok {
				obj = t
			}
		}
		rank := 10
		if e.kind == "ACL" {
			rank = 11
		}
		switch kinds[obj] {
		case "TABLE":
			p := table(obj)
			p.rank = rank
			return p
		case "VIEW", "MATERIALIZED VIEW":
			return placement{secViews, obj, rank}
		case "FUNCTION", "PROCEDURE", "AGGREGATE":
			return placement{secFunctions, obj, rank}
		case "DOMAIN", "TYPE":
			return placement{secTypes, obj, rank}
		}
	}
	return placement{secOther, e.name, 0}
}

// Format turns pg_dump's plain schema-only output (run with Args) into schema.sql.
func Format(dump string, opt Options) (string, error) {
	entries, err := parse(dump)
	if err != nil {
		return "", err
	}
	kinds := map[string]string{}
	for _, e := range entries {
		switch {
		case isRoutine(e.kind):
			if m := routineName.FindStringSubmatch(e.name); m != nil {
				kinds[m[1]] = e.kind
			}
		case e.kind == "TABLE" || e.kind == "VIEW" || e.kind == "MATERIALIZED VIEW" || e.kind == "DOMAIN" || e.kind == "TYPE":
			kinds[e.name] = e.kind
		}
	}

	type item struct {
		placement
		entry
	}
	var items []item
	first := map[[2]any]int{} // (section, object) -> position of its first entry
	for _, e := range entries {
		e.text = clean(e.text)
		if e.kind == "ACL" {
			e.text = keepPublic(e.text)
		}
		e.text = unqualify(e, opt.Schema)
		if e.text == "" {
			continue
		}
		p := place(e, opt, kinds)
		if p.section == secOther {
			// Keep pg_dump's own description of an object this file does not sort.
			e.text = fmt.Sprintf("-- %s %s\n%s", e.kind, e.name, e.text)
		}
		key := [2]any{p.section, p.object}
		if _, ok := first[key]; !ok {
			first[key] = e.pos
		}
		items = append(items, item{p, e})
	}
	if len(items) == 0 {
		return "", errors.New("the dump holds no objects")
	}
	// Objects in the order pg_dump put their first entry (names, dependencies first), each
	// object's entries by rank, ties in pg_dump's order. Tables go by name.
	sort.SliceStable(items, func(i, j int) bool {
		a, b := items[i], items[j]
		if a.section != b.section {
			return a.section < b.section
		}
		if a.object != b.object {
			if a.section == secTables || a.section == secSecurity {
				return a.object < b.object
			}
			return first[[2]any{a.section, a.object}] < first[[2]any{b.section, b.object}]
		}
		if a.rank != b.rank {
			return a.rank < b.rank
		}
		return a.pos < b.pos
	})

	var b strings.Builder
	for _, line := range strings.Split(strings.TrimRight(opt.Header, "\n"), "\n") {
		b.WriteString(strings.TrimRight("-- "+line, " ") + "\n")
	}
	section, object := -1, ""
	for _, it := range items {
		switch {
		case it.section != section:
			title := sectionTitles[it.section]
			rule := strings.Repeat("-", 100)
			fmt.Fprintf(&b, "\n\n%s\n-- %s\n%s\n\n", rule, title, rule)
		case it.object != object:
			b.WriteString("\n\n")
		default:
			b.WriteString("\n")
		}
		section, object = it.section, it.object
		b.WriteString(it.text + "\n")
	}
	return b.String(), nil
}

package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"fusion/outbox/internal/safetext"
)

// printJSON writes v as indented JSON on stdout.
func (a *app) printJSON(v any) error {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return fmt.Errorf("write JSON: %w", err)
	}
	if _, err := a.stdout.Write(safetext.JSON(buf.Bytes())); err != nil {
		return fmt.Errorf("write JSON: %w", err)
	}
	return nil
}

// table writes aligned columns; call flush when done.
type table struct{ tw *tabwriter.Writer }

func newTable(w io.Writer, header ...string) *table {
	t := &table{tw: tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)}
	t.row(header...)
	return t
}

// row writes one line. Every cell is escaped: cells hold strings read from the database, which
// any role that writes a row chooses, and a control character in one could rewrite what the
// operator sees (an event ID holding "\r\x1b[K" once printed a fake "all checks passed").
func (t *table) row(cells ...string) {
	escaped := make([]string, len(cells))
	for i, c := range cells {
		escaped[i] = safetext.Escape(c)
	}
	fmt.Fprintln(t.tw, strings.Join(escaped, "\t"))
}

func (t *table) flush() error {
	if err := t.tw.Flush(); err != nil {
		return fmt.Errorf("write table: %w", err)
	}
	return nil
}

// note writes a line for the operator on stderr: plans, hints, empty results. Stdout stays
// for results, so that --json output is never mixed with prose.
func (a *app) note(format string, args ...any) {
	fmt.Fprintln(a.stderr, human(format, args...))
}

// say writes a result line for the operator on stdout.
func (a *app) say(format string, args ...any) {
	fmt.Fprintln(a.stdout, human(format, args...))
}

// human formats a line for a person: string arguments are escaped as cells are, and the whole
// line is then kept to printable characters, whatever the arguments held.
func human(format string, args ...any) string {
	for i, v := range args {
		switch v := v.(type) {
		case string:
			args[i] = safetext.Escape(v)
		case error:
			args[i] = safetext.Escape(v.Error())
		}
	}
	return safetext.Printable(fmt.Sprintf(format, args...))
}

func itoa[T ~int | ~int64](v T) string { return strconv.FormatInt(int64(v), 10) }

func cursorText(c *int64) string {
	if c == nil {
		return "-" // never positioned: the consumer reconciles or starts at the oldest event
	}
	return itoa(*c)
}

func timeText(t *time.Time) string {
	if t == nil {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func plural(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return itoa(n) + " " + many
}

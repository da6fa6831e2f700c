package outbox_test

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/testkit"
)

// TestEveryStatementPrepares prepares every statement the package runs against the migrated
// schema (testkit.PrepareEveryStatement), so a typo, a renamed column or a type mismatch fails
// here rather than in production. A statement with @name parameters is prepared as pgx sends
// it: rewritten by pgx.NamedArgs to $n. Statements that one function scans, or that repeat
// another, must agree.
func TestEveryStatementPrepares(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	described := testkit.PrepareEveryStatement(t, ctx, outbox.Statements)

	// Statements whose rows one function scans return the same columns.
	for _, group := range [][]string{
		{"readEventsSQL", "readFirstEventsSQL", "readEventSQL"}, // scanEvents
		{"insertEventSQL", "insertTracedEventSQL"},              // the writer hook's insert
	} {
		for _, name := range group[1:] {
			require.Equal(t, resultColumns(described[group[0]]), resultColumns(described[name]), "%s and %s", group[0], name)
		}
	}
	// readTicksSQL returns scanEvents' columns, then each row's tick and part.
	require.Equal(t, resultColumns(described["readEventsSQL"]), resultColumns(described["readTicksSQL"])[:len(resultColumns(described["readEventsSQL"]))],
		"readTicksSQL must start with readEventsSQL's columns")
	// readTicksSinceSQL returns readTicksSQL's columns, then the ticks' state (scanEventRows).
	require.Equal(t, resultColumns(described["readTicksSQL"]), resultColumns(described["readTicksSinceSQL"])[:len(resultColumns(described["readTicksSQL"]))],
		"readTicksSinceSQL must start with readTicksSQL's columns")
	require.Len(t, described["readTicksSinceSQL"].Fields, len(described["readTicksSQL"].Fields)+3, "readTicksSinceSQL: the ticks' state is three columns")
	// openWithTickSQL repeats openDeliveriesSQL whole.
	require.Contains(t, strings.Join(strings.Fields(outbox.Statements["openWithTickSQL"]), " "),
		strings.Join(strings.Fields(outbox.Statements["openDeliveriesSQL"]), " "), "openWithTickSQL must read openDeliveriesSQL word for word")
}

// resultColumns are a prepared statement's result columns: name and type.
func resultColumns(sd *pgconn.StatementDescription) []string {
	var out []string
	for _, f := range sd.Fields {
		out = append(out, fmt.Sprintf("%s %d", f.Name, f.DataTypeOID))
	}
	return out
}

// numberedParameter finds $n parameters.
var numberedParameter = regexp.MustCompile(`\$([0-9]+)`)

// TestStatementParameters: as the style guide says, a statement of more than four parameters
// names them (@name, bound with pgx.StrictNamedArgs, which refuses a name missing on either
// side) and one of four or fewer numbers them ($n). None mixes the two: pgx would number the
// names from $1 over the numbered ones.
func TestStatementParameters(t *testing.T) {
	t.Parallel()
	for name, sql := range outbox.Statements {
		_, named, err := pgx.NamedArgs{}.RewriteQuery(context.Background(), nil, sql, nil)
		require.NoError(t, err, name)
		highest := 0
		for _, m := range numberedParameter.FindAllStringSubmatch(sql, -1) {
			n, err := strconv.Atoi(m[1])
			require.NoError(t, err)
			highest = max(highest, n)
		}
		switch {
		case len(named) > 0 && highest > 0:
			t.Errorf("%s mixes @name and $n parameters", name)
		case highest > 4:
			t.Errorf("%s has %d parameters: name them (@name with pgx.StrictNamedArgs)", name, highest)
		case len(named) > 0 && len(named) <= 4:
			t.Errorf("%s has %d parameters: number them ($n)", name, len(named))
		}
	}
}

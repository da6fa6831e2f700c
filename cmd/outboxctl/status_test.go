package main_test

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
)

const fortyDays = 40 * 24 * time.Hour

func TestStatus(t *testing.T) {
	t.Parallel()
	f := newFixture(t)

	t.Run("table", func(t *testing.T) {
		r := f.ctl(t, "status")
		require.Equal(t, 0, r.code, "%s", r)
		t.Logf("outboxctl status:\n%s", r.stdout)
		header, rows := tableRows(t, r.stdout)
		require.Equal(t, []string{"PROJECT", "CONSUMER", "CURSOR", "HEAD", "LAG_EVENTS", "LAG_SECONDS",
			"LEASE_HOLDER", "LEASE_EXPIRES", "RETIRED", "RETRYING", "DEAD", "REPLAYING"}, header)
		require.Len(t, rows, 4, "one row per (project, consumer)")

		rep := rows["alpha/reporter"]
		require.Equal(t, []string{"2", "5", "3"}, rep[2:5], "cursor, head, lag in events")
		lag, err := strconv.ParseFloat(rep[5], 64)
		require.NoError(t, err)
		require.InDelta(t, fortyDays.Seconds(), lag, 600, "lag in seconds is the age of the oldest unread event")
		require.Equal(t, []string{"-", "-", "no", "0", "0", "0"}, rep[6:], "stopped: it released its lease")

		eng := rows["alpha/engine"]
		require.Equal(t, []string{"5", "5", "0", "0.0"}, eng[2:6])
		require.True(t, strings.HasPrefix(eng[6], "engine@"), "the lease holder is the running instance: %q", eng[6])
		expires, err := time.Parse(time.RFC3339, eng[7])
		require.NoError(t, err)
		require.WithinDuration(t, time.Now().Add(30*time.Second), expires, 30*time.Second)
		require.Equal(t, []string{"no", "0", "1", "0"}, eng[8:], "one dead letter")

		require.Equal(t, []string{"2", "2", "0", "0.0"}, rows["beta/dashboard"][2:6])
	})

	t.Run("summary line", func(t *testing.T) {
		r := f.ctl(t, "status")
		require.Equal(t, 0, r.code, "%s", r)
		table, summary, ok := strings.Cut(strings.TrimSuffix(r.stdout, "\n"), "\n\n")
		require.True(t, ok, "a blank line between the table and the summary: %q", r.stdout)
		require.Len(t, strings.Split(table, "\n"), 5, "header and four rows")
		var lag float64
		_, err := fmt.Sscanf(summary, "4 consumers, 1 behind (worst lag 3 events, %f seconds), 1 dead letter, 0 replaying", &lag)
		require.NoError(t, err, "summary %q", summary)
		require.InDelta(t, fortyDays.Seconds(), lag, 600, "the worst lag in seconds is alpha/reporter's")
		require.Equal(t, fmt.Sprintf("4 consumers, 1 behind (worst lag 3 events, %.1f seconds), 1 dead letter, 0 replaying", lag), summary)

		r = f.ctl(t, "status", "--project", "beta")
		require.Equal(t, 0, r.code, "%s", r)
		require.True(t, strings.HasSuffix(r.stdout, "\n\n1 consumer, 0 behind (worst lag 0 events, 0.0 seconds), 0 dead letters, 0 replaying\n"), "%q", r.stdout)
		require.NotContains(t, f.ctl(t, "status", "--json").stdout, "behind", "no summary in JSON")
	})

	t.Run("read dsn", func(t *testing.T) {
		// The lag figures are tested on a real streaming standby in the module's
		// TestStandbyReads; here the primary stands in for one, which says it is not one.
		r := f.ctl(t, "status", "--read-dsn", f.db.URL)
		require.Equal(t, 0, r.code, "%s", r)
		lines := strings.Split(strings.TrimSuffix(r.stdout, "\n"), "\n")
		last := lines[len(lines)-1]
		require.Regexp(t, `^standby: caught up \(tick [0-9]+\); it is not in recovery: a primary, or a promoted standby$`, last)
		r = f.ctl(t, "status", "--read-dsn", f.db.URL, "--json")
		require.Equal(t, 2, r.code, "%s", r)
		require.Contains(t, r.stderr, "--read-dsn adds a line under the table")
		r = f.ctl(t, "status", "--read-dsn", "host=db port=x password=Sup3rSecret")
		require.Equal(t, 2, r.code, "%s", r)
		require.Contains(t, r.stderr, "--read-dsn does not parse")
		require.NotContains(t, r.stderr+r.stdout, "Sup3rSecret")
	})

	t.Run("sort by lag", func(t *testing.T) {
		names := func(r result) []string {
			t.Helper()
			require.Equal(t, 0, r.code, "%s", r)
			var out []string
			for _, l := range strings.Split(r.stdout, "\n")[1:] {
				if l == "" {
					break
				}
				f := strings.Fields(l)
				out = append(out, f[0]+"/"+f[1])
			}
			return out
		}
		byName := []string{"alpha/dashboard", "alpha/engine", "alpha/reporter", "beta/dashboard"}
		require.Equal(t, byName, names(f.ctl(t, "status")), "the default order is project, consumer")
		require.Equal(t, byName, names(f.ctl(t, "status", "--sort", "name")))
		require.Equal(t, []string{"alpha/reporter", "alpha/dashboard", "alpha/engine", "beta/dashboard"}, names(f.ctl(t, "status", "--sort", "lag")),
			"furthest behind first, ties in name order")

		st := decode[[]outbox.ConsumerStatus](t, f.ctl(t, "status", "--json", "--sort", "lag"))
		require.Len(t, st, 4)
		require.Equal(t, "alpha/reporter", st[0].ProjectID+"/"+st[0].ConsumerID, "--json in the same order")

		r := f.ctl(t, "status", "--sort", "size")
		require.Equal(t, 2, r.code, "%s", r)
		require.Contains(t, r.stderr, `outboxctl: --sort must be "name" or "lag" (got "size")`)
	})

	t.Run("json", func(t *testing.T) {
		st := decode[[]outbox.ConsumerStatus](t, f.ctl(t, "status", "--json", "--project", "alpha", "--consumer", "reporter"))
		require.Len(t, st, 1)
		s := st[0]
		require.Equal(t, "alpha", s.ProjectID)
		require.Equal(t, "reporter", s.ConsumerID)
		require.NotNil(t, s.Cursor)
		require.Equal(t, int64(2), *s.Cursor)
		require.Equal(t, int64(5), s.Head)
		require.Equal(t, int64(3), s.LagEvents)
		require.InDelta(t, fortyDays.Seconds(), s.LagSeconds, 600)
		require.False(t, s.LeaseHeld)
		require.False(t, s.Retired)

		all := decode[[]outbox.ConsumerStatus](t, f.ctl(t, "status", "--json"))
		require.Len(t, all, 4)
		eng := all[1]
		require.Equal(t, "alpha/engine", eng.ProjectID+"/"+eng.ConsumerID)
		require.True(t, eng.LeaseHeld)
		require.Equal(t, 1, eng.Dead)
		require.Zero(t, eng.LagEvents)
	})

	t.Run("an unknown consumer is an error", func(t *testing.T) {
		r := f.ctl(t, "status", "--consumer", "nobody")
		require.Equal(t, 1, r.code, "%s", r)
		require.Equal(t, "outboxctl: unknown consumer: consumer \"nobody\" has no cursor in any project\n", r.stderr)
		require.Empty(t, r.stdout)
	})
}

func TestDeadLetters(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	eventID := f.eventID(t, "alpha", 2)

	r := f.ctl(t, "dead-letters")
	require.Equal(t, 0, r.code, "%s", r)
	header, rows := tableRows(t, r.stdout)
	require.Equal(t, []string{"PROJECT", "CONSUMER", "SEQUENCE", "EVENT_ID", "STATE", "ATTEMPTS", "FAILURE", "PARKED_AT", "REPLAY_REQUESTED_BY"}, header)
	require.Len(t, rows, 1)
	row := rows["alpha/engine"]
	require.Equal(t, []string{"2", eventID, "dead", "1", "listener_error"}, row[2:7])
	_, err := time.Parse(time.RFC3339, row[7])
	require.NoError(t, err, "parked at")

	dead := decode[[]outbox.DeadLetter](t, f.ctl(t, "dead-letters", "--json", "--consumer", "engine"))
	require.Len(t, dead, 1)
	require.Equal(t, outbox.DeadLetter{ProjectID: "alpha", ConsumerID: "engine", Sequence: 2, EventID: eventID, State: "dead",
		Attempts: 1, LastFailureClass: "listener_error", ParkedAt: dead[0].ParkedAt}, dead[0])

	none := decode[[]outbox.DeadLetter](t, f.ctl(t, "dead-letters", "--json", "--consumer", "dashboard"))
	require.Empty(t, none)
	r = f.ctl(t, "dead-letters", "--project", "beta")
	require.Equal(t, 0, r.code, "%s", r)
	require.Empty(t, r.stdout)
	require.Equal(t, "no dead letters\n", r.stderr)

	r = f.ctl(t, "dead-letters", "--consumer", "nobody")
	require.Equal(t, 1, r.code, "%s", r)
	require.Contains(t, r.stderr, "unknown consumer")
}

package main_test

import (
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

package main_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
)

func deliveryState(t *testing.T, f *fixture, consumer string, seq int64) string {
	t.Helper()
	var s string
	require.NoError(t, f.pool.QueryRow(context.Background(), `SELECT state FROM lifecycle_consumer_deliveries
		WHERE project_id = 'alpha' AND consumer_id = $1 AND sequence = $2`, consumer, seq).Scan(&s))
	return s
}

func TestReplay(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := testCtx(t)
	eventID := f.eventID(t, "alpha", 2)

	t.Run("an event that is not a dead letter", func(t *testing.T) {
		r := f.ctl(t, "replay", "--project", "alpha", "--consumer", "dashboard", "--reason", "FN-1", "--yes", "2")
		require.Equal(t, 1, r.code, "%s", r)
		require.Contains(t, r.stderr, `delivery is not a dead letter: consumer "dashboard" has no dead letter at sequence 2 of project "alpha"`)
	})
	t.Run("an unknown consumer", func(t *testing.T) {
		r := f.ctl(t, "replay", "--project", "alpha", "--consumer", "nobody", "--reason", "FN-1", "--yes", "2")
		require.Equal(t, 1, r.code, "%s", r)
		require.Equal(t, "outboxctl: unknown consumer: consumer \"nobody\" has no cursor in project \"alpha\"\n", r.stderr)
	})
	t.Run("without --yes and no terminal, nothing happens", func(t *testing.T) {
		r := f.ctl(t, "replay", "--project", "alpha", "--consumer", "engine", "--reason", "FN-8690", "2")
		require.Equal(t, 2, r.code, "%s", r)
		require.Contains(t, r.stderr, "outboxctl will ask consumer \"engine\" to replay 1 dead letter", "the plan comes first")
		require.Contains(t, r.stderr, "stdin is not a terminal, so pass --yes to confirm")
		require.Equal(t, "dead", deliveryState(t, f, "engine", 2))
	})
	t.Run("prose is not a reason", func(t *testing.T) {
		r := f.ctl(t, "replay", "--project", "alpha", "--consumer", "engine", "--reason", "fixed it, I think", "--yes", "2")
		require.Equal(t, 2, r.code, "%s", r)
		require.Contains(t, r.stderr, "--reason must be a ticket reference or short code")
		require.Equal(t, "dead", deliveryState(t, f, "engine", 2))
	})

	// The listener is fixed and deployed; the operator replays the dead letter.
	f.engine.heal()
	r := f.ctl(t, "replay", "--project", "alpha", "--consumer", "engine", "--reason", "FN-8690", "--actor", "oncall@example.com", "--yes", "2")
	require.Equal(t, 0, r.code, "%s", r)
	require.Equal(t, "replay requested: project alpha, consumer engine, sequence 2, event "+eventID+"\n", r.stdout)
	require.Contains(t, r.stderr, "  project alpha, sequence 2, event "+eventID)

	deadline, cancel := context.WithTimeout(ctx, waitLimit)
	defer cancel()
	waitUntil(t, deadline, "the consumer to resolve the replay", func() bool { return deliveryState(t, f, "engine", 2) == "resolved" })
	require.Equal(t, []int64{2}, f.engine.replays(), "the owning consumer re-delivered it once")
	require.Equal(t, []auditRow{{Project: "alpha", Consumer: "engine", Actor: "oncall@example.com", Reason: "FN-8690", EventID: eventID, Sequence: 2}},
		audits(t, f.pool, outbox.AuditConsumerReplayed))

	require.Empty(t, decode[[]outbox.DeadLetter](t, f.ctl(t, "dead-letters", "--json")))
	st := decode[[]outbox.ConsumerStatus](t, f.ctl(t, "status", "--json", "--consumer", "engine"))
	require.Zero(t, st[0].Dead)

	r = f.ctl(t, "replay", "--consumer", "engine", "--all", "--reason", "FN-8690", "--yes")
	require.Equal(t, 0, r.code, "%s", r)
	require.Equal(t, "consumer \"engine\" has no dead letters to replay\n", r.stderr)
}

func TestRetirePruneReinstate(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	ctx := testCtx(t)

	// reporter lags at 2, and engine's dead letter holds sequence 2: one event may go in alpha.
	r := f.ctl(t, "prune", "--dry-run")
	require.Equal(t, 0, r.code, "%s", r)
	header, rows := tableRows(t, r.stdout)
	require.Equal(t, []string{"PROJECT", "HEAD", "PRUNED_THROUGH", "ACKED_THROUGH", "PRUNABLE", "HELD_BY"}, header)
	require.Equal(t, []string{"alpha", "5", "0", "2", "1", "reporter"}, rows["alpha/5"])
	require.Equal(t, []string{"beta", "2", "0", "2", "2", "dashboard"}, rows["beta/2"])
	require.Contains(t, r.stderr, "dry run (window 720h0m0s): nothing was pruned")
	plans := decode[[]outbox.PrunePlan](t, f.ctl(t, "prune", "--dry-run", "--json", "--project", "alpha"))
	require.Equal(t, []outbox.PrunePlan{{ProjectID: "alpha", Head: 5, Through: 2, Prunable: 1, HeldBy: "reporter"}}, plans)
	plans = decode[[]outbox.PrunePlan](t, f.ctl(t, "prune", "--dry-run", "--json", "--retention-window", "1000h"))
	require.Zero(t, plans[0].Prunable+plans[1].Prunable, "nothing is older than a 1000h window")

	// Retiring needs confirmation.
	r = f.ctl(t, "retire", "--consumer", "reporter", "--reason", "FN-9")
	require.Equal(t, 2, r.code, "%s", r)
	require.Contains(t, r.stderr, "outboxctl will retire consumer \"reporter\" in 1 project")
	require.Contains(t, r.stderr, "refusing to retire the consumer without confirmation: stdin is not a terminal, so pass --yes to confirm")
	require.Empty(t, audits(t, f.pool, outbox.AuditConsumerRetired))

	r = f.ctl(t, "retire", "--consumer", "nobody", "--reason", "FN-9", "--yes")
	require.Equal(t, 1, r.code, "%s", r)
	require.Equal(t, "outboxctl: unknown consumer: consumer \"nobody\" has no cursor in any project\n", r.stderr)

	r = f.ctl(t, "retire", "--consumer", "reporter", "--reason", "FN-9", "--actor", "oncall", "--yes")
	require.Equal(t, 0, r.code, "%s", r)
	require.Equal(t, "retired consumer reporter in 1 project: alpha (audited: actor oncall, reason FN-9)\n", r.stdout)
	require.Equal(t, []auditRow{{Project: "alpha", Consumer: "reporter", Actor: "oncall", Reason: "FN-9"}}, audits(t, f.pool, outbox.AuditConsumerRetired))
	st := decode[[]outbox.ConsumerStatus](t, f.ctl(t, "status", "--json", "--consumer", "reporter"))
	require.True(t, st[0].Retired)
	require.Equal(t, "oncall", st[0].RetiredBy)
	require.Equal(t, "FN-9", st[0].RetiredReason)
	r = f.ctl(t, "retire", "--consumer", "reporter", "--reason", "FN-9", "--yes")
	require.Equal(t, 0, r.code, "%s", r)
	require.Contains(t, r.stderr, "already retired in every matching project; nothing to do")

	// The laggard no longer holds pruning back; engine's dead letter still holds sequence 2.
	plans = decode[[]outbox.PrunePlan](t, f.ctl(t, "prune", "--dry-run", "--json", "--project", "alpha"))
	require.Equal(t, []outbox.PrunePlan{{ProjectID: "alpha", Head: 5, Through: 5, Prunable: 4, HeldBy: "dashboard"}}, plans)

	r = f.ctl(t, "prune", "--project", "alpha", "--yes")
	require.Equal(t, 2, r.code, "a real prune covers every project: %s", r)
	r = f.ctl(t, "prune")
	require.Equal(t, 2, r.code, "%s", r)
	require.Contains(t, r.stderr, "pass --yes")
	type pruned struct {
		PrunedByProject   map[string]int64
		Pruned            int64
		DeadLettersPruned int64
	}
	res := decode[pruned](t, f.ctl(t, "prune", "--yes", "--json"))
	require.Equal(t, pruned{PrunedByProject: map[string]int64{"alpha": 4, "beta": 2}, Pruned: 6}, res)
	var left []int64
	rows2, err := f.pool.Query(ctx, `SELECT sequence FROM lifecycle_outbox_read('alpha', 0, 100000, NULL, NULL, NULL)`)
	require.NoError(t, err)
	for rows2.Next() {
		var s int64
		require.NoError(t, rows2.Scan(&s))
		left = append(left, s)
	}
	require.NoError(t, rows2.Err())
	require.Equal(t, []int64{2}, left, "the dead letter's event stays replayable")
	plans = decode[[]outbox.PrunePlan](t, f.ctl(t, "prune", "--dry-run", "--json", "--project", "alpha"))
	require.Equal(t, int64(5), plans[0].PrunedThrough)
	require.Zero(t, plans[0].Prunable)

	// Reinstated, reporter's cursor (2) is below the pruned floor (5): its process reconciles.
	r = f.ctl(t, "reinstate", "--consumer", "reporter", "--reason", "FN-10", "--actor", "oncall", "--yes")
	require.Equal(t, 0, r.code, "%s", r)
	require.Equal(t, "reinstated consumer reporter in 1 project: alpha (audited: actor oncall, reason FN-10)\n", r.stdout)
	require.Equal(t, []auditRow{{Project: "alpha", Consumer: "reporter", Actor: "oncall", Reason: "FN-10"}}, audits(t, f.pool, outbox.AuditConsumerRestored))
	startConsumer(t, f.db.URL, "reporter", []string{"alpha"}, 0, nil)
	deadline, cancel := context.WithTimeout(ctx, waitLimit)
	defer cancel()
	waitCursor(t, deadline, f.pool, "alpha", "reporter", 5)
	st = decode[[]outbox.ConsumerStatus](t, f.ctl(t, "status", "--json", "--consumer", "reporter"))
	require.False(t, st[0].Retired)
	require.Equal(t, outbox.ReasonCursorBelowPrunedFloor, st[0].ReconcileReason)
	require.Zero(t, st[0].LagEvents)
}

func TestMigrateAndVerify(t *testing.T) {
	t.Parallel()
	db := pgtestEmpty(t)
	env := []string{"DATABASE_URL=" + db} // the fallback when --dsn is not given

	r := ctl(t, env, "verify")
	require.Equal(t, 1, r.code, "%s", r)
	require.Contains(t, r.stderr, "database schema is behind this build")
	require.Contains(t, r.stderr, "run `outboxctl migrate`")
	r = ctl(t, env, "status")
	require.Equal(t, 1, r.code, "every command checks the schema first: %s", r)
	require.Contains(t, r.stderr, "run `outboxctl migrate`")

	r = ctl(t, env, "migrate")
	require.Equal(t, 2, r.code, "%s", r)
	require.Contains(t, r.stderr, fmt.Sprintf("outboxctl will apply %d migrations to database", outbox.SchemaVersion))
	require.Contains(t, r.stderr, "0001_outbox, 0002_consumers, 0003_row_level_security, ")
	require.Contains(t, r.stderr, "pass --yes")

	r = ctl(t, env, "migrate", "--yes")
	require.Equal(t, 0, r.code, "%s", r)
	require.Equal(t, fmt.Sprintf("applied migrations %s; the schema is at version %d\n", allVersions(), outbox.SchemaVersion), r.stdout)

	r = ctl(t, env, "verify")
	require.Equal(t, 0, r.code, "%s", r)
	header, rows := tableRows(t, r.stdout)
	require.Equal(t, []string{"VERSION", "NAME", "CHECKSUM", "APPLIED_AT"}, header)
	require.Len(t, rows, outbox.SchemaVersion+1, "every migration and the conclusion")
	require.True(t, strings.HasSuffix(r.stdout, fmt.Sprintf("the outbox schema is at version %d, as this build expects\n", outbox.SchemaVersion)))
	type verified struct {
		Version, Expected int
		Current           bool
	}
	require.Equal(t, verified{outbox.SchemaVersion, outbox.SchemaVersion, true}, decode[verified](t, ctl(t, env, "verify", "--json")))

	r = ctl(t, env, "migrate", "--yes")
	require.Equal(t, 0, r.code, "%s", r)
	require.Equal(t, fmt.Sprintf("the outbox schema is already at version %d; nothing to do\n", outbox.SchemaVersion), r.stderr)
	r = ctl(t, env, "status")
	require.Equal(t, 0, r.code, "%s", r)
	require.Equal(t, "no consumer cursors match\n", r.stderr)
	require.Equal(t, "[]\n", ctl(t, env, "status", "--json").stdout)
}

func TestHelp(t *testing.T) {
	t.Parallel()
	for _, args := range [][]string{{"--help"}, {"help", "status"}, {"status", "--help"}, {"dead-letters", "-h"}, {"replay", "--help"},
		{"retire", "--help"}, {"reinstate", "--help"}, {"prune", "--help"}, {"migrate", "--help"}, {"verify", "--help"}} {
		r := ctl(t, nil, args...)
		require.Equal(t, 0, r.code, "%v: %s", args, r)
		require.Contains(t, r.stdout, "Usage:", "%v", args)
		require.Empty(t, r.stderr)
	}
	r := ctl(t, nil, "--help")
	for _, c := range []string{"status", "dead-letters", "replay", "retire", "reinstate", "prune", "migrate", "verify"} {
		require.True(t, slices.ContainsFunc(strings.Split(r.stdout, "\n"), func(l string) bool {
			return strings.HasPrefix(strings.TrimSpace(l), c+" ")
		}), "the help lists %s", c)
	}
}

// allVersions lists the build's migration versions as migrate prints them: "1, 2, 3".
func allVersions() string {
	var vs []string
	for _, m := range outbox.Migrations() {
		vs = append(vs, fmt.Sprint(m.Version))
	}
	return strings.Join(vs, ", ")
}

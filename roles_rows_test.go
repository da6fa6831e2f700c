package outbox_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
)

// The roles-and-rows tests: each role attempts, on a database migrated by an owner that is not
// a superuser, what its grants once let it do to another component, and the database refuses.

// TestOperatorCannotRaiseThePrunedFloor: the operator role may not move pruned_through; only
// the prune function does, and only to what it deleted. A dashboard whose cursor is below the
// head then delivers every event still stored instead of reconciling past them.
func TestOperatorCannotRaiseThePrunedFloor(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp, dash, operator := deletedInProjectA(t, 7)
	// The dashboard delivered 4 of the 7 events and stopped.
	for _, stmt := range []string{
		`INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id) VALUES ('proj-a', 'dash')`,
		`UPDATE lifecycle_consumer_cursors SET last_acked_sequence = 4 WHERE consumer_id = 'dash'`,
	} {
		_, err := dash.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}

	for _, stmt := range []string{
		`UPDATE lifecycle_outbox_heads SET pruned_through = 7 WHERE project_id = 'proj-a'`,
		`UPDATE lifecycle_outbox_heads SET pruned_at = now() WHERE project_id = 'proj-a'`,
	} {
		_, err := operator.Exec(ctx, stmt)
		require.Error(t, err, "the operator moved the floor: %s", stmt)
		requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
	}
	require.Zero(t, testkit.FloorOf(t, lp.owner, "proj-a"))
	// Nor through the prune function: it deletes nothing above the slowest cursor or inside
	// the window, and so raises the floor by nothing.
	var n, maxSeq int64
	require.NoError(t, operator.QueryRow(ctx, `SELECT * FROM lifecycle_outbox_prune('proj-a', 100, 0, interval '0', interval '1 hour')`).Scan(&n, &maxSeq))
	require.Zero(t, n, "events younger than the window went")
	ageEvents(t, ctx, lp.owner, 2*time.Hour)
	var err error
	require.NoError(t, operator.QueryRow(ctx, `SELECT * FROM lifecycle_outbox_prune('proj-a', 100, 0, interval '0', interval '1 hour')`).Scan(&n, &maxSeq))
	require.Equal(t, []int64{4, 4}, []int64{n, maxSeq}, "pruned through the slowest cursor only")
	require.Equal(t, int64(4), testkit.FloorOf(t, lp.owner, "proj-a"), "the floor follows what was deleted")
	_, err = operator.Exec(ctx, `SELECT * FROM lifecycle_outbox_prune('proj-a', 100, 0, interval '0', interval '1 minute')`)
	requireSQLState(t, err, pgerrcode.InvalidParameterValue) // a window below the configuration's least

	_, rec := startConsumer(t, dash, "dash", []string{"proj-a"}, testkit.FastConfig(), nil)
	evs := rec.WaitCount(t, ctx, 3)
	require.Equal(t, []int64{5, 6, 7}, []int64{evs[0].Sequence, evs[1].Sequence, evs[2].Sequence}, "the unread events are delivered")
}

// TestPruneFunctionKeepsToTheCallersProjects: the owner-run prune functions prune only the
// projects granted to their caller, and only an operator role may call them.
func TestPruneFunctionKeepsToTheCallersProjects(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilege(t)
	writer, _ := lp.component(t, "writer", writerGrant("*"))
	consumer, _ := lp.component(t, "consumer", consumerGrant("dash", "*"))
	operatorA, _ := lp.component(t, "operator", operatorGrant("proj-a"))
	deleteTasksAs(t, lp, writer, "proj-a", 2)
	deleteTasksAs(t, lp, writer, "proj-b", 2)
	_, err := outbox.Sequence(ctx, consumer, nil, 100)
	require.NoError(t, err)
	ageEvents(t, ctx, lp.owner, 2*time.Hour)

	_, err = operatorA.Exec(ctx, `SELECT * FROM lifecycle_outbox_prune('proj-b', 100, 0, interval '0', interval '1 hour')`)
	requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
	for name, pool := range map[string]*pgxpool.Pool{"writer": writer, "consumer": consumer} {
		_, err := pool.Exec(ctx, `SELECT * FROM lifecycle_outbox_prune('proj-a', 100, 0, interval '0', interval '1 hour')`)
		require.Error(t, err, name)
		requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
		_, err = pool.Exec(ctx, `SELECT lifecycle_outbox_prune_dead_letters(100, interval '0', interval '1 hour')`)
		require.Error(t, err, name)
		requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
	}
	res, err := testkit.NewRetention(t, operatorA, outbox.Config{RetentionWindow: time.Hour}).Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"proj-a": 2}, res.PrunedByProject)
	require.Equal(t, []int64{1, 2}, outboxSequences(t, lp.owner, "proj-b"), "another project's events stay")
	require.Zero(t, testkit.FloorOf(t, lp.owner, "proj-b"))
}

// TestConsumerWritesOnlyItsOwnAuditActions: a consumer role writes the poisoned and replayed
// audit rows of its own identity, naming no one but the operator who asked for the replay, and
// nothing else: no retirement or reinstatement "by alice@corp", no replay nobody asked for, no
// invented action.
func TestConsumerWritesOnlyItsOwnAuditActions(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp, dash, operator := deletedInProjectA(t, 2)
	// dash parked event 1, as the consumer does.
	for _, stmt := range []string{
		`INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id) VALUES ('proj-a', 'dash')`,
		`UPDATE lifecycle_consumer_cursors SET last_acked_sequence = 1 WHERE consumer_id = 'dash'`,
		`INSERT INTO lifecycle_consumer_deliveries (project_id, consumer_id, sequence, event_id, state, attempts, last_failure_class, parked_at)
		 SELECT 'proj-a', 'dash', 1, lifecycle_event_id(task_id, deleted_at), 'dead', 10, 'listener_error', now()
		 FROM lifecycle_outbox_read('proj-a', 0, 1, NULL, NULL, NULL)`,
	} {
		tag, err := dash.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
		require.Equal(t, int64(1), tag.RowsAffected(), stmt)
	}
	audit := func(action, actor, reason string, sequence int64) string {
		return `INSERT INTO lifecycle_audit (project_id, action, consumer_id, event_id, sequence, attempts, actor, reason)
			VALUES ('proj-a', 'lifecycle-observation:` + action + `', 'dash', 'task-deleted:t-1:2026-01-01T00:00:00.000000Z', ` +
			pgtestInt(sequence) + `, 10, ` + pgNullable(actor) + `, ` + pgNullable(reason) + `)`
	}
	forged := map[string]string{
		"retired by alice":           audit("consumer-retired", "alice@corp", "FN-1", 0),
		"reinstated by alice":        audit("consumer-reinstated", "alice@corp", "FN-1", 0),
		"replayed with no request":   audit("consumer-replayed", "", "", 1),
		"an invented action":         audit("consumer-promoted", "", "", 1),
		"poisoned naming an actor":   audit("consumer-poisoned", "alice@corp", "FN-1", 1),
		"poisoned with no dead row":  audit("consumer-poisoned", "", "", 2),
		"poisoned in another's name": `INSERT INTO lifecycle_audit (project_id, action, consumer_id, sequence) VALUES ('proj-a', 'lifecycle-observation:consumer-poisoned', 'engine', 1)`,
	}
	for name, stmt := range forged {
		_, err := dash.Exec(ctx, stmt)
		require.Error(t, err, "the consumer wrote %s", name)
		requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
	}
	_, err := dash.Exec(ctx, audit("consumer-poisoned", "", "", 1))
	require.NoError(t, err, "a consumer audits its own dead letter")

	_, err = outbox.NewAdmin(operator, outbox.AdminOptions{}).RequestReplay(ctx, outbox.ReplayRequest{ProjectID: "proj-a",
		ConsumerID: "dash", Sequence: 1, Operator: outbox.Operator{Actor: "oncall", Reason: "FN-2"}})
	require.NoError(t, err)
	for name, stmt := range map[string]string{
		"replayed naming another operator": audit("consumer-replayed", "alice@corp", "FN-2", 1),
		"replayed for another reason":      audit("consumer-replayed", "oncall", "FN-9", 1),
		"replayed of an unrequested event": audit("consumer-replayed", "", "", 2),
	} {
		_, err := dash.Exec(ctx, stmt)
		require.Error(t, err, "the consumer wrote %s", name)
		requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
	}
	_, err = dash.Exec(ctx, audit("consumer-replayed", "oncall", "FN-2", 1))
	require.NoError(t, err, "a consumer audits a requested replay, naming who asked")

	// The operator still audits what operators do, and no more.
	_, err = operator.Exec(ctx, audit("consumer-retired", "alice@corp", "FN-3", 0))
	require.NoError(t, err)
	_, err = operator.Exec(ctx, audit("consumer-promoted", "alice@corp", "FN-3", 0))
	requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
	require.Equal(t, 3, pgtestQueryInt(t, lp, `SELECT count(*) FROM lifecycle_audit`))
}

// TestNoRuntimeRoleHoldsATableLock: no component role holds table-level UPDATE, DELETE or
// TRUNCATE on a module table, so none, the operator included, can LOCK one in a mode that
// stalls another project's consumers and readers; the operator still prunes, through the
// owner's functions.
func TestNoRuntimeRoleHoldsATableLock(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilege(t)
	writer, writerRole := lp.component(t, "writer", writerGrant("proj-a"))
	consumer, consumerRole := lp.component(t, "consumer", consumerGrant("dash", "proj-a"))
	operator, operatorRole := lp.component(t, "operator", operatorGrant("proj-a"))
	deleteTasksAs(t, lp, writer, "proj-a", 3)
	_, err := outbox.Sequence(ctx, consumer, []string{"proj-a"}, 100)
	require.NoError(t, err)

	tables := append([]string{"lifecycle_outbox_pending", "lifecycle_consumer_access"}, moduleTables...)
	for _, role := range []string{writerRole, consumerRole, operatorRole} {
		for _, table := range tables {
			for _, priv := range []string{"UPDATE", "DELETE", "TRUNCATE"} {
				var has bool
				require.NoError(t, lp.owner.QueryRow(ctx, `SELECT has_table_privilege($1, $2, $3)`, role, table, priv).Scan(&has))
				require.False(t, has, "%s holds %s on %s", role, priv, table)
			}
		}
	}
	for _, table := range tables {
		tx, err := operator.Begin(ctx)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, `LOCK TABLE `+table+` IN ACCESS EXCLUSIVE MODE NOWAIT`)
		_ = tx.Rollback(ctx)
		require.Error(t, err, "the operator locked %s", table)
		requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
	}
	for _, stmt := range []string{
		`DELETE FROM lifecycle_outbox WHERE project_id = 'proj-a'`,
		`DELETE FROM lifecycle_consumer_deliveries WHERE project_id = 'proj-a'`,
	} {
		_, err := operator.Exec(ctx, stmt)
		require.Error(t, err, stmt)
		requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
	}

	ageEvents(t, ctx, lp.owner, 2*time.Hour)
	res, err := testkit.NewRetention(t, operator, outbox.Config{RetentionWindow: time.Hour}).Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"proj-a": 3}, res.PrunedByProject, "the operator prunes through the owner's function")
	require.Equal(t, int64(3), testkit.FloorOf(t, lp.owner, "proj-a"))
}

// TestWriterReadsOnlyWhatItsRepeatReads: the writer role reads of the log only which deletion
// an event is, who wrote it and when (what its repeat reads), and of the stream numbered before
// it those and the sequence, not the events' contents, their transaction or the ticks; it
// cannot call the reader; its repeat still works.
func TestWriterReadsOnlyWhatItsRepeatReads(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilege(t)
	writer, _ := lp.component(t, "writer", writerGrant("proj-a"))
	consumer, _ := lp.component(t, "consumer", consumerGrant("dash", "proj-a"))
	deleteTasksAs(t, lp, writer, "proj-a", 1)
	_, err := outbox.Sequence(ctx, consumer, []string{"proj-a"}, 100)
	require.NoError(t, err)

	for _, stmt := range []string{
		`SELECT event_type, archived, prior_column, payload_version FROM lifecycle_event_log`,
		`SELECT trace_context FROM lifecycle_event_log`,
		`SELECT txid FROM lifecycle_event_log`,
		`SELECT * FROM lifecycle_event_log`,
		`SELECT event_type, archived, prior_column, payload_version FROM lifecycle_outbox`,
		`SELECT trace_context FROM lifecycle_outbox`,
		`SELECT * FROM lifecycle_outbox`,
		`SELECT * FROM lifecycle_tick`,
		`SELECT * FROM lifecycle_tick_project`,
		`SELECT * FROM lifecycle_outbox_read('proj-a', 0, 1, NULL, NULL, NULL)`,
	} {
		_, err := writer.Exec(ctx, stmt)
		require.Error(t, err, "the writer read the events: %s", stmt)
		requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
	}
	var deletedAt time.Time
	var writerID string
	require.NoError(t, writer.QueryRow(ctx, `SELECT deleted_at, writer_process_id FROM lifecycle_event_log WHERE project_id = 'proj-a' AND task_id = 't-1'`).
		Scan(&deletedAt, &writerID))
	_, err = writer.Exec(ctx, `SELECT task_id, sequence FROM lifecycle_outbox`)
	require.NoError(t, err)

	// A repeat of a recorded deletion reads the stored event back: one committed before, and
	// one recorded earlier in the same transaction.
	w, err := outbox.NewWriter(writer, outbox.Config{NotifyDisabled: true}, zaptest.NewLogger(t))
	require.NoError(t, err)
	defer testkit.CloseWriter(t, w)
	err = pgx.BeginFunc(ctx, writer, func(tx pgx.Tx) error {
		stored, inserted, err := w.RecordTaskDeletedTx(ctx, tx, outbox.TaskDeletion{ProjectID: "proj-a", TaskID: "t-1", DeletedAt: deletedAt})
		require.NoError(t, err)
		require.False(t, inserted)
		require.Equal(t, writerID, stored.WriterProcessID)
		ev, inserted, err := w.RecordTaskDeletedTx(ctx, tx, outbox.TaskDeletion{ProjectID: "proj-a", TaskID: "t-2", DeletedAt: deletedAt})
		require.NoError(t, err)
		require.True(t, inserted)
		again, inserted, err := w.RecordTaskDeletedTx(ctx, tx, outbox.TaskDeletion{ProjectID: "proj-a", TaskID: "t-2", DeletedAt: deletedAt})
		require.NoError(t, err)
		require.False(t, inserted)
		require.Equal(t, ev.EventID, again.EventID)
		return nil
	})
	require.NoError(t, err)
}

func pgtestQueryInt(t *testing.T, lp *leastPrivilege, sql string, args ...any) int {
	t.Helper()
	return pgtest.QueryInt(t, lp.owner, sql, args...)
}

func pgNullable(s string) string {
	if s == "" {
		return "NULL"
	}
	return pgQuote(s)
}

func pgtestInt(v int64) string {
	if v == 0 {
		return "NULL"
	}
	return strconv.FormatInt(v, 10)
}

// TestConsumerRoleAuditsItsPoisonAndReplay: the consumer itself, as a consumer role writing to
// lifecycle_audit, still records the event it parked and the replay an operator asked for.
func TestConsumerRoleAuditsItsPoisonAndReplay(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp, dash, operator := deletedInProjectA(t, 2)

	cfg := testkit.FastConfig()
	cfg.MaxAttempts = 1 // park at the first failure
	var fixed atomic.Bool
	rec := testkit.NewRecorder()
	rec.SetFail(func(ev outbox.ObservedEvent) error {
		if ev.Sequence == 1 && !fixed.Load() {
			return testkit.ErrListener
		}
		return nil
	})
	startRecording(t, dash, "dash", []string{"proj-a"}, cfg, nil, rec)
	testkit.WaitCursor(t, ctx, lp.owner, "proj-a", "dash", 2)
	require.Equal(t, "dead", testkit.DeliveryOf(t, lp.owner, "dash", 1).State)

	fixed.Store(true)
	_, err := outbox.NewAdmin(operator, outbox.AdminOptions{}).RequestReplay(ctx, outbox.ReplayRequest{ProjectID: "proj-a",
		ConsumerID: "dash", Sequence: 1, Operator: outbox.Operator{Actor: "oncall@corp", Reason: "FN-4"}})
	require.NoError(t, err)
	require.Eventually(t, func() bool { return testkit.DeliveryOf(t, lp.owner, "dash", 1).State == "resolved" }, testkit.WaitLimit, 10*time.Millisecond)

	rows, err := lp.owner.Query(ctx, `SELECT action || ' ' || coalesce(actor, '-') || ' ' || coalesce(reason, '-') FROM lifecycle_audit ORDER BY id`)
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{
		string(outbox.AuditConsumerPoisoned) + " - -",
		string(outbox.AuditConsumerReplayed) + " oncall@corp FN-4",
	}, got)
}

// TestSchema17TakesBackWhatOldGrantsGave: roles granted under schema 16 lose, at the upgrade,
// DELETE and the floor (the operator), and every column of the stream but what the repeat
// reads (the writer); the operator prunes through the functions from then on.
func TestSchema17TakesBackWhatOldGrantsGave(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilegeWith(t, lpOptions{through: 16})
	grantAsSchema16 := func(statements ...string) func(context.Context, outbox.DBTX, string) error {
		return func(ctx context.Context, db outbox.DBTX, role string) error {
			ident := pgx.Identifier{role}.Sanitize()
			for _, s := range statements {
				if _, err := db.Exec(ctx, strings.ReplaceAll(s, "ROLE", ident)); err != nil {
					return err
				}
			}
			if err := outbox.GrantProjectAccess(ctx, db, role, "proj-a"); err != nil {
				return err
			}
			return outbox.GrantConsumerAccess(ctx, db, role, "*")
		}
	}
	// The grants GrantWriterRole and GrantOperatorRole gave at schema 16.
	writer, _ := lp.component(t, "writer", grantAsSchema16(
		`GRANT SELECT, INSERT (`+pendingCols+`) ON lifecycle_outbox_pending TO ROLE`,
		`GRANT SELECT, INSERT (`+pendingCols+`) ON lifecycle_outbox TO ROLE`,
		`GRANT SELECT ON lifecycle_project_access, lifecycle_outbox_schema TO ROLE`))
	operator, _ := lp.component(t, "operator", grantAsSchema16(
		`GRANT SELECT, DELETE ON lifecycle_outbox TO ROLE`,
		`GRANT SELECT ON lifecycle_outbox_pending TO ROLE`,
		`GRANT SELECT, UPDATE (pruned_through, pruned_at) ON lifecycle_outbox_heads TO ROLE`,
		`GRANT SELECT, UPDATE (retired_at, retired_by, retired_reason, lease_owner, lease_expires_at) ON lifecycle_consumer_cursors TO ROLE`,
		`GRANT SELECT, UPDATE (state, replay_requested_at, replay_requested_by, replay_reason), DELETE ON lifecycle_consumer_deliveries TO ROLE`,
		`GRANT SELECT, INSERT (project_id, action, consumer_id, event_id, sequence, attempts, actor, reason) ON lifecycle_audit TO ROLE`,
		`GRANT SELECT ON lifecycle_project_access, lifecycle_outbox_schema TO ROLE`))
	// The writer of schema 16 inserted pending rows; a consumer of schema 16 numbered them.
	_, err := writer.Exec(ctx, insertPendingRows, "proj-a", "t", 3)
	require.NoError(t, err)
	_, err = lp.owner.Exec(ctx, `SELECT * FROM lifecycle_outbox_sequence(NULL, 100)`)
	require.NoError(t, err)
	_, err = writer.Exec(ctx, `SELECT event_type FROM lifecycle_outbox`)
	require.NoError(t, err, "schema 16 let the writer read the events")

	lp.finishMigration(t)
	for _, stmt := range []string{
		`DELETE FROM lifecycle_outbox WHERE project_id = 'proj-a'`,
		`DELETE FROM lifecycle_consumer_deliveries WHERE project_id = 'proj-a'`,
		`UPDATE lifecycle_outbox_heads SET pruned_through = 3 WHERE project_id = 'proj-a'`,
	} {
		_, err := operator.Exec(ctx, stmt)
		require.Error(t, err, stmt)
		requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
	}
	_, err = writer.Exec(ctx, `SELECT event_type FROM lifecycle_outbox`)
	requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
	_, err = writer.Exec(ctx, `SELECT task_id, sequence FROM lifecycle_outbox`)
	require.NoError(t, err, "the writer's repeat still reads what it needs")
	// Schema 18 lets the writer of schema 16 record into the log, and read of it only its repeat.
	deletePrefixedTasksAs(t, lp, writer, "proj-a", "u", 1)
	require.Equal(t, 1, pgtest.QueryInt(t, lp.owner, `SELECT count(*) FROM lifecycle_event_log WHERE task_id = 'u-1'`))
	_, err = writer.Exec(ctx, `SELECT event_type FROM lifecycle_event_log`)
	requireSQLState(t, err, pgerrcode.InsufficientPrivilege)

	_, err = lp.owner.Exec(ctx, `UPDATE lifecycle_outbox SET occurred_at = occurred_at - interval '2 hours'`)
	require.NoError(t, err)
	res, err := testkit.NewRetention(t, operator, outbox.Config{RetentionWindow: time.Hour}).Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"proj-a": 3}, res.PrunedByProject, "the upgraded operator prunes through the functions")
}

const pendingCols = "project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id, prior_column, trace_context"

// deletedInProjectA makes a writer, a consumer "dash" and an operator of proj-a, each its own
// role, and has the writer delete n tasks there, numbered. It returns the database's roles
// and the consumer's and the operator's pools.
func deletedInProjectA(t *testing.T, n int) (*leastPrivilege, *pgxpool.Pool, *pgxpool.Pool) {
	t.Helper()
	lp := newLeastPrivilege(t)
	writer, _ := lp.component(t, "writer", writerGrant("proj-a"))
	dash, _ := lp.component(t, "dash", consumerGrant("dash", "proj-a"))
	operator, _ := lp.component(t, "operator", operatorGrant("proj-a"))
	for i := 1; i <= n; i++ { // a tick each, so that retention can take any prefix of them whole
		deletePrefixedTasksAs(t, lp, writer, "proj-a", fmt.Sprintf("t%d", i), 1)
		_, err := outbox.Sequence(testkit.Ctx(t), dash, []string{"proj-a"}, 100)
		require.NoError(t, err)
	}
	return lp, dash, operator
}

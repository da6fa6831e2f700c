package outbox_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
	"fusion/outbox/internal/testkit"
)

// The isolation tests: every role, row and client may be hostile or broken, and none may hurt
// another role, row or project. Each runs on a database migrated by an owner that is not a
// superuser, with one role per component.

func writerGrant(projects ...string) func(context.Context, outbox.DBTX, string) error {
	return func(ctx context.Context, db outbox.DBTX, role string) error {
		return outbox.GrantWriterRole(ctx, db, role, projects...)
	}
}

func consumerGrant(id outbox.ConsumerID, projects ...string) func(context.Context, outbox.DBTX, string) error {
	return func(ctx context.Context, db outbox.DBTX, role string) error {
		return outbox.GrantConsumerRole(ctx, db, role, id, projects...)
	}
}

func operatorGrant(projects ...string) func(context.Context, outbox.DBTX, string) error {
	return func(ctx context.Context, db outbox.DBTX, role string) error {
		return outbox.GrantOperatorRole(ctx, db, role, projects...)
	}
}

// deleteTasksAs creates n tasks in project (as the owner, like an import job) and deletes them
// through a writer on pool, the writer role's.
func deleteTasksAs(t *testing.T, lp *leastPrivilege, pool *pgxpool.Pool, project string, n int) {
	t.Helper()
	deletePrefixedTasksAs(t, lp, pool, project, "t", n)
}

// deletePrefixedTasksAs is deleteTasksAs for the tasks prefix-1 .. prefix-n.
func deletePrefixedTasksAs(t *testing.T, lp *leastPrivilege, pool *pgxpool.Pool, project, prefix string, n int) {
	t.Helper()
	ctx := testkit.Ctx(t)
	_, err := testhost.New(lp.owner, testhost.Options{}).CreateMany(ctx, project, prefix, n)
	require.NoError(t, err)
	w, err := outbox.NewWriter(pool, outbox.Config{}, zaptest.NewLogger(t))
	require.NoError(t, err)
	defer func() { _ = w.Close(ctx) }()
	store := testhost.New(pool, testhost.Options{Writer: w})
	for i := range n {
		_, err := store.Delete(ctx, project, fmt.Sprintf("%s-%d", prefix, i+1))
		require.NoError(t, err)
	}
}

// startConsumer runs consumer id over projects on pool (a consumer role's) and returns its
// recorder.
func startConsumer(t *testing.T, pool *pgxpool.Pool, id outbox.ConsumerID, projects []string, cfg outbox.Config, m *outbox.Metrics) (*outbox.Consumer, *testkit.Recorder) {
	t.Helper()
	rec := testkit.NewRecorder()
	return startRecording(t, pool, id, projects, cfg, m, rec), rec
}

// startRecording is startConsumer with the recorder given, for a test that sets what it fails
// (Recorder.SetFail) before the consumer starts.
func startRecording(t *testing.T, pool *pgxpool.Pool, id outbox.ConsumerID, projects []string, cfg outbox.Config, m *outbox.Metrics, rec *testkit.Recorder) *outbox.Consumer {
	t.Helper()
	d := outbox.NewDispatcher(outbox.DispatcherOptions{Listeners: []outbox.Listener{rec}, NoLocalWriter: true, Logger: zaptest.NewLogger(t)})
	c, err := outbox.NewConsumer(outbox.ConsumerOptions{ID: id, Pool: pool, Config: cfg, Projects: outbox.StaticProjects(projects),
		Dispatcher: d, Metrics: m, Logger: zaptest.NewLogger(t)})
	require.NoError(t, err)
	require.NoError(t, c.Start(testkit.Ctx(t)))
	t.Cleanup(func() { stopConsumer(t, c) })
	return c
}

func inProject(project string) func([]outbox.ObservedEvent) int {
	return func(evs []outbox.ObservedEvent) int {
		n := 0
		for _, ev := range evs {
			if ev.ProjectID == project {
				n++
			}
		}
		return n
	}
}

// hijackSQL plants, in public, overloads of built-ins the module calls, each a closer match for
// the argument types than the built-in. Run by whoever resolves an unqualified call to them,
// each tries to grant attacker every project, and records that it ran.
func hijackSQL(attacker string) []string {
	grab := func(fn string) string { return fmt.Sprintf("PERFORM public.hijack_grab('%s');", fn) }
	return []string{
		`CREATE TABLE public.hijack_calls (caller name NOT NULL DEFAULT current_user, fn text NOT NULL)`,
		`GRANT INSERT, SELECT ON public.hijack_calls TO PUBLIC`,
		fmt.Sprintf(`CREATE FUNCTION public.hijack_grab(fn text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.hijack_calls (fn) VALUES (fn);
    BEGIN
        INSERT INTO lifecycle_project_access (role_name, project_id) VALUES (%s, '*') ON CONFLICT DO NOTHING;
    EXCEPTION WHEN OTHERS THEN NULL;
    END;
END $$`, pgQuote(attacker)),
		`CREATE FUNCTION public.unnest(a text[]) RETURNS SETOF text LANGUAGE plpgsql AS $$
BEGIN ` + grab("unnest(text[])") + ` RETURN QUERY SELECT pg_catalog.unnest(a); END $$`,
		`CREATE FUNCTION public.unnest(a bigint[]) RETURNS SETOF bigint LANGUAGE plpgsql AS $$
BEGIN ` + grab("unnest(bigint[])") + ` RETURN QUERY SELECT pg_catalog.unnest(a); END $$`,
		`CREATE FUNCTION public.jsonb_build_object(k text, v integer) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN ` + grab("jsonb_build_object(text, integer)") + ` RETURN pg_catalog.jsonb_build_object(k, v); END $$`,
		`CREATE FUNCTION public.hijack_append(s text[], v text) RETURNS text[] LANGUAGE plpgsql AS $$
BEGIN ` + grab("array_agg(text)") + ` RETURN pg_catalog.array_append(s, v); END $$`,
		`CREATE AGGREGATE public.array_agg(text) (SFUNC = public.hijack_append, STYPE = text[])`,
		`CREATE FUNCTION public.pg_notify(c varchar, p text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN ` + grab("pg_notify(varchar, text)") + ` PERFORM pg_catalog.pg_notify(c, p); END $$`,
		`CREATE FUNCTION public.set_config(n varchar, v text, l boolean) RETURNS text LANGUAGE plpgsql AS $$
BEGIN ` + grab("set_config(varchar, text, boolean)") + ` RETURN pg_catalog.set_config(n, v, l); END $$`,
	}
}

func pgQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// TestSearchPathHijackIsRefused: on a database where every role may CREATE in public (the
// default before PostgreSQL 15), a project-A writer plants overloads of the built-ins the
// module calls. Nothing the owner, an all-projects consumer or the operator then does runs
// them, and the attacker never gains another project.
func TestSearchPathHijackIsRefused(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilegeWith(t, lpOptions{publicCreate: true})
	attacker, attackerRole := lp.component(t, "attacker", writerGrant("proj-a"))
	for _, stmt := range hijackSQL(attackerRole) {
		_, err := attacker.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}

	// The owner grants access to another role.
	require.NoError(t, outbox.GrantProjectAccess(ctx, lp.owner, "someone_else", "proj-c"))
	require.NoError(t, outbox.GrantConsumerAccess(ctx, lp.owner, "someone_else", "dash"))
	// Writers of every project delete; an all-projects consumer sequences and delivers.
	writer, _ := lp.component(t, "writer", writerGrant("*"))
	deleteTasksAs(t, lp, writer, "proj-a", 2)
	deleteTasksAs(t, lp, writer, "proj-b", 2)
	consumer, _ := lp.component(t, "consumer", consumerGrant("dash", "*"))
	_, rec := startConsumer(t, consumer, "dash", []string{"proj-a", "proj-b"}, testkit.FastConfig(), nil)
	rec.WaitCount(t, ctx, 4)
	// The operator reads status and dead letters, and runs retention.
	operator, _ := lp.component(t, "operator", operatorGrant("*"))
	admin := outbox.NewAdmin(operator, outbox.AdminOptions{})
	_, err := admin.Status(ctx, outbox.StatusFilter{})
	require.NoError(t, err)
	_, err = admin.DeadLetters(ctx, outbox.StatusFilter{})
	require.NoError(t, err)
	ret := testkit.NewRetention(t, operator, outbox.Config{})
	_, err = ret.Plan(ctx)
	require.NoError(t, err)
	_, err = ret.Sweep(ctx)
	require.NoError(t, err)

	require.Zero(t, pgtest.QueryInt(t, lp.owner, `SELECT count(*) FROM lifecycle_project_access WHERE role_name = $1 AND project_id = '*'`, attackerRole),
		"the attacker granted itself every project")
	rows, err := lp.owner.Query(ctx, `SELECT caller || ' ran ' || fn FROM public.hijack_calls ORDER BY 1`)
	require.NoError(t, err)
	calls, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Empty(t, calls, "no planted overload ran")
	require.Zero(t, pgtest.QueryInt(t, attacker, `SELECT (SELECT count(*) FROM lifecycle_outbox WHERE project_id <> 'proj-a')
		+ (SELECT count(*) FROM lifecycle_event_log WHERE project_id <> 'proj-a')`), "the attacker still sees only its project")
	require.Equal(t, 2, pgtest.QueryInt(t, attacker, `SELECT count(*) FROM lifecycle_event_log WHERE project_id = 'proj-a'`),
		"the attacker sees its own project's events")
}

// TestModuleInADedicatedSchema installs the module (and the host's tables) in a schema of
// their own, off public: every component works there, the functions pin that schema, and
// VerifySchema passes for each role.
func TestModuleInADedicatedSchema(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilegeWith(t, lpOptions{schema: "lifecycle"})
	var schemaOf string
	require.NoError(t, lp.owner.QueryRow(ctx, `SELECT relnamespace::regnamespace::text FROM pg_class WHERE oid = 'lifecycle_outbox'::regclass`).Scan(&schemaOf))
	require.Equal(t, "lifecycle", schemaOf)
	require.Zero(t, pgtest.QueryInt(t, lp.owner, `SELECT count(*) FROM pg_class WHERE relnamespace = 'public'::regnamespace AND relname LIKE 'lifecycle%'`))
	for _, fn := range []string{"lifecycle_outbox_tick(text)", "lifecycle_outbox_adopt_legacy(integer)",
		"lifecycle_outbox_read(text, bigint, integer, xid8, timestamptz, text)", "lifecycle_event_id(text, timestamptz)"} {
		var config []string
		require.NoError(t, lp.owner.QueryRow(ctx, `SELECT coalesce(proconfig, '{}') FROM pg_proc WHERE oid = $1::regprocedure`, fn).Scan(&config))
		require.Contains(t, config, "search_path=pg_catalog, lifecycle, pg_temp", fn)
	}

	writer, _ := lp.component(t, "writer", writerGrant("proj-a"))
	consumer, _ := lp.component(t, "consumer", consumerGrant("dash", "proj-a"))
	operator, _ := lp.component(t, "operator", operatorGrant("proj-a"))
	for _, pool := range []*pgxpool.Pool{writer, consumer, operator} {
		require.NoError(t, outbox.VerifySchema(ctx, pool))
	}
	deleteTasksAs(t, lp, writer, "proj-a", 3)
	_, rec := startConsumer(t, consumer, "dash", []string{"proj-a"}, testkit.FastConfig(), nil)
	rec.WaitCount(t, ctx, 3)
	require.Eventually(t, func() bool {
		rows, err := outbox.NewAdmin(operator, outbox.AdminOptions{}).Status(ctx, outbox.StatusFilter{ConsumerID: "dash"})
		return err == nil && len(rows) == 1 && rows[0].Cursor != nil && *rows[0].Cursor == 3
	}, testkit.WaitLimit, 10*time.Millisecond)
}

var moduleTables = []string{"lifecycle_outbox", "lifecycle_event_log", "lifecycle_tick", "lifecycle_tick_project", "lifecycle_outbox_heads",
	"lifecycle_consumer_cursors", "lifecycle_consumer_deliveries", "lifecycle_audit", "lifecycle_project_access"}

// TestComponentRolesHoldOnlyWhatTheyUse: neither the writer role nor the consumer role can
// take a lock that would block other projects or the ticker, truncate, or delete an event; neither
// can number an event or renumber one (write a tick, a tick's count or a head, or change an
// event); the writer cannot choose its event's transaction (which decides its tick) and cannot
// run the ticker.
func TestComponentRolesHoldOnlyWhatTheyUse(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilege(t)
	writer, _ := lp.component(t, "writer", writerGrant("proj-a"))
	consumer, _ := lp.component(t, "consumer", consumerGrant("dash", "proj-a"))
	deleteTasksAs(t, lp, writer, "proj-a", 2)
	_, err := outbox.Sequence(ctx, consumer, []string{"proj-a"}, 100)
	require.NoError(t, err)

	lock := func(pool *pgxpool.Pool, table, mode string) error {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		_, err = tx.Exec(ctx, `LOCK TABLE `+table+` IN `+mode+` MODE NOWAIT`)
		return err
	}
	for name, pool := range map[string]*pgxpool.Pool{"writer": writer, "consumer": consumer} {
		for _, table := range moduleTables {
			for _, mode := range []string{"ACCESS EXCLUSIVE", "EXCLUSIVE", "SHARE ROW EXCLUSIVE", "SHARE"} {
				err := lock(pool, table, mode)
				require.Error(t, err, "%s took %s on %s", name, mode, table)
				requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
			}
			_, err := pool.Exec(ctx, `TRUNCATE `+table)
			requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
		}
		for _, stmt := range []string{
			`DELETE FROM lifecycle_outbox WHERE project_id = 'proj-a'`,
			`DELETE FROM lifecycle_event_log WHERE project_id = 'proj-a'`,
			`DELETE FROM lifecycle_consumer_deliveries WHERE project_id = 'proj-a'`,
			`INSERT INTO lifecycle_outbox (project_id, task_id, deleted_at, sequence, event_type, archived, payload_version, occurred_at, writer_process_id)
			 VALUES ('proj-a', 'preset', now(), 3, 'task:deleted', false, 1, now(), 'w-0000000000000000')`,
			`UPDATE lifecycle_outbox SET writer_process_id = 'someone-else' WHERE project_id = 'proj-a'`,
			`UPDATE lifecycle_outbox SET sequence = sequence + 10 WHERE project_id = 'proj-a'`,
			`UPDATE lifecycle_event_log SET writer_process_id = 'someone-else' WHERE project_id = 'proj-a'`,
			`UPDATE lifecycle_event_log SET txid = txid WHERE project_id = 'proj-a'`,
			`INSERT INTO lifecycle_tick (tick_id, snapshot) VALUES (1000, pg_current_snapshot())`,
			`UPDATE lifecycle_tick SET snapshot = pg_current_snapshot()`,
			`DELETE FROM lifecycle_tick`,
			`INSERT INTO lifecycle_tick_project (tick_id, project_id, first_sequence, events) VALUES (1000, 'proj-a', 3, 1)`,
			`UPDATE lifecycle_tick_project SET first_sequence = first_sequence + 10 WHERE project_id = 'proj-a'`,
			`DELETE FROM lifecycle_tick_project WHERE project_id = 'proj-a'`,
			`INSERT INTO lifecycle_outbox_heads (project_id) VALUES ('proj-a') ON CONFLICT DO NOTHING`,
			`UPDATE lifecycle_outbox_heads SET last_sequence = last_sequence + 10 WHERE project_id = 'proj-a'`,
		} {
			_, err := pool.Exec(ctx, stmt)
			require.Error(t, err, "%s: %s", name, stmt)
			requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
		}
	}
	// The writer inserts into the log, but the database sets the transaction.
	_, err = writer.Exec(ctx, `INSERT INTO lifecycle_event_log (project_id, task_id, deleted_at, event_type, archived, payload_version,
		occurred_at, writer_process_id, txid) VALUES ('proj-a', 'early', now(), 'task:deleted', false, 1, now(), 'w-0000000000000000', '1')`)
	requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
	for _, call := range []string{`SELECT * FROM lifecycle_outbox_tick(NULL)`, `SELECT lifecycle_outbox_adopt_legacy(1)`} {
		_, err = writer.Exec(ctx, call)
		requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
	}
	// The consumer ticks (the owner's function numbers) but inserts no event.
	_, err = consumer.Exec(ctx, `INSERT INTO lifecycle_event_log (project_id, task_id, deleted_at, event_type, archived, payload_version,
		occurred_at, writer_process_id) VALUES ('proj-a', 'forged', now(), 'task:deleted', false, 1, now(), 'w-0000000000000000')`)
	requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
	require.Equal(t, []string{"1=t-1", "2=t-2"}, numberedEvents(t, ctx, lp.owner, "proj-a"), "nothing was renumbered")
}

// TestConsumerRoleMovesOnlyItsOwnCursor: a consumer role reads every cursor of its projects
// but writes only its own identity's cursor and deliveries, and cannot ask for a replay.
func TestConsumerRoleMovesOnlyItsOwnCursor(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilege(t)
	writer, _ := lp.component(t, "writer", writerGrant("proj-a"))
	dash, _ := lp.component(t, "dash", consumerGrant("dash", "proj-a"))
	engine, _ := lp.component(t, "engine", consumerGrant("engine", "proj-a"))
	operator, _ := lp.component(t, "operator", operatorGrant("proj-a"))
	deleteTasksAs(t, lp, writer, "proj-a", 2)
	_, err := outbox.Sequence(ctx, engine, []string{"proj-a"}, 100)
	require.NoError(t, err)
	// Each consumer writes its own state, as the consumer does; engine parked event 1.
	for _, stmt := range []string{
		`INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id) VALUES ('proj-a', 'engine')`,
		`UPDATE lifecycle_consumer_cursors SET last_acked_sequence = 1 WHERE consumer_id = 'engine'`,
		`INSERT INTO lifecycle_consumer_deliveries (project_id, consumer_id, sequence, event_id, state, attempts, last_failure_class, parked_at)
		 SELECT 'proj-a', 'engine', 1, lifecycle_event_id(task_id, deleted_at), 'dead', 10, 'listener_error', now()
		 FROM lifecycle_outbox_read('proj-a', 0, 1, NULL, NULL, NULL)`,
	} {
		tag, err := engine.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
		require.Equal(t, int64(1), tag.RowsAffected(), stmt)
	}
	_, err = dash.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id) VALUES ('proj-a', 'dash')`)
	require.NoError(t, err)

	require.Equal(t, 2, pgtest.QueryInt(t, dash, `SELECT count(*) FROM lifecycle_consumer_cursors`), "status sees every consumer")
	for _, stmt := range []string{
		`UPDATE lifecycle_consumer_cursors SET last_acked_sequence = 2 WHERE consumer_id = 'engine'`,
		`UPDATE lifecycle_consumer_deliveries SET state = 'resolved', resolved_at = now() WHERE consumer_id = 'engine'`,
		`SELECT 1 FROM lifecycle_consumer_cursors WHERE consumer_id = 'engine' FOR UPDATE`,
	} {
		tag, err := dash.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
		require.Zero(t, tag.RowsAffected(), "dash touched engine's state: %s", stmt)
	}
	for _, stmt := range []string{
		`INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id) VALUES ('proj-a', 'intruder')`,
		`INSERT INTO lifecycle_consumer_deliveries (project_id, consumer_id, sequence, event_id, state, attempts, parked_at)
		 VALUES ('proj-a', 'engine', 2, 'task-deleted:t-2:2026-01-01T00:00:00.000000Z', 'dead', 1, now())`,
		`INSERT INTO lifecycle_audit (project_id, action, consumer_id, event_id, sequence, attempts)
		 VALUES ('proj-a', 'lifecycle-observation:consumer-poisoned', 'engine', 'task-deleted:t-2:2026-01-01T00:00:00.000000Z', 2, 10)`,
	} {
		_, err := dash.Exec(ctx, stmt)
		requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
	}
	require.Equal(t, int64(1), testkit.CursorOf(t, lp.owner, "proj-a", "engine"))

	// A consumer cannot replay its own dead letter, nor name who asked.
	_, err = engine.Exec(ctx, `UPDATE lifecycle_consumer_deliveries SET replay_requested_by = 'oncall', replay_reason = 'FN-1' WHERE sequence = 1`)
	requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
	_, err = engine.Exec(ctx, `UPDATE lifecycle_consumer_deliveries SET state = 'replay_requested' WHERE sequence = 1`)
	require.Error(t, err)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Contains(t, []string{pgerrcode.InsufficientPrivilege, pgerrcode.CheckViolation}, pgErr.Code, pgErr.Message)
	// The operator can, and the owning consumer's own cursor still moves.
	_, err = outbox.NewAdmin(operator, outbox.AdminOptions{}).RequestReplay(ctx, outbox.ReplayRequest{ProjectID: "proj-a",
		ConsumerID: "engine", Sequence: 1, Operator: outbox.Operator{Actor: "oncall", Reason: "FN-1"}})
	require.NoError(t, err)
	tag, err := dash.Exec(ctx, `UPDATE lifecycle_consumer_cursors SET last_acked_sequence = 2 WHERE consumer_id = 'dash'`)
	require.NoError(t, err)
	require.Equal(t, int64(1), tag.RowsAffected())
}

// TestModuleTransactionsBoundTheirLockWaits: a mutating call whose row is locked by a stuck
// transaction fails with a lock timeout instead of waiting as long as the caller's context.
func TestModuleTransactionsBoundTheirLockWaits(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilege(t)
	consumer, _ := lp.component(t, "consumer", consumerGrant("c1", "p"))
	operator, _ := lp.component(t, "operator", operatorGrant("p"))
	_, err := consumer.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id) VALUES ('p', 'c1')`)
	require.NoError(t, err)

	stuck, err := lp.owner.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = stuck.Rollback(ctx) }()
	_, err = stuck.Exec(ctx, `SELECT 1 FROM lifecycle_consumer_cursors WHERE consumer_id = 'c1' FOR UPDATE`)
	require.NoError(t, err)

	callCtx, cancel := context.WithTimeout(ctx, testkit.WaitLimit)
	defer cancel()
	admin := outbox.NewAdmin(operator, outbox.AdminOptions{LockTimeout: 100 * time.Millisecond})
	_, err = admin.RetireConsumer(callCtx, outbox.RetireRequest{ConsumerID: "c1", Operator: outbox.Operator{Actor: "oncall", Reason: "FN-1"}})
	require.NoError(t, callCtx.Err(), "the call waited for the caller's deadline: %v", err)
	requireSQLState(t, err, pgerrcode.LockNotAvailable)
}

// TestPoisonedProjectDoesNotStopAnother: project A holds a row numbered by hand above its head
// (where the old sequencer numbered next) and a lease that never expires; project C a retry due
// at 'infinity' (all written before the database refused them). Project B is delivered in full,
// A's row hides none of A's events (the log is numbered after it), and status and metrics
// report B (and C) while A is left out and counted.
func TestPoisonedProjectDoesNotStopAnother(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilegeWith(t, lpOptions{through: 3})
	for _, stmt := range []string{
		`INSERT INTO lifecycle_outbox (project_id, task_id, deleted_at, sequence, event_type, archived, payload_version, occurred_at, writer_process_id)
		 VALUES ('proj-a', 'preset', '2026-01-02T03:04:05Z', 1, 'task:deleted', false, 1, now(), 'intruder-0000000000000000')`,
		`INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence, lease_owner, lease_epoch, lease_expires_at)
		 VALUES ('proj-a', 'ghost', 0, 'ghost@0000000000000000', 1, 'infinity')`,
		`INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence) VALUES ('proj-c', 'dash', 0)`,
		`INSERT INTO lifecycle_consumer_deliveries (project_id, consumer_id, sequence, event_id, state, attempts, next_attempt_at,
		     last_failure_class, first_failed_at, last_failed_at)
		 VALUES ('proj-c', 'dash', 1, 'task-deleted:t-1:2026-01-02T03:04:05.000000Z', 'retrying', 1, 'infinity', 'listener_error', now(), now())`,
	} {
		_, err := lp.owner.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	lp.finishMigration(t)

	writer, _ := lp.component(t, "writer", writerGrant("proj-a", "proj-b", "proj-c"))
	deleteTasksAs(t, lp, writer, "proj-a", 3)
	deleteTasksAs(t, lp, writer, "proj-b", 5)
	deleteTasksAs(t, lp, writer, "proj-c", 2)
	consumer, _ := lp.component(t, "consumer", consumerGrant("dash", "proj-a", "proj-b", "proj-c"))
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	require.NoError(t, err)
	_, rec := startConsumer(t, consumer, "dash", []string{"proj-a", "proj-b", "proj-c"}, testkit.FastConfig(), m)

	waitCtx, cancel := context.WithTimeout(ctx, testkit.WaitLimit)
	defer cancel()
	rec.WaitFor(t, waitCtx, "project B in full", func(evs []outbox.ObservedEvent) bool { return inProject("proj-b")(evs) == 5 })
	testkit.WaitCursor(t, waitCtx, lp.owner, "proj-b", "dash", 5)
	evs := rec.WaitFor(t, waitCtx, "project A in full", func(evs []outbox.ObservedEvent) bool { return inProject("proj-a")(evs) == 4 })
	var aTasks []string
	for _, ev := range evs {
		if ev.ProjectID == "proj-a" {
			aTasks = append(aTasks, fmt.Sprintf("%d=%s", ev.Sequence, ev.TaskID))
		}
	}
	require.Equal(t, []string{"1=preset", "2=t-1", "3=t-2", "4=t-3"}, aTasks, "the row numbered by hand hid none of A's events")
	require.Zero(t, inProject("proj-c")(rec.Snapshot()), "C waits for its retry")

	operator, _ := lp.component(t, "operator", operatorGrant("*"))
	rows, err := outbox.NewAdmin(operator, outbox.AdminOptions{}).Status(ctx, outbox.StatusFilter{})
	var pe *outbox.ProjectErrors
	require.ErrorAs(t, err, &pe, "status names the project it left out")
	require.Equal(t, []string{"proj-a"}, pe.Projects())
	var projects []string
	for _, r := range rows {
		projects = append(projects, r.ProjectID+"/"+r.ConsumerID)
	}
	require.Equal(t, []string{"proj-b/dash", "proj-c/dash"}, projects)

	fams := scrape(t, reg)
	requireSample(t, fams, 0, "outbox_consumer_lag_events", "project", "proj-b", "consumer", "dash")
	requireSample(t, fams, 1, "outbox_deliveries_retrying", "project", "proj-c", "consumer", "dash")
	_, ok := sample(fams, "outbox_consumer_lag_events", "project", "proj-a", "consumer", "dash")
	require.False(t, ok, "A's gauges are left out")
	errs, ok := sample(fams, "outbox_status_errors_total")
	require.True(t, ok)
	require.GreaterOrEqual(t, errs, 1.0)
}

// TestDatabaseRefusesMalformedRows: whoever writes them, even the owner, the database refuses
// identifiers and times the module never writes.
func TestDatabaseRefusesMalformedRows(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilege(t)
	_, err := lp.owner.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id) VALUES ('p', 'c1')`)
	require.NoError(t, err)
	// An event as the log's writers and the stream's older ones wrote it, with one value changed.
	eventIn := func(table, col, value string) string {
		vals := map[string]string{"project_id": "'p'", "task_id": "'t1'", "deleted_at": "now()", "occurred_at": "now()",
			"writer_process_id": "'w-0000000000000000'", "prior_column": "NULL"}
		vals[col] = value
		return fmt.Sprintf(`INSERT INTO %s (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id, prior_column)
			VALUES (%s, %s, %s, 'task:deleted', false, 1, %s, %s, %s)`, table, vals["project_id"], vals["task_id"], vals["deleted_at"],
			vals["occurred_at"], vals["writer_process_id"], vals["prior_column"])
	}
	events := map[string][2]string{
		"task ID with an escape sequence":  {"task_id", `E'evil\x1b[2J'`},
		"task ID with a newline":           {"task_id", `E'two\nlines'`},
		"task ID with a carriage return":   {"task_id", `E'cr\r'`},
		"task ID of 2 MB":                  {"task_id", `repeat('x', 2000000)`},
		"empty task ID":                    {"task_id", `''`},
		"empty writer process ID":          {"writer_process_id", `''`},
		"writer process ID with an escape": {"writer_process_id", `E'w\x1b[K'`},
		"prior column with a newline":      {"prior_column", `E'col\n'`},
		"deleted_at infinity":              {"deleted_at", `'infinity'`},
		"occurred_at -infinity":            {"occurred_at", `'-infinity'`},
		"project ID that is not one":       {"project_id", `'two words'`},
	}
	delivery := func(eventID, nextAttempt string) string {
		return fmt.Sprintf(`INSERT INTO lifecycle_consumer_deliveries (project_id, consumer_id, sequence, event_id, state, attempts,
			next_attempt_at, last_failure_class, first_failed_at, last_failed_at)
			VALUES ('p', 'c1', 1, %s, 'retrying', 1, %s, 'listener_error', now(), now())`, eventID, nextAttempt)
	}
	const okEventID = `'task-deleted:t1:2026-01-02T03:04:05.000000Z'`
	cases := map[string]string{
		"head sequenced at infinity":       `INSERT INTO lifecycle_outbox_heads (project_id, sequenced_at) VALUES ('p', 'infinity')`,
		"lease that never expires":         `UPDATE lifecycle_consumer_cursors SET lease_expires_at = 'infinity' WHERE consumer_id = 'c1'`,
		"lease owner with an escape":       `UPDATE lifecycle_consumer_cursors SET lease_owner = E'c1@\x1b[K' WHERE consumer_id = 'c1'`,
		"retired by prose":                 `UPDATE lifecycle_consumer_cursors SET retired_at = now(), retired_by = 'someone, surely' WHERE consumer_id = 'c1'`,
		"retired for a reason in prose":    `UPDATE lifecycle_consumer_cursors SET retired_at = now(), retired_by = 'oncall', retired_reason = 'it broke, sorry' WHERE consumer_id = 'c1'`,
		"retired by nobody":                `UPDATE lifecycle_consumer_cursors SET retired_at = now() WHERE consumer_id = 'c1'`,
		"cursor below zero":                `UPDATE lifecycle_consumer_cursors SET last_acked_sequence = -1 WHERE consumer_id = 'c1'`,
		"lease epoch below zero":           `UPDATE lifecycle_consumer_cursors SET lease_epoch = -1 WHERE consumer_id = 'c1'`,
		"lease owner of 129 characters":    `UPDATE lifecycle_consumer_cursors SET lease_owner = repeat('c', 112) || '@0123456789abcdef' WHERE consumer_id = 'c1'`,
		"lease owner without an instance":  `UPDATE lifecycle_consumer_cursors SET lease_owner = 'c1' WHERE consumer_id = 'c1'`,
		"reconciled for no known reason":   `UPDATE lifecycle_consumer_cursors SET reconciled_at = now(), reconcile_reason = 'felt like it' WHERE consumer_id = 'c1'`,
		"heartbeat at -infinity":           `UPDATE lifecycle_consumer_cursors SET heartbeat_at = '-infinity' WHERE consumer_id = 'c1'`,
		"next attempt in 300 years":        delivery(okEventID, `now() + interval '300 years'`),
		"next attempt at infinity":         delivery(okEventID, `'infinity'`),
		"event ID with control characters": delivery(`E'\r\x1b[K (all checks passed, type y)'`, `now() + interval '1 second'`),
		"replay reason in prose":           `INSERT INTO lifecycle_consumer_deliveries (project_id, consumer_id, sequence, event_id, state, attempts, replay_requested_at, replay_requested_by, replay_reason) VALUES ('p', 'c1', 2, ` + okEventID + `, 'replay_requested', 10, now(), 'oncall', E'it broke,\nplease fix')`,
		"replay request without requester": `INSERT INTO lifecycle_consumer_deliveries (project_id, consumer_id, sequence, event_id, state, attempts) VALUES ('p', 'c1', 2, ` + okEventID + `, 'replay_requested', 10)`,
		"audit reason in prose":            `INSERT INTO lifecycle_audit (project_id, action, consumer_id, actor, reason) VALUES ('p', 'lifecycle-observation:consumer-retired', 'c1', 'oncall', 'because I said so')`,
	}
	for name, e := range events {
		cases["stream: "+name] = eventIn("lifecycle_outbox", e[0], e[1])
		cases["log: "+name] = eventIn("lifecycle_event_log", e[0], e[1])
	}
	for name, stmt := range cases {
		_, err := lp.owner.Exec(ctx, stmt)
		require.Error(t, err, name)
		requireSQLState(t, err, pgerrcode.CheckViolation)
	}
}

// TestUndecodableEventBecomesDeadLetter: a row whose deleted_at cannot be decoded (written
// before the database refused it) is parked as a dead letter of its own class, audited, and
// the stream goes on past it. Neither it nor a row of a project that cannot exist (both left
// unnumbered, and both refused by the log's types) stops the rows of older writers from being
// adopted into the log.
func TestUndecodableEventBecomesDeadLetter(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilegeWith(t, lpOptions{through: 3})
	for _, stmt := range []string{
		`INSERT INTO lifecycle_outbox (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
		 VALUES ('p', 'forever', 'infinity', 'task:deleted', false, 1, now() - interval '1 minute', 'w-0000000000000000')`,
		`INSERT INTO lifecycle_outbox (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
		 VALUES ('no such project', 'orphan', now(), 'task:deleted', false, 1, now(), 'w-0000000000000000')`,
	} {
		_, err := lp.owner.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	lp.finishMigration(t)

	writer, _ := lp.component(t, "writer", writerGrant("p"))
	deleteTasksAs(t, lp, writer, "p", 3)
	consumer, _ := lp.component(t, "consumer", consumerGrant("c1", "p"))
	_, rec := startConsumer(t, consumer, "c1", []string{"p"}, testkit.FastConfig(), nil)
	waitCtx, cancel := context.WithTimeout(ctx, testkit.WaitLimit)
	defer cancel()
	evs := rec.WaitCount(t, waitCtx, 3)
	require.Equal(t, []int64{2, 3, 4}, []int64{evs[0].Sequence, evs[1].Sequence, evs[2].Sequence})
	testkit.WaitCursor(t, waitCtx, lp.owner, "p", "c1", 4)
	require.Equal(t, testkit.DeliveryRow{State: "dead", Attempts: 1, Class: "undecodable_event"}, testkit.DeliveryOf(t, lp.owner, "c1", 1))
	var eventID string
	require.NoError(t, lp.owner.QueryRow(ctx, `SELECT event_id FROM lifecycle_audit WHERE action = $1 AND sequence = 1`,
		outbox.AuditConsumerPoisoned).Scan(&eventID))
	require.Equal(t, "task-deleted:forever:infinity", eventID)

	// A writer of schema 16 still inserts pending rows during a rolling deploy: adopted and delivered.
	_, err := lp.owner.Exec(ctx, insertPendingRow, "p", "t-legacy")
	require.NoError(t, err)
	evs = rec.WaitCount(t, waitCtx, 4)
	require.Equal(t, "t-legacy", evs[3].TaskID)
	require.Equal(t, int64(5), evs[3].Sequence)

	// The check that row violates was left NOT VALID by the upgrade; verify lists it.
	unvalidated, err := outbox.UnvalidatedChecks(ctx, lp.owner)
	require.NoError(t, err)
	require.Equal(t, []string{"lifecycle_outbox.lifecycle_outbox_project_id_format", "lifecycle_outbox.lifecycle_outbox_times_finite"}, unvalidated)
}

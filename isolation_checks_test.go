package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/outboxtest"
)

// Isolation checks that need no second role: clamped waits, the migration lock, the wake-up
// flood, the schema verification, the ticker's grants and ListenDSN validation.

// TestRetryWaitFarInTheFutureIsClamped: a retry due 300 years ahead (written before the
// database refused it) would overflow a time.Duration into a negative wait; the consumer waits
// at most a day instead of spinning.
func TestRetryWaitFarInTheFutureIsClamped(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilegeWith(t, lpOptions{through: 3})
	for _, stmt := range []string{
		`INSERT INTO lifecycle_outbox (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
		 VALUES ('p', 't1', '2026-01-02T03:04:05Z', 'task:deleted', false, 1, now(), 'w-0000000000000000')`,
		`INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence) VALUES ('p', 'c1', 0)`,
		`INSERT INTO lifecycle_consumer_deliveries (project_id, consumer_id, sequence, event_id, state, attempts, next_attempt_at,
		     last_failure_class, first_failed_at, last_failed_at)
		 VALUES ('p', 'c1', 1, 'task-deleted:t1:2026-01-02T03:04:05.000000Z', 'retrying', 1, now() + interval '300 years', 'listener_error', now(), now())`,
	} {
		_, err := lp.owner.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	lp.finishMigration(t)
	consumer, _ := lp.component(t, "consumer", consumerGrant("c1", "p"))
	clock := outboxtest.NewFakeClock()
	startConsumer(t, consumer, "c1", []string{"p"}, retryConfig(clock), nil)

	waitCtx, cancel := context.WithTimeout(ctx, testkit.WaitLimit)
	defer cancel()
	wait, err := clock.WaitForTimer(waitCtx, time.Hour)
	require.NoError(t, err, "the consumer never waited for the retry: it spins")
	require.LessOrEqual(t, wait, 24*time.Hour)
}

// TestMigrationLockTimeoutNamesTheHolder: any role can hold the fixed migration lock; when
// Migrate gives up waiting, its error says which session holds it.
func TestMigrationLockTimeoutNamesTheHolder(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilege(t)
	squatterPool, squatter := lp.component(t, "squatter", writerGrant("p"))
	cfg := squatterPool.Config().ConnConfig.Copy()
	cfg.RuntimeParams["application_name"] = "lock-squatter"
	conn, err := pgx.ConnectConfig(ctx, cfg)
	require.NoError(t, err)
	defer conn.Close(ctx)
	var pid int32
	require.NoError(t, conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid))
	_, err = conn.Exec(ctx, `SELECT pg_advisory_lock(7811887614498534520)`) // the module's key, "lifeoutx"
	require.NoError(t, err)

	migrateCtx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	_, err = outbox.Migrate(migrateCtx, lp.owner)
	require.Error(t, err)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Contains(t, err.Error(), fmt.Sprintf("held by pid %d (user %q, application %q)", pid, squatter, "lock-squatter"))
}

// TestNotifyFloodCostsOneScanPerWakeInterval: a flood of notifications for one project
// (anyone who can connect may send them) starts one scan of it per wake interval, not one per
// notification; a notification for another project is still acted on at once.
func TestNotifyFloodCostsOneScanPerWakeInterval(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilege(t)
	writer, _ := lp.component(t, "writer", writerGrant("p", "q"))
	consumer, _ := lp.component(t, "consumer", consumerGrant("c1", "p", "q"))
	_, err := testhost.New(lp.owner, testhost.Options{}).CreateMany(ctx, "q", "t", 1)
	require.NoError(t, err)
	cfg := outbox.Config{PollInterval: time.Hour, WakeInterval: time.Hour, LeaseTTL: time.Hour, HeartbeatInterval: 20 * time.Minute,
		NewCursor: outbox.NewCursorOldest}
	c, rec := startConsumer(t, consumer, "c1", []string{"p", "q"}, cfg, nil)
	require.Eventually(t, func() bool { return c.Stats().Scans >= 1 }, testkit.WaitLimit, 5*time.Millisecond, "the first scan")
	before := c.Stats().Scans

	for range 200 { // on the channel consumers listen to (the ticker's announcements)
		_, err := writer.Exec(ctx, `SELECT pg_notify('lifecycle_outbox_tick', 'p')`)
		require.NoError(t, err)
	}
	w, err := outbox.NewWriter(writer, cfg, zaptest.NewLogger(t))
	require.NoError(t, err)
	defer func() { _ = w.Close(ctx) }()
	_, err = testhost.New(writer, testhost.Options{Writer: w}).Delete(ctx, "q", "t-1") // notifies q after the flood
	require.NoError(t, err)
	rec.WaitCount(t, ctx, 1)
	require.LessOrEqual(t, c.Stats().Scans-before, int64(2), "one scan for the flood of p, one for q")
}

// TestVerifySchemaChecksIsolationObjects: VerifySchema notices when what the isolation rests
// on was changed by hand, though the version and checksums still match.
func TestVerifySchemaChecksIsolationObjects(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ tamper, says string }{
		{`ALTER TABLE lifecycle_consumer_cursors NO FORCE ROW LEVEL SECURITY`, "row-level security is not forced on lifecycle_consumer_cursors"},
		{`ALTER TABLE lifecycle_outbox DISABLE ROW LEVEL SECURITY`, "row-level security is not enabled on lifecycle_outbox"},
		{`DROP POLICY lifecycle_consumer_deliveries_consumer_update ON lifecycle_consumer_deliveries`, "policy lifecycle_consumer_deliveries_consumer_update on lifecycle_consumer_deliveries is missing"},
		{`ALTER TABLE lifecycle_event_log NO FORCE ROW LEVEL SECURITY`, "row-level security is not forced on lifecycle_event_log"},
		{`DROP POLICY lifecycle_tick_project_project_scope ON lifecycle_tick_project`, "policy lifecycle_tick_project_project_scope on lifecycle_tick_project is missing"},
		{`ALTER FUNCTION lifecycle_outbox_tick(text) RESET search_path`, "function lifecycle_outbox_tick(text) does not pin search_path"},
		{`ALTER FUNCTION lifecycle_outbox_read(text, bigint, integer, xid8, timestamptz, text) RESET search_path`,
			"function lifecycle_outbox_read(text, bigint, integer, xid8, timestamp with time zone, text) does not pin search_path"},
		{`GRANT EXECUTE ON FUNCTION lifecycle_outbox_tick(text) TO PUBLIC`, "PUBLIC may execute lifecycle_outbox_tick"},
		{`GRANT EXECUTE ON FUNCTION lifecycle_outbox_adopt_legacy(integer) TO PUBLIC`, "PUBLIC may execute lifecycle_outbox_adopt_legacy"},
		{`ALTER FUNCTION lifecycle_outbox_tick(text) SECURITY INVOKER`, "lifecycle_outbox_tick(text) does not run as its owner"},
	} {
		t.Run(c.says, func(t *testing.T) {
			t.Parallel()
			ctx := testkit.Ctx(t) // its own: a parallel subtest waits for a slot, a deadline taken above could pass meanwhile
			pool := pgtest.NewPool(t)
			require.NoError(t, outbox.VerifySchema(ctx, pool))
			_, err := pool.Exec(ctx, c.tamper)
			require.NoError(t, err)
			err = outbox.VerifySchema(ctx, pool)
			require.ErrorIs(t, err, outbox.ErrSchemaDrift)
			require.Contains(t, err.Error(), c.says)
		})
	}
}

// TestTickerIsNotExecutableByPublic: a role that may read the tables the ticker reads and
// writes, but was not granted its functions, cannot run them (PUBLIC has no EXECUTE): it can
// neither number events nor move older writers' rows into the log.
func TestTickerIsNotExecutableByPublic(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilege(t)
	reader, _ := lp.component(t, "reader", func(ctx context.Context, db outbox.DBTX, role string) error {
		_, err := db.Exec(ctx, `GRANT SELECT ON lifecycle_outbox, lifecycle_outbox_pending, lifecycle_event_log, lifecycle_tick,
			lifecycle_tick_project, lifecycle_outbox_heads, lifecycle_project_access TO `+pgx.Identifier{role}.Sanitize())
		return err
	})
	for fn, call := range map[string]string{
		"lifecycle_outbox_tick":         `SELECT * FROM lifecycle_outbox_tick(NULL)`,
		"lifecycle_outbox_adopt_legacy": `SELECT lifecycle_outbox_adopt_legacy(1)`,
	} {
		_, err := reader.Exec(ctx, call)
		require.Error(t, err, fn)
		requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
		require.Contains(t, err.Error(), "permission denied for function "+fn)
	}
	_, err := outbox.Tick(ctx, reader)
	requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
}

// TestConfigValidatesListenDSNWithoutEchoingIt: a ListenDSN or a ReadDSN that does not parse is
// refused by Validate, naming the field and none of the string (pgx's own message repeats part
// of a password that holds a space).
func TestConfigValidatesListenDSNWithoutEchoingIt(t *testing.T) {
	t.Parallel()
	fields := map[string]func(string) outbox.Config{
		"ListenDSN": func(dsn string) outbox.Config { return outbox.Config{ListenDSN: dsn} },
		"ReadDSN":   func(dsn string) outbox.Config { return outbox.Config{ReadDSN: dsn} },
	}
	for field, cfg := range fields {
		for _, dsn := range []string{"password=my Sup3rSecret phrase host=db", "host=db password=my Sup3rSecret phrase", "postgres://u:my Sup3rSecret phrase@db/x", "host=db port=x password=Sup3rSecret"} {
			err := cfg(dsn).WithDefaults().Validate()
			require.Error(t, err, dsn)
			require.Contains(t, err.Error(), field)
			require.NotContains(t, err.Error(), "Sup3rSecret")
			require.NotContains(t, err.Error(), "phrase")
			var v *outbox.ValidationError
			require.True(t, errors.As(err, &v))
		}
		require.NoError(t, cfg("host=db user=listener password='my Sup3rSecret phrase'").WithDefaults().Validate())
	}
	// A ReadDSN behind a transaction pooler must be safe there, like the pool; ReadMaxLag has
	// bounds.
	c := outbox.Config{TransactionPooler: true, ReadDSN: "host=pgbouncer password=Sup3rSecret"}.WithDefaults()
	err := c.Validate()
	require.ErrorContains(t, err, "ReadDSN (read_dsn): is not safe behind a transaction pooler")
	require.NotContains(t, err.Error(), "Sup3rSecret")
	c.ReadDSN += " default_query_exec_mode=exec"
	require.NoError(t, c.Validate())
	require.Equal(t, 5*time.Second, c.ReadMaxLag, "the default")
	for _, lag := range []time.Duration{time.Millisecond, 11 * time.Minute} {
		require.ErrorContains(t, outbox.Config{ReadMaxLag: lag}.WithDefaults().Validate(), "ReadMaxLag (read_max_lag): must be between 10ms and 10m")
	}
}

// TestIdentifierChecksRefuseWhatTheyRefusedBefore: the heads', cursors' and project grants'
// identifier checks lost their bounded repetition (migration 0010, for speed) but accept and
// refuse the same values: up to 128 characters from the class, starting with a letter or digit.
func TestIdentifierChecksRefuseWhatTheyRefusedBefore(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	longest := "a" + strings.Repeat("b._:-", 25) + "cd" // 128 characters
	require.Len(t, longest, 128)
	statements := []string{
		`INSERT INTO lifecycle_outbox_heads (project_id) VALUES ($1)`,
		`INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id) VALUES ($1, 'c1')`,
		`INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id) VALUES ('p', $1)`,
		`INSERT INTO lifecycle_project_access (role_name, project_id) VALUES ('someone', $1)`,
	}
	for i, stmt := range statements {
		_, err := pool.Exec(ctx, stmt, fmt.Sprintf("%s%d", longest[:127], i))
		require.NoError(t, err, "128 characters: %s", stmt)
		for _, bad := range []string{longest + "x", ".leading-dot", "two words", "caf\u00e9", "", "tab\there"} {
			_, err := pool.Exec(ctx, stmt, bad)
			require.Error(t, err, "%q: %s", bad, stmt)
			requireSQLState(t, err, pgerrcode.CheckViolation)
		}
	}
	_, err := pool.Exec(ctx, statements[3], "*")
	require.NoError(t, err, "every project")
}

// TestCursorChecksLiveInTheColumnTypes: the cursor row is rewritten by every acknowledgement
// and heartbeat, and PostgreSQL tests every table check of a row on every UPDATE, so its
// single-column checks are column types (migration 0012), which test only what a statement
// sets. The table keeps the checks that cannot be types, and the types accept what the checks
// accepted.
func TestCursorChecksLiveInTheColumnTypes(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	rows, err := pool.Query(ctx, `SELECT conname FROM pg_catalog.pg_constraint
		WHERE conrelid = 'lifecycle_consumer_cursors'::regclass AND contype = 'c' ORDER BY conname`)
	require.NoError(t, err)
	checks, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"lifecycle_consumer_cursors_check", "lifecycle_consumer_cursors_consumer_id_format",
		"lifecycle_consumer_cursors_project_id_format"}, checks, "policies name the identifiers; the other spans two columns")

	_, err = pool.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence, lease_owner, lease_epoch,
		lease_expires_at, heartbeat_at, reconciled_at, reconcile_reason, retired_at, retired_by, retired_reason)
		VALUES ('p', 'c1', 0, repeat('c', 111) || '@0123456789abcdef', 0, '9999-12-31 23:59:59.999999+00', now(), now(),
		'cursor_below_pruned_floor', now(), 'ops@host:1/x', 'INC-42/#7')`)
	require.NoError(t, err, "the longest lease owner, the last reason, the latest time")
	for _, reason := range []string{"missing_cursor", "cursor_ahead_of_head"} {
		_, err = pool.Exec(ctx, `UPDATE lifecycle_consumer_cursors SET reconcile_reason = $1`, reason)
		require.NoError(t, err, reason)
	}
}

// TestCursorTypesWaitForRowsTheChecksRefuse: a cursor row written before the database checked
// times (schema 4) keeps the times check NOT VALID, and migration 0012 then leaves those
// columns their type and that check, which still refuses new bad times; the cursor's other
// columns take their types.
func TestCursorTypesWaitForRowsTheChecksRefuse(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilegeWith(t, lpOptions{through: 4})
	_, err := lp.owner.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence, lease_expires_at)
		VALUES ('p', 'c1', 0, 'infinity')`)
	require.NoError(t, err)
	lp.finishMigration(t)

	unvalidated, err := outbox.UnvalidatedChecks(ctx, lp.owner)
	require.NoError(t, err)
	require.Equal(t, []string{"lifecycle_consumer_cursors.lifecycle_consumer_cursors_times_finite"}, unvalidated)
	typeOf := func(column string) string {
		var typ string
		require.NoError(t, lp.owner.QueryRow(ctx, `SELECT atttypid::regtype::text FROM pg_catalog.pg_attribute
			WHERE attrelid = 'lifecycle_consumer_cursors'::regclass AND attname = $1`, column).Scan(&typ))
		return typ
	}
	require.Equal(t, "timestamp with time zone", typeOf("lease_expires_at"))
	require.Equal(t, "lifecycle_count", typeOf("last_acked_sequence"))
	require.Equal(t, "lifecycle_instance", typeOf("lease_owner"))
	_, err = lp.owner.Exec(ctx, `UPDATE lifecycle_consumer_cursors SET heartbeat_at = '-infinity'`)
	requireSQLState(t, err, pgerrcode.CheckViolation)
	_, err = lp.owner.Exec(ctx, `UPDATE lifecycle_consumer_cursors SET last_acked_sequence = -1`)
	requireSQLState(t, err, pgerrcode.CheckViolation)
}

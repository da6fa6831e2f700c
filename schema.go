package outbox

import (
	"context"
	"embed"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"fusion/outbox/internal/migrate"
)

// SchemaVersion is the migration version this build needs. VerifySchema fails unless the
// database is at exactly this version with unchanged migration checksums.
const SchemaVersion = 24

// schemaTable records the module's applied migrations.
const schemaTable = "lifecycle_outbox_schema"

// schemaLockKey is the advisory lock every applier of the module's migrations takes.
const schemaLockKey int64 = 0x6c6966656f757478 // "lifeoutx"

//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migration is one numbered schema change of the module.
type Migration = migrate.Migration

var migrationSet = func() migrate.Set {
	ms, err := migrate.Load(migrationFiles, "migrations")
	if err != nil {
		panic(fmt.Sprintf("outbox: embedded migrations: %v", err))
	}
	if len(ms) != SchemaVersion {
		panic(fmt.Sprintf("outbox: SchemaVersion is %d but %d migrations are embedded", SchemaVersion, len(ms)))
	}
	return migrate.Set{Table: schemaTable, LockKey: schemaLockKey, LockTimeout: migrationLockTimeout, Migrations: ms}
}()

// migrationLockTimeout bounds how long a migration's DDL waits for a table lock. A migration
// waiting for ACCESS EXCLUSIVE queues every later statement on that table behind it, deletes
// included, so it gives up (and can be retried) rather than wait behind a long transaction.
const migrationLockTimeout = 10 * time.Second

// Migrations returns the module's migrations in order, for a host that registers them with its
// own schema applier. Such a host runs each one's SQL and calls MarkMigrationAppliedTx in the
// same transaction, so VerifySchema keeps working.
func Migrations() []Migration {
	return append([]Migration(nil), migrationSet.Migrations...)
}

// Migrate applies the module's missing migrations, each in its own transaction under a fixed
// advisory lock, and returns the versions it applied. Concurrent callers are safe.
func Migrate(ctx context.Context, db Beginner) ([]int, error) {
	v, err := migrationSet.Apply(ctx, db)
	if err != nil {
		return v, fmt.Errorf("migrate outbox schema: %w", err)
	}
	return v, nil
}

// MigrateThrough applies migrations up to version target only.
func MigrateThrough(ctx context.Context, db Beginner, target int) ([]int, error) {
	v, err := migrationSet.ApplyThrough(ctx, db, target)
	if err != nil {
		return v, fmt.Errorf("migrate outbox schema to %d: %w", target, err)
	}
	return v, nil
}

// MarkMigrationAppliedTx records m as applied, in the transaction that ran its SQL.
func MarkMigrationAppliedTx(ctx context.Context, tx pgx.Tx, m Migration) error {
	return migrate.MarkAppliedTx(ctx, tx, schemaTable, m)
}

// VerifySchema checks that the database is at SchemaVersion with unchanged checksums, and that
// what the migrations set up for isolation is still in place: row-level security enabled (and
// forced) on every table, every policy present, every function with its search_path pinned, and
// the owner's functions (ticking, adoption, pruning) not executable by PUBLIC. The error wraps
// ErrSchemaBehind, ErrSchemaAhead, ErrSchemaChecksum or ErrSchemaDrift.
func VerifySchema(ctx context.Context, db DBTX) error {
	if err := migrationSet.Verify(ctx, db); err != nil {
		return fmt.Errorf("verify outbox schema: %w", err)
	}
	rows, err := db.Query(ctx, schemaDriftSQL)
	if err != nil {
		return fmt.Errorf("verify outbox schema objects: %w", err)
	}
	problems, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("verify outbox schema objects: %w", err)
	}
	if len(problems) > 0 {
		return fmt.Errorf("verify outbox schema: %w: %s", ErrSchemaDrift, strings.Join(problems, "; "))
	}
	return nil
}

// schemaDriftSQL lists, as sentences, what differs from the objects the migrations made. It
// reads only the catalogs, so any role can run it; names resolve on the search path, where the
// module's schema is.
const schemaDriftSQL = `
WITH tables(name, forced) AS (VALUES
    ('lifecycle_outbox', true), ('lifecycle_outbox_pending', true), ('lifecycle_event_log', true), ('lifecycle_tick_project', true),
    ('lifecycle_outbox_heads', true), ('lifecycle_consumer_cursors', true),
    ('lifecycle_consumer_deliveries', true), ('lifecycle_audit', true),
    ('lifecycle_project_access', false), ('lifecycle_consumer_access', false)
), policies(tab, name) AS (VALUES
    ('lifecycle_outbox', 'lifecycle_outbox_project_scope'),
    ('lifecycle_outbox', 'lifecycle_outbox_sequence_once'),
    ('lifecycle_outbox_pending', 'lifecycle_outbox_pending_project_scope'),
    ('lifecycle_event_log', 'lifecycle_event_log_project_scope'),
    ('lifecycle_tick_project', 'lifecycle_tick_project_project_scope'),
    ('lifecycle_outbox_heads', 'lifecycle_outbox_heads_project_scope'),
    ('lifecycle_consumer_cursors', 'lifecycle_consumer_cursors_project_scope'),
    ('lifecycle_consumer_cursors', 'lifecycle_consumer_cursors_consumer_insert'),
    ('lifecycle_consumer_cursors', 'lifecycle_consumer_cursors_consumer_update'),
    ('lifecycle_consumer_cursors', 'lifecycle_consumer_cursors_consumer_delete'),
    ('lifecycle_consumer_deliveries', 'lifecycle_consumer_deliveries_project_scope'),
    ('lifecycle_consumer_deliveries', 'lifecycle_consumer_deliveries_consumer_insert'),
    ('lifecycle_consumer_deliveries', 'lifecycle_consumer_deliveries_consumer_update'),
    ('lifecycle_consumer_deliveries', 'lifecycle_consumer_deliveries_consumer_delete'),
    ('lifecycle_audit', 'lifecycle_audit_project_scope'),
    ('lifecycle_audit', 'lifecycle_audit_consumer_insert'),
    ('lifecycle_audit', 'lifecycle_audit_action_insert'),
    ('lifecycle_project_access', 'lifecycle_project_access_own'),
    ('lifecycle_consumer_access', 'lifecycle_consumer_access_own')
), functions(signature) AS (VALUES
    ('lifecycle_event_id(text, timestamp with time zone)'),
    ('lifecycle_outbox_tick(text)'), ('lifecycle_outbox_adopt_legacy(integer)'),
    ('lifecycle_outbox_read(text, bigint, integer, xid8, timestamp with time zone, text)'),
    ('lifecycle_outbox_read_parts(text[], bigint[], integer)'), ('lifecycle_outbox_read_ticks(text[], bigint, integer)'),
    ('lifecycle_outbox_unticked()'),
    ('lifecycle_outbox_prune(text, integer, bigint, interval, interval)'), ('lifecycle_outbox_prune_dead_letters(integer, interval, interval)')
), definers(signature) AS (VALUES
    ('lifecycle_outbox_tick(text)'), ('lifecycle_outbox_adopt_legacy(integer)'), ('lifecycle_outbox_unticked()'),
    ('lifecycle_outbox_prune(text, integer, bigint, interval, interval)'), ('lifecycle_outbox_prune_dead_letters(integer, interval, interval)')
), problems(ord, problem) AS (
    SELECT 1, 'table ' || t.name || ' is missing' FROM tables t WHERE pg_catalog.to_regclass(t.name) IS NULL
    UNION ALL
    SELECT 2, 'row-level security is not enabled on ' || t.name
    FROM tables t JOIN pg_catalog.pg_class c ON c.oid = pg_catalog.to_regclass(t.name) WHERE NOT c.relrowsecurity
    UNION ALL
    SELECT 3, 'row-level security is not forced on ' || t.name
    FROM tables t JOIN pg_catalog.pg_class c ON c.oid = pg_catalog.to_regclass(t.name) WHERE t.forced AND NOT c.relforcerowsecurity
    UNION ALL
    SELECT 4, 'policy ' || p.name || ' on ' || p.tab || ' is missing'
    FROM policies p WHERE pg_catalog.to_regclass(p.tab) IS NOT NULL AND NOT EXISTS (
        SELECT 1 FROM pg_catalog.pg_policy x WHERE x.polrelid = pg_catalog.to_regclass(p.tab) AND x.polname = p.name)
    UNION ALL
    SELECT 5, 'function ' || f.signature || ' is missing' FROM functions f WHERE pg_catalog.to_regprocedure(f.signature) IS NULL
    UNION ALL
    SELECT 6, 'function ' || f.signature || ' does not pin search_path to pg_catalog, ' || pg_catalog.quote_ident(n.nspname) || ', pg_temp'
    FROM functions f
    JOIN pg_catalog.pg_proc p ON p.oid = pg_catalog.to_regprocedure(f.signature)
    JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
    WHERE NOT coalesce('search_path=pg_catalog, ' || pg_catalog.quote_ident(n.nspname) || ', pg_temp' = ANY (p.proconfig), false)
    UNION ALL
    SELECT 7, 'PUBLIC may execute ' || d.signature
    FROM definers d JOIN pg_catalog.pg_proc p ON p.oid = pg_catalog.to_regprocedure(d.signature)
    WHERE EXISTS (
        SELECT 1 FROM pg_catalog.aclexplode(coalesce(p.proacl, pg_catalog.acldefault('f', p.proowner))) a
        WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE')
    UNION ALL
    SELECT 8, d.signature || ' does not run as its owner (SECURITY DEFINER)'
    FROM definers d JOIN pg_catalog.pg_proc p ON p.oid = pg_catalog.to_regprocedure(d.signature)
    WHERE NOT p.prosecdef
)
SELECT problem FROM problems ORDER BY ord, problem`

// unvalidatedChecksSQL lists the module's checks left NOT VALID (see migration 0005).
const unvalidatedChecksSQL = `
SELECT k.conrelid::regclass::text || '.' || k.conname
FROM pg_catalog.pg_constraint k
WHERE NOT k.convalidated AND k.contype = 'c'
  AND k.conrelid IN (SELECT pg_catalog.to_regclass(t) FROM pg_catalog.unnest(ARRAY['lifecycle_outbox', 'lifecycle_outbox_heads',
      'lifecycle_consumer_cursors', 'lifecycle_consumer_deliveries', 'lifecycle_audit']) AS t)
ORDER BY 1`

// UnvalidatedChecks lists, as table.constraint, the module's checks that rows written before
// they existed violate, so that they stay NOT VALID: new rows are checked, the old ones are not.
// The runbook says how to find and mend those rows (docs/operations.md).
func UnvalidatedChecks(ctx context.Context, db DBTX) ([]string, error) {
	rows, err := db.Query(ctx, unvalidatedChecksSQL)
	if err != nil {
		return nil, fmt.Errorf("list unvalidated checks: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("list unvalidated checks: %w", err)
	}
	return out, nil
}

// AppliedMigration is a bookkeeping row.
type AppliedMigration = migrate.Applied

// SchemaStatus returns the applied migrations.
func SchemaStatus(ctx context.Context, db DBTX) ([]AppliedMigration, error) {
	return migrationSet.Status(ctx, db)
}

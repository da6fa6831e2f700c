package outbox

import (
	"context"
	"embed"
	"fmt"

	"github.com/jackc/pgx/v5"

	"fusion/outbox/internal/migrate"
)

// SchemaVersion is the migration version this build needs. VerifySchema fails unless the
// database is at exactly this version with unchanged migration checksums.
const SchemaVersion = 4

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
	return migrate.Set{Table: schemaTable, LockKey: schemaLockKey, Migrations: ms}
}()

// Migrations returns the module's migrations in order, for a host that registers them with its
// own schema applier. Such a host runs each one's SQL and calls MarkMigrationAppliedTx in the
// same transaction, so VerifySchema keeps working.
func Migrations() []Migration {
	return append([]Migration(nil), migrationSet.Migrations...)
}

// Migrate applies the module's missing migrations, each in its own transaction under a fixed
// advisory lock, and returns the versions it applied. Concurrent callers are safe.
func Migrate(ctx context.Context, db migrate.Beginner) ([]int, error) {
	v, err := migrationSet.Apply(ctx, db)
	if err != nil {
		return v, fmt.Errorf("migrate outbox schema: %w", err)
	}
	return v, nil
}

// MigrateThrough applies migrations up to version target only.
func MigrateThrough(ctx context.Context, db migrate.Beginner, target int) ([]int, error) {
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

// VerifySchema checks that the database is at SchemaVersion with unchanged checksums. The
// error wraps ErrSchemaBehind, ErrSchemaAhead or ErrSchemaChecksum.
func VerifySchema(ctx context.Context, db DBTX) error {
	if err := migrationSet.Verify(ctx, db); err != nil {
		return fmt.Errorf("verify outbox schema: %w", err)
	}
	return nil
}

// AppliedMigration is a bookkeeping row.
type AppliedMigration = migrate.Applied

// SchemaStatus returns the applied migrations.
func SchemaStatus(ctx context.Context, db DBTX) ([]AppliedMigration, error) {
	return migrationSet.Status(ctx, db)
}

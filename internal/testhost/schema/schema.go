// Package schema holds the test host's migrations: the reference host's tables, recorded in
// the same taskstore_schema table, so a database migrated here serves the reference host too.
package schema

import (
	"context"
	"embed"
	"fmt"

	"fusion/outbox/internal/migrate"
)

//go:embed migrations/*.sql
var files embed.FS

var set = func() migrate.Set {
	ms, err := migrate.Load(files, "migrations")
	if err != nil {
		panic(fmt.Sprintf("taskstore: embedded migrations: %v", err))
	}
	return migrate.Set{Table: "taskstore_schema", LockKey: 0x7461736b73746f72, Migrations: ms}
}()

// Migrate applies the task store's missing migrations.
func Migrate(ctx context.Context, db migrate.Beginner) error {
	if _, err := set.Apply(ctx, db); err != nil {
		return fmt.Errorf("migrate taskstore schema: %w", err)
	}
	return nil
}

// Verify checks the task store's schema is current.
func Verify(ctx context.Context, db migrate.Querier) error {
	return set.Verify(ctx, db)
}

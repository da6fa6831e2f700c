package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/spf13/cobra"

	"fusion/outbox"
)

func migrateCommand(a *app) *cobra.Command {
	var f changeFlags
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Apply the module's missing schema migrations",
		Long: fmt.Sprintf(`migrate applies the outbox module's missing migrations (this build has %d), each in its
own transaction under a fixed advisory lock, so it is safe beside another migrating process.

Run it as the role that owns the module's tables, not as the runtime role: the runtime role
has no DDL rights (see docs/operations.md, "Roles and grants"). The migration that creates
lifecycle_project_access grants the migrating role every project.`, outbox.SchemaVersion),
		Example: `  outboxctl migrate --dsn postgres://outbox_owner@db/tasks
  outboxctl migrate --yes && outboxctl verify`,
		Args: cobra.NoArgs,
		RunE: a.action(func(ctx context.Context, cmd *cobra.Command, _ []string) error {
			return a.runMigrate(ctx, cmd, &f)
		}),
	}
	f.addYes(cmd)
	return cmd
}

// schemaResult is the JSON output of migrate and verify.
type schemaResult struct {
	Version  int                       `json:"version"`
	Expected int                       `json:"expected"`
	Applied  []int                     `json:"applied,omitempty"` // by this run of migrate
	Current  bool                      `json:"current"`
	History  []outbox.AppliedMigration `json:"history,omitempty"`
	// UnvalidatedChecks are checks that rows written before them violate (table.constraint).
	UnvalidatedChecks []string `json:"unvalidatedChecks,omitempty"`
}

func (a *app) runMigrate(ctx context.Context, cmd *cobra.Command, f *changeFlags) error {
	if err := a.checkFilters(cmd, false, false, false, false); err != nil {
		return err
	}
	readCtx, cancel := a.phase(ctx)
	defer cancel()
	if err := a.connect(readCtx); err != nil {
		return err
	}
	err := outbox.VerifySchema(readCtx, a.pool)
	switch {
	case err == nil:
		a.note("the outbox schema is already at version %d; nothing to do", outbox.SchemaVersion)
		if a.json {
			return a.printJSON(schemaResult{Version: outbox.SchemaVersion, Expected: outbox.SchemaVersion, Current: true})
		}
		return nil
	case !errors.Is(err, outbox.ErrSchemaBehind):
		return err
	}
	applied, err := appliedMigrations(readCtx, a)
	if err != nil {
		return err
	}
	pending := outbox.Migrations()[len(applied):]
	names := make([]string, len(pending))
	for i, m := range pending {
		names[i] = fmt.Sprintf("%04d_%s", m.Version, m.Name)
	}
	conn := a.pool.Config().ConnConfig
	a.note("outboxctl will apply %s to database %q as role %q: %s",
		plural(len(pending), "migration", "migrations"), conn.Database, conn.User, strings.Join(names, ", "))
	if err := a.confirm(f, "migrate"); err != nil {
		return err
	}
	writeCtx, cancel := a.phase(ctx)
	defer cancel()
	versions, err := outbox.Migrate(writeCtx, a.pool)
	if err != nil {
		return err
	}
	if err := outbox.VerifySchema(writeCtx, a.pool); err != nil {
		return err
	}
	if a.json {
		return a.printJSON(schemaResult{Version: outbox.SchemaVersion, Expected: outbox.SchemaVersion, Applied: nonNil(versions), Current: true})
	}
	if len(versions) == 0 {
		a.say("another process applied the migrations meanwhile; the schema is at version %d", outbox.SchemaVersion)
		return nil
	}
	labels := make([]string, len(versions))
	for i, v := range versions {
		labels[i] = itoa(v)
	}
	a.say("applied migrations %s; the schema is at version %d", strings.Join(labels, ", "), outbox.SchemaVersion)
	return nil
}

// appliedMigrations reads the bookkeeping rows; a database never migrated has none.
func appliedMigrations(ctx context.Context, a *app) ([]outbox.AppliedMigration, error) {
	applied, err := outbox.SchemaStatus(ctx, a.pool)
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UndefinedTable {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read applied migrations: %w", err)
	}
	return applied, nil
}

func verifyCommand(a *app) *cobra.Command {
	return &cobra.Command{
		Use:   "verify",
		Short: "Check that the database schema is the one this build expects",
		Long: fmt.Sprintf(`verify checks that the outbox schema is at version %d with the same migration checksums as
this build, and lists the applied migrations. It also checks what the isolation rests on:
row-level security enabled and forced, every policy present, the functions' search_path pinned
and the functions that run as their owner (the ticker, pruning) not executable by PUBLIC. It
only reads, so any of the module's roles can run it. It fails (exit 1) when the schema is
behind (run outboxctl migrate), ahead (use a newer build) or was changed (a checksum differs,
or an object was altered by hand). It notes the checks that rows written before an upgrade
violate.`, outbox.SchemaVersion),
		Example: `  outboxctl verify
  outboxctl verify --json`,
		Args: cobra.NoArgs,
		RunE: a.action(a.runVerify),
	}
}

func (a *app) runVerify(ctx context.Context, cmd *cobra.Command, _ []string) error {
	if err := a.checkFilters(cmd, false, false, false, false); err != nil {
		return err
	}
	ctx, cancel := a.phase(ctx)
	defer cancel()
	if err := a.open(ctx); err != nil {
		return err
	}
	history, err := appliedMigrations(ctx, a)
	if err != nil {
		return err
	}
	unvalidated, err := outbox.UnvalidatedChecks(ctx, a.pool)
	if err != nil {
		return err
	}
	if a.json {
		return a.printJSON(schemaResult{Version: len(history), Expected: outbox.SchemaVersion, Current: true, History: history,
			UnvalidatedChecks: unvalidated})
	}
	t := newTable(a.stdout, "VERSION", "NAME", "CHECKSUM", "APPLIED_AT")
	for _, m := range history {
		t.row(itoa(m.Version), m.Name, m.Checksum[:min(12, len(m.Checksum))], timeText(&m.AppliedAt))
	}
	if err := t.flush(); err != nil {
		return err
	}
	a.say("the outbox schema is at version %d, as this build expects", outbox.SchemaVersion)
	if len(unvalidated) > 0 {
		a.note("rows written before the upgrade violate %s; new rows are checked, and readers park or skip the old ones.",
			plural(len(unvalidated), "check", "checks"))
		a.note("Mend those rows and validate (docs/operations.md, \"Rows the checks refuse\"): %s", strings.Join(unvalidated, ", "))
	}
	return nil
}

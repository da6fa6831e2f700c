package outbox

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// runtimeGrants are the privileges a runtime role needs for the writer, the consumer and
// retention: no DDL, no ownership, no BYPASSRLS. Row-level security then limits the role to the
// projects granted in lifecycle_project_access.
var runtimeGrants = []struct{ privileges, object string }{
	{"SELECT, INSERT, UPDATE (sequence), DELETE", "TABLE lifecycle_outbox"},
	{"SELECT, INSERT, UPDATE (last_sequence, sequenced_at, pruned_through, pruned_at)", "TABLE lifecycle_outbox_heads"},
	{"SELECT, INSERT, UPDATE", "TABLE lifecycle_consumer_cursors"},
	{"SELECT, INSERT, UPDATE, DELETE", "TABLE lifecycle_consumer_deliveries"},
	{"SELECT, INSERT", "TABLE lifecycle_audit"},
	{"SELECT", "TABLE lifecycle_project_access"},
	{"SELECT", "TABLE " + schemaTable},
	{"EXECUTE", "FUNCTION lifecycle_outbox_sequence(text[], integer)"},
}

// GrantRuntimeRole gives role the privileges the module needs at run time and scopes it to
// projects ("*" for every project). Run it as the owner of the module's tables.
func GrantRuntimeRole(ctx context.Context, db DBTX, role string, projects ...string) error {
	ident := pgx.Identifier{role}.Sanitize()
	for _, g := range runtimeGrants {
		if _, err := db.Exec(ctx, fmt.Sprintf("GRANT %s ON %s TO %s", g.privileges, g.object, ident)); err != nil {
			return fmt.Errorf("grant %s on %s: %w", g.privileges, g.object, err)
		}
	}
	return GrantProjectAccess(ctx, db, role, projects...)
}

// GrantProjectAccess lets role see and write the given projects' outbox state.
func GrantProjectAccess(ctx context.Context, db DBTX, role string, projects ...string) error {
	for _, p := range projects {
		if p != "*" {
			if err := ValidateProjectID(p); err != nil {
				return err
			}
		}
	}
	_, err := db.Exec(ctx, `INSERT INTO lifecycle_project_access (role_name, project_id)
		SELECT $1, p FROM unnest($2::text[]) AS p ON CONFLICT DO NOTHING`, role, projects)
	if err != nil {
		return fmt.Errorf("grant project access to %s: %w", role, err)
	}
	return nil
}

// RevokeProjectAccess removes role's access to the given projects.
func RevokeProjectAccess(ctx context.Context, db DBTX, role string, projects ...string) error {
	_, err := db.Exec(ctx, `DELETE FROM lifecycle_project_access WHERE role_name = $1 AND project_id = ANY ($2)`, role, projects)
	if err != nil {
		return fmt.Errorf("revoke project access from %s: %w", role, err)
	}
	return nil
}

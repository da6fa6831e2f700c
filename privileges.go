package outbox

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// One component, one role. Each role gets only the privileges its component uses, column by
// column where a table-level grant would give more: no role below holds table-level UPDATE,
// DELETE or TRUNCATE, so none can take a lock that blocks another project (LOCK TABLE in any
// mode stronger than ROW EXCLUSIVE needs one of those three). What needs more (ticking, which
// writes every project's head; adopting older writers' rows, which deletes them; pruning) runs
// in functions owned by the schema owner (SECURITY DEFINER) that decide themselves what the
// caller may touch. Row-level security then limits a role to the projects granted in
// lifecycle_project_access and, for cursors, deliveries and audit rows, to the consumer
// identities granted in lifecycle_consumer_access. None of the roles needs DDL, ownership or
// BYPASSRLS. docs/operations.md ("Roles and grants") has the table and the threat model.

type grant struct{ privileges, object string }

// logColumns are what a writer inserts into the event log: every column but txid, which the
// database sets to the writing transaction's ID.
const logColumns = "project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id, prior_column, trace_context"

// writerGrants: the writer hook inserts one event per first deletion into the log and reads it
// back on a repeat, wherever it is (the log, or pending or numbered by an older version). It
// cannot set an event's transaction, change or delete an event, or touch any other table. It
// reads only what its repeat reads (writerLogColumns, writerOutboxColumns), not the events'
// contents.
var writerGrants = []grant{
	{"SELECT (" + writerLogColumns + "), INSERT (" + logColumns + ")", "TABLE lifecycle_event_log"},
	{"SELECT", "TABLE lifecycle_outbox_pending"},
	{"SELECT (" + writerOutboxColumns + ")", "TABLE lifecycle_outbox"},
	{"SELECT", "TABLE lifecycle_project_access"},
	{"SELECT", "TABLE " + schemaTable},
}

// writerLogColumns are what the writer's repeat (selectEventByIDSQL) reads of the log.
const writerLogColumns = "project_id, task_id, deleted_at, writer_process_id, occurred_at"

// writerOutboxColumns are what the writer's repeat (selectEventByIDSQL) reads of the stream:
// which deletion an event is, who wrote it, when, and its sequence.
const writerOutboxColumns = "project_id, task_id, deleted_at, writer_process_id, occurred_at, sequence"

// consumerGrants: the consumer ticks (the owner's function numbers what committed, for every
// project; see migration 0018), reads events through lifecycle_outbox_read and
// lifecycle_outbox_read_parts, asks lifecycle_outbox_unticked whether events committed that no
// tick numbered (migration 0023), and writes its own cursors, leases and delivery attempts, and
// the poison and replay audit rows. It cannot number by hand, retire anyone, ask for a replay,
// prune or delete.
var consumerGrants = []grant{
	{"SELECT", "TABLE lifecycle_outbox"},
	{"SELECT", "TABLE lifecycle_outbox_pending"},
	{"SELECT", "TABLE lifecycle_event_log"},
	{"SELECT", "TABLE lifecycle_tick"},
	{"SELECT", "TABLE lifecycle_tick_project"},
	{"SELECT", "TABLE lifecycle_outbox_heads"},
	{"SELECT", "TABLE lifecycle_outbox_head"},
	{"SELECT, INSERT (project_id, consumer_id), UPDATE (last_acked_sequence, acked_at, lease_owner, lease_epoch, " +
		"lease_expires_at, heartbeat_at, reconciled_at, reconcile_reason)", "TABLE lifecycle_consumer_cursors"},
	{"SELECT, INSERT (project_id, consumer_id, sequence, event_id, state, attempts, next_attempt_at, last_failure_class, " +
		"first_failed_at, last_failed_at, parked_at), UPDATE (state, attempts, next_attempt_at, last_failure_class, last_failed_at, " +
		"parked_at, resolved_at)", "TABLE lifecycle_consumer_deliveries"},
	{"INSERT (project_id, action, consumer_id, event_id, sequence, attempts, actor, reason)", "TABLE lifecycle_audit"},
	{"SELECT", "TABLE lifecycle_project_access"},
	{"SELECT", "TABLE " + schemaTable},
	{"EXECUTE", "FUNCTION " + tickSignature},
	{"EXECUTE", "FUNCTION " + adoptSignature},
	{"EXECUTE", "FUNCTION " + readSignature},
	{"EXECUTE", "FUNCTION " + readPartsSignature},
	{"EXECUTE", "FUNCTION " + readTicksSignature},
	{"EXECUTE", "FUNCTION " + untickedSignature},
}

// The ticker's and the readers' functions (migrations 0018, 0022, 0023 and 0024).
const (
	tickSignature      = "lifecycle_outbox_tick(text)"
	adoptSignature     = "lifecycle_outbox_adopt_legacy(integer)"
	readSignature      = "lifecycle_outbox_read(text, bigint, integer, xid8, timestamptz, text)"
	readPartsSignature = "lifecycle_outbox_read_parts(text[], bigint[], integer)"
	untickedSignature  = "lifecycle_outbox_unticked()" // migration 0023
	readTicksSignature = "lifecycle_outbox_read_ticks(text[], bigint, integer)"
)

// operatorGrants: outboxctl and the retention sweep read status, request replays, retire and
// reinstate consumers, prune acknowledged events and resolved dead letters, and audit it all.
// Pruning runs in the owner's functions (migration 0017): the role deletes nothing itself and
// cannot move the pruned floor, which only follows what those functions deleted.
var operatorGrants = []grant{
	{"SELECT", "TABLE lifecycle_outbox"},
	{"SELECT", "TABLE lifecycle_outbox_pending"},
	{"SELECT", "TABLE lifecycle_event_log"},
	{"SELECT", "TABLE lifecycle_tick"},
	{"SELECT", "TABLE lifecycle_tick_project"},
	{"SELECT", "TABLE lifecycle_outbox_heads"},
	{"SELECT", "TABLE lifecycle_outbox_head"},
	{"SELECT, UPDATE (retired_at, retired_by, retired_reason, lease_owner, lease_expires_at)", "TABLE lifecycle_consumer_cursors"},
	{"SELECT, UPDATE (state, replay_requested_at, replay_requested_by, replay_reason)", "TABLE lifecycle_consumer_deliveries"},
	{"SELECT, INSERT (project_id, action, consumer_id, event_id, sequence, attempts, actor, reason)", "TABLE lifecycle_audit"},
	{"SELECT", "TABLE lifecycle_project_access"},
	{"SELECT", "TABLE " + schemaTable},
	{"EXECUTE", "FUNCTION " + pruneSignature},
	{"EXECUTE", "FUNCTION " + pruneDeadLettersSignature},
	{"EXECUTE", "FUNCTION " + readSignature},
}

// The pruning functions (migration 0017).
const (
	pruneSignature            = "lifecycle_outbox_prune(text, integer, bigint, interval, interval)"
	pruneDeadLettersSignature = "lifecycle_outbox_prune_dead_letters(integer, interval, interval)"
)

// moduleObjects is everything the grants above name, for RevokeModulePrivileges.
var moduleObjects = []string{
	"TABLE lifecycle_outbox", "TABLE lifecycle_outbox_pending", "TABLE lifecycle_outbox_heads", "TABLE lifecycle_outbox_head", "TABLE lifecycle_consumer_cursors",
	"TABLE lifecycle_consumer_deliveries", "TABLE lifecycle_audit", "TABLE lifecycle_project_access",
	"TABLE lifecycle_event_log", "TABLE lifecycle_tick", "TABLE lifecycle_tick_project",
	"TABLE " + schemaTable, "FUNCTION " + tickSignature, "FUNCTION " + adoptSignature, "FUNCTION " + readSignature,
	"FUNCTION " + readPartsSignature, "FUNCTION " + readTicksSignature, "FUNCTION " + untickedSignature, "FUNCTION " + pruneSignature, "FUNCTION " + pruneDeadLettersSignature,
}

// GrantWriterRole gives role what the writer hook needs (see writerGrants) in the given
// projects ("*" for every project). The host's delete transaction runs as this role, so it also
// needs the host's own grants on its tables. Run it as the owner of the module's tables.
func GrantWriterRole(ctx context.Context, db DBTX, role string, projects ...string) error {
	if err := grantAll(ctx, db, role, writerGrants); err != nil {
		return err
	}
	return GrantProjectAccess(ctx, db, role, projects...)
}

// GrantConsumerRole gives role what a consumer with identity consumer needs (see
// consumerGrants) in the given projects. The role may read every cursor and delivery of those
// projects (status and metrics report them all) but write only those of consumer; give it
// further identities with GrantConsumerAccess. Run it as the owner of the module's tables.
func GrantConsumerRole(ctx context.Context, db DBTX, role string, consumer ConsumerID, projects ...string) error {
	if err := grantAll(ctx, db, role, consumerGrants); err != nil {
		return err
	}
	if err := GrantConsumerAccess(ctx, db, role, string(consumer)); err != nil {
		return err
	}
	return GrantProjectAccess(ctx, db, role, projects...)
}

// GrantOperatorRole gives role what outboxctl and the retention sweep need (see
// operatorGrants) in the given projects, acting on every consumer of them. Run it as the
// owner of the module's tables.
func GrantOperatorRole(ctx context.Context, db DBTX, role string, projects ...string) error {
	if err := grantAll(ctx, db, role, operatorGrants); err != nil {
		return err
	}
	if err := GrantConsumerAccess(ctx, db, role, "*"); err != nil {
		return err
	}
	return GrantProjectAccess(ctx, db, role, projects...)
}

// RevokeModulePrivileges takes from role every privilege on the module's objects and every row
// of lifecycle_project_access and lifecycle_consumer_access naming it, for moving a role
// granted the union of the component grants (or, before schema 17, GrantRuntimeRole) to
// per-component grants.
func RevokeModulePrivileges(ctx context.Context, db DBTX, role string) error {
	// GRANT and REVOKE take no parameters: the role is quoted as an identifier, and the
	// privileges and objects are this file's constants.
	ident := pgx.Identifier{role}.Sanitize()
	for _, o := range moduleObjects {
		if _, err := db.Exec(ctx, fmt.Sprintf("REVOKE ALL ON %s FROM %s", o, ident)); err != nil {
			return fmt.Errorf("revoke privileges on %s: %w", o, err)
		}
	}
	if _, err := db.Exec(ctx, revokeAllAccessSQL, role); err != nil {
		return fmt.Errorf("revoke access rows of %s: %w", role, err)
	}
	return nil
}

func grantAll(ctx context.Context, db DBTX, role string, grants []grant) error {
	ident := pgx.Identifier{role}.Sanitize() // see RevokeModulePrivileges
	if err := grantSchemaUsage(ctx, db, ident); err != nil {
		return err
	}
	for _, g := range grants {
		if _, err := db.Exec(ctx, fmt.Sprintf("GRANT %s ON %s TO %s", g.privileges, g.object, ident)); err != nil {
			return fmt.Errorf("grant %s on %s: %w", g.privileges, g.object, err)
		}
	}
	return nil
}

// moduleSchemaSQL names the schema the module's tables are in and whether this role may grant
// USAGE on it (it owns it), for a module installed in a schema of its own.
const moduleSchemaSQL = `
SELECT n.nspname, pg_catalog.has_schema_privilege(n.oid, 'USAGE WITH GRANT OPTION')
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
WHERE c.oid = pg_catalog.to_regclass('lifecycle_outbox')`

func grantSchemaUsage(ctx context.Context, db DBTX, ident string) error {
	var schema string
	var canGrant bool
	if err := db.QueryRow(ctx, moduleSchemaSQL).Scan(&schema, &canGrant); err != nil {
		return fmt.Errorf("find the module's schema: %w", err)
	}
	if !canGrant {
		return nil // public, usually, where every role has USAGE
	}
	if _, err := db.Exec(ctx, "GRANT USAGE ON SCHEMA "+pgx.Identifier{schema}.Sanitize()+" TO "+ident); err != nil {
		return fmt.Errorf("grant usage on schema %s: %w", schema, err)
	}
	return nil
}

// The access statements name every function they call with its schema: run by the owner, an
// overload a closer match than the built-in (public.unnest(text[]), say) would otherwise run
// with the owner's rights and could grant itself every project.
const (
	grantProjectAccessSQL = `INSERT INTO lifecycle_project_access (role_name, project_id)
SELECT $1, p FROM pg_catalog.unnest($2::text[]) AS p ON CONFLICT DO NOTHING`
	revokeProjectAccessSQL = `DELETE FROM lifecycle_project_access WHERE role_name = $1 AND project_id = ANY ($2::text[])`
	grantConsumerAccessSQL = `INSERT INTO lifecycle_consumer_access (role_name, consumer_id)
SELECT $1, c FROM pg_catalog.unnest($2::text[]) AS c ON CONFLICT DO NOTHING`
	revokeConsumerAccessSQL = `DELETE FROM lifecycle_consumer_access WHERE role_name = $1 AND consumer_id = ANY ($2::text[])`
	revokeAllAccessSQL      = `WITH p AS (DELETE FROM lifecycle_project_access WHERE role_name = $1)
DELETE FROM lifecycle_consumer_access WHERE role_name = $1`
)

// analyzeGrantsAfter is how many grants one call must add before it refreshes the planner's
// statistics of the grant table itself. Row-level security probes a row's grant by its key
// (migration 0014), unless the planner expects a role to hold only a few grants: it then
// checks a statement's rows against a hash of all of the role's grants, built per statement.
// Statistics taken before a role was granted thousands of projects expect that; one lease
// then read 4,001 grant rows instead of 3, until autovacuum analyzed the table again (after
// about a tenth of its rows changed).
const analyzeGrantsAfter = 100

// The statements that refresh the statistics of the grant tables. Run by a role that does not
// own them, ANALYZE skips them with a warning; autovacuum refreshes them later.
const (
	analyzeProjectAccessSQL  = `ANALYZE lifecycle_project_access`
	analyzeConsumerAccessSQL = `ANALYZE lifecycle_consumer_access`
)

// insertGrants runs a grant statement and, when it added many grants, analyzes its table.
func insertGrants(ctx context.Context, db DBTX, insertSQL, analyzeSQL string, args ...any) error {
	tag, err := db.Exec(ctx, insertSQL, args...)
	if err != nil {
		return err
	}
	if tag.RowsAffected() >= analyzeGrantsAfter {
		if _, err := db.Exec(ctx, analyzeSQL); err != nil {
			return fmt.Errorf("analyze: %w", err)
		}
	}
	return nil
}

// GrantProjectAccess lets role see and write the given projects' outbox state ("*" for every
// project). A call that adds many grants refreshes the planner's statistics of them
// (analyzeGrantsAfter).
func GrantProjectAccess(ctx context.Context, db DBTX, role string, projects ...string) error {
	for _, p := range projects {
		if p != "*" {
			if err := ValidateProjectID(p); err != nil {
				return err
			}
		}
	}
	if err := insertGrants(ctx, db, grantProjectAccessSQL, analyzeProjectAccessSQL, role, projects); err != nil {
		return fmt.Errorf("grant project access to %s: %w", role, err)
	}
	return nil
}

// RevokeProjectAccess removes role's access to the given projects.
func RevokeProjectAccess(ctx context.Context, db DBTX, role string, projects ...string) error {
	if _, err := db.Exec(ctx, revokeProjectAccessSQL, role, projects); err != nil {
		return fmt.Errorf("revoke project access from %s: %w", role, err)
	}
	return nil
}

// GrantConsumerAccess lets role write the cursors, deliveries and audit rows of the given
// consumer identities ("*" for every one), within its projects. A call that adds many grants
// refreshes the planner's statistics of them, as GrantProjectAccess does.
func GrantConsumerAccess(ctx context.Context, db DBTX, role string, consumers ...string) error {
	for _, c := range consumers {
		if c != "*" {
			if _, err := ParseConsumerID(c); err != nil {
				return err
			}
		}
	}
	if err := insertGrants(ctx, db, grantConsumerAccessSQL, analyzeConsumerAccessSQL, role, consumers); err != nil {
		return fmt.Errorf("grant consumer access to %s: %w", role, err)
	}
	return nil
}

// RevokeConsumerAccess removes role's right to act for the given consumer identities.
func RevokeConsumerAccess(ctx context.Context, db DBTX, role string, consumers ...string) error {
	if _, err := db.Exec(ctx, revokeConsumerAccessSQL, role, consumers); err != nil {
		return fmt.Errorf("revoke consumer access from %s: %w", role, err)
	}
	return nil
}

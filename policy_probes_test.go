package outbox_test

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/testkit"
)

// grantTables are the tables every row-level security policy consults.
var grantTables = []string{"lifecycle_project_access", "lifecycle_consumer_access"}

// grantRowsRead runs stmt under EXPLAIN ANALYZE in a transaction it rolls back, and returns how
// many rows each grant table gave the statement's policy checks: every plan node on the table,
// init plans and sub plans included, its actual rows times its loops.
func grantRowsRead(t *testing.T, pool *pgxpool.Pool, stmt string, args ...any) map[string]int {
	t.Helper()
	ctx := testkit.Ctx(t)
	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	var out []byte
	require.NoError(t, tx.QueryRow(ctx, "EXPLAIN (ANALYZE, FORMAT JSON) "+stmt, args...).Scan(&out), stmt)
	var plans []explainedPlan
	require.NoError(t, json.Unmarshal(out, &plans))
	require.Len(t, plans, 1)
	got := map[string]int{}
	for _, tab := range grantTables {
		got[tab], _ = grantReads(plans, tab)
	}
	return got
}

// grantReads sums, over the nodes of plans that scan table, each node's rows times its loops
// and the pages it touched (known when buffers were logged).
func grantReads(plans []explainedPlan, table string) (rows, pages int) {
	for _, p := range plans {
		p.Plan.walk(func(n planNode) {
			if n.Relation == table {
				rows += int(n.Rows * n.Loops)
				pages += int(n.SharedHit + n.SharedRead)
			}
		})
	}
	return rows, pages
}

// manyNames returns prefix-0001 .. prefix-n.
func manyNames(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%04d", prefix, i+1)
	}
	return out
}

// TestPolicyChecksDoNotGrowWithGrants: a one-row statement's row-level security check reads the
// same grant rows whether its role is granted one project and consumer or thousands. Until
// migration 0014 every policy built a hash of all the role's grants for each statement: the
// writer hook's insert, on every delete, read every project its role was granted.
func TestPolicyChecksDoNotGrowWithGrants(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilege(t)
	const many = 2000
	projects := manyNames("proj", many)
	consumers := manyNames("engine", many)

	fewWriter, _ := lp.component(t, "few_writer", writerGrant(projects[0]))
	manyWriter, _ := lp.component(t, "many_writer", writerGrant(projects...))
	// Statistics as autovacuum may leave them: taken before the consumer role below was
	// granted its thousands (a busy CI run once met them so). The grants refresh them.
	_, err := lp.owner.Exec(ctx, `ANALYZE lifecycle_project_access, lifecycle_consumer_access`)
	require.NoError(t, err)
	fewConsumer, _ := lp.component(t, "few_consumer", consumerGrant(outbox.ConsumerID(consumers[0]), projects[0]))
	manyConsumer, manyConsumerRole := lp.component(t, "many_consumer", consumerGrant(outbox.ConsumerID(consumers[0]), projects...))
	require.NoError(t, outbox.GrantConsumerAccess(ctx, lp.owner, manyConsumerRole, consumers...))

	insert := outbox.Statements["insertEventSQL"]
	deletedAt := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	hookArgs := func(task string) []any {
		return []any{pgx.StrictNamedArgs{"project": projects[0], "task_id": task, "deleted_at": deletedAt, "archived": false,
			"payload_version": 1, "clock_offset": "0s", "writer_process_id": "host-1-0123456789abcdef", "prior_column": "todo"}}
	}
	few := grantRowsRead(t, fewWriter, insert, hookArgs("t-1")...)
	lots := grantRowsRead(t, manyWriter, insert, hookArgs("t-1")...)
	require.Equal(t, few, lots, "the hook's insert read more grant rows for a writer of %d projects", many)
	require.LessOrEqual(t, lots["lifecycle_project_access"], 2, "the hook's insert: the '*' look and one probe")

	// A consumer's one-cursor statements: creating its cursor, then taking its lease. Both
	// roles act for the same consumer in the same project, so they meet the same rows.
	ensure, acquire := outbox.Statements["ensureCursorsSQL"], outbox.Statements["acquireSQL"]
	ensureArgs := []any{consumers[0], []string{projects[0]}}
	few = grantRowsRead(t, fewConsumer, ensure, ensureArgs...)
	lots = grantRowsRead(t, manyConsumer, ensure, ensureArgs...)
	require.Equal(t, few, lots, "creating a cursor read more grant rows for a role of %d projects and consumers", many)
	require.Positive(t, lots["lifecycle_consumer_access"], "the cursor's insert was not checked against the consumer grants")

	_, err = fewConsumer.Exec(ctx, ensure, ensureArgs...)
	require.NoError(t, err)
	acquireArgs := []any{pgx.StrictNamedArgs{"consumer": consumers[0], "projects": []string{projects[0]},
		"owner": consumers[0] + "@0123456789abcdef", "lease_ttl": "10s", "clock_offset": "0s"}}
	few = grantRowsRead(t, fewConsumer, acquire, acquireArgs...)
	lots = grantRowsRead(t, manyConsumer, acquire, acquireArgs...)
	require.Equal(t, few, lots, "taking a lease read more grant rows for a role of %d projects and consumers", many)
	require.Positive(t, lots["lifecycle_consumer_access"], "the lease's update was not checked against the consumer grants")
}

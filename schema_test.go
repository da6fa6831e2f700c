package outbox_test

import (
	"context"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestMigrateFreshDatabase(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.Pool(t, pgtest.NewEmptyDB(t).URL)

	err := outbox.VerifySchema(ctx, pool)
	require.ErrorIs(t, err, outbox.ErrSchemaBehind)

	applied, err := outbox.Migrate(ctx, pool)
	require.NoError(t, err)
	require.Equal(t, allVersions(), applied)
	require.NoError(t, outbox.VerifySchema(ctx, pool))

	status, err := outbox.SchemaStatus(ctx, pool)
	require.NoError(t, err)
	require.Len(t, status, outbox.SchemaVersion)
	for i, m := range outbox.Migrations() {
		require.Equal(t, m.Version, status[i].Version)
		require.Equal(t, m.Checksum, status[i].Checksum)
	}
}

func TestMigrateUpgradePathIsIdempotent(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.Pool(t, pgtest.NewEmptyDB(t).URL)

	applied, err := outbox.MigrateThrough(ctx, pool, 1)
	require.NoError(t, err)
	require.Equal(t, []int{1}, applied)
	require.ErrorIs(t, outbox.VerifySchema(ctx, pool), outbox.ErrSchemaBehind)

	// The writer's table works at version 1 already.
	_, err = pool.Exec(ctx, insertRow, "p1", "t1")
	require.NoError(t, err)

	applied, err = outbox.Migrate(ctx, pool)
	require.NoError(t, err)
	var rest []int // every version after the first, whatever SchemaVersion is
	for v := 2; v <= outbox.SchemaVersion; v++ {
		rest = append(rest, v)
	}
	require.Equal(t, rest, applied)

	applied, err = outbox.Migrate(ctx, pool)
	require.NoError(t, err)
	require.Empty(t, applied, "re-running the applier applies nothing")
	require.NoError(t, outbox.VerifySchema(ctx, pool))

	var n int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM lifecycle_outbox`).Scan(&n))
	require.Equal(t, 1, n, "the upgrade kept existing rows")
	require.Equal(t, []string{"1=t1"}, numberedEvents(t, ctx, pool, "p1"), "and numbered the one a writer of version 1 left")
}

func TestConcurrentAppliersApplyEachMigrationOnce(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewEmptyDB(t)

	const appliers = 4
	pools := make([]interface {
		Begin(context.Context) (pgx.Tx, error)
	}, appliers)
	for i := range pools {
		pools[i] = pgtest.Pool(t, db.URL)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		all   []int
		errs  = make([]error, appliers)
		start = make(chan struct{})
	)
	for i := range appliers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			v, err := outbox.Migrate(ctx, pools[i])
			errs[i] = err
			mu.Lock()
			all = append(all, v...)
			mu.Unlock()
		}()
	}
	close(start)
	wg.Wait()
	for i, err := range errs {
		require.NoError(t, err, "applier %d", i)
	}
	sort.Ints(all)
	require.Equal(t, allVersions(), all, "every migration applied exactly once across the appliers")
	require.NoError(t, outbox.VerifySchema(ctx, pgtest.Pool(t, db.URL)))
}

func TestVerifySchemaDetectsTamperAheadAndBehind(t *testing.T) {
	t.Parallel()
	// Each subtest takes its own deadline once it runs: parallel subtests wait for a free slot
	// after this function returns, and a deadline taken here could pass while they wait.
	t.Run("checksum", func(t *testing.T) {
		t.Parallel()
		ctx := testkit.Ctx(t)
		pool := pgtest.NewPool(t)
		_, err := pool.Exec(ctx, `UPDATE lifecycle_outbox_schema SET checksum = 'deadbeef' WHERE version = 2`)
		require.NoError(t, err)
		err = outbox.VerifySchema(ctx, pool)
		require.ErrorIs(t, err, outbox.ErrSchemaChecksum)
		require.Contains(t, err.Error(), "0002_consumers")
		_, err = outbox.Migrate(ctx, pool)
		require.ErrorIs(t, err, outbox.ErrSchemaChecksum, "the applier refuses a tampered history too")
	})
	t.Run("ahead", func(t *testing.T) {
		t.Parallel()
		ctx := testkit.Ctx(t)
		pool := pgtest.NewPool(t)
		_, err := pool.Exec(ctx, `INSERT INTO lifecycle_outbox_schema (version, name, checksum) VALUES ($1, 'from_the_future', 'x')`, outbox.SchemaVersion+1)
		require.NoError(t, err)
		err = outbox.VerifySchema(ctx, pool)
		require.ErrorIs(t, err, outbox.ErrSchemaAhead)
		_, err = outbox.Migrate(ctx, pool)
		require.ErrorIs(t, err, outbox.ErrSchemaAhead)
	})
	t.Run("behind", func(t *testing.T) {
		t.Parallel()
		ctx := testkit.Ctx(t)
		pool := pgtest.Pool(t, pgtest.NewEmptyDB(t).URL)
		_, err := outbox.MigrateThrough(ctx, pool, 2)
		require.NoError(t, err)
		err = outbox.VerifySchema(ctx, pool)
		require.ErrorIs(t, err, outbox.ErrSchemaBehind)
		require.Contains(t, err.Error(), "version 2")
	})
}

// insertRow is a raw insert into the stream, as a writer of version 1 made it, for project $1
// and task $2.
const insertRow = `INSERT INTO lifecycle_outbox (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
	VALUES ($1, $2, '2026-01-02T03:04:05.000006Z', 'task:deleted', false, 1, now(), 'w')`

func TestDatabaseRefusesUnknownEventType(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	for _, table := range []string{"lifecycle_event_log", "lifecycle_outbox"} {
		_, err := pool.Exec(ctx, `INSERT INTO `+table+` (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
			VALUES ('p1', 't1', now(), 'task:archived', false, 1, now(), 'w')`)
		requireSQLState(t, err, pgerrcode.InvalidTextRepresentation) // not a value of the enum

		_, err = pool.Exec(ctx, `INSERT INTO `+table+` (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
			VALUES ('p1', 't1', now(), 'task:deleted', false, 0, now(), 'w')`)
		requireSQLState(t, err, pgerrcode.CheckViolation)
	}
}

func TestEventIDInSQLMatchesGo(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	for _, at := range []time.Time{
		time.Date(2026, 1, 2, 3, 4, 5, 6000, time.UTC),
		time.Date(1999, 12, 31, 23, 59, 59, 999999000, time.FixedZone("x", 5*3600+1800)),
		time.Date(2026, 11, 30, 0, 0, 0, 0, time.UTC),
	} {
		var got string
		require.NoError(t, pool.QueryRow(ctx, `SELECT lifecycle_event_id($1, $2)`, "task:1", at).Scan(&got))
		require.Equal(t, outbox.TaskDeletedEventID("task:1", at), got)
	}
}

func requireSQLState(t *testing.T, err error, code string) {
	t.Helper()
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, code, pgErr.Code, pgErr.Message)
}

var roleCounter atomic.Int64

// grantEveryComponent gives role the writer's, the consumer's (as consumer) and the
// operator's grants in projects, as a host running every component on one pool does.
func grantEveryComponent(ctx context.Context, db outbox.DBTX, role string, consumer outbox.ConsumerID, projects ...string) error {
	if err := outbox.GrantWriterRole(ctx, db, role, projects...); err != nil {
		return err
	}
	if err := outbox.GrantConsumerRole(ctx, db, role, consumer, projects...); err != nil {
		return err
	}
	return outbox.GrantOperatorRole(ctx, db, role, projects...)
}

// runtimeRole creates a login role with every component's grants (consumer identity "dash"),
// scoped to projects, and returns a connection string for it on db.
func runtimeRole(t *testing.T, db pgtest.DB, projects ...string) string {
	t.Helper()
	ctx := testkit.Ctx(t)
	role := fmt.Sprintf("rt_%s_%d", db.Name, roleCounter.Add(1))
	admin := pgtest.Pool(t, db.URL)
	_, err := admin.Exec(ctx, `CREATE ROLE `+pgx.Identifier{role}.Sanitize()+` LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE`)
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		// The database is dropped first (cleanups run last-in first-out); then the role.
		_, _ = admin.Exec(ctx, `DROP OWNED BY `+pgx.Identifier{role}.Sanitize())
	})
	require.NoError(t, grantEveryComponent(ctx, admin, role, "dash", projects...))
	return db.As(role)
}

func TestRowLevelSecurityScopesRoleToItsProjects(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	admin := pgtest.Pool(t, db.URL)
	for _, p := range []string{"proj-a", "proj-b"} {
		_, err := admin.Exec(ctx, insertLogRow, p, "t1")
		require.NoError(t, err)
		_, err = admin.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, last_acked_sequence) VALUES ($1, 'dash', 0)`, p)
		require.NoError(t, err)
	}
	_, err := outbox.Tick(ctx, admin)
	require.NoError(t, err)

	rolePool := pgtest.Pool(t, runtimeRole(t, db, "proj-a"))
	var bypass, super bool
	require.NoError(t, rolePool.QueryRow(ctx, `SELECT rolbypassrls, rolsuper FROM pg_roles WHERE rolname = current_user`).Scan(&bypass, &super))
	require.False(t, bypass)
	require.False(t, super)

	for _, table := range []string{"lifecycle_event_log", "lifecycle_tick_project", "lifecycle_outbox_heads", "lifecycle_outbox_head", "lifecycle_consumer_cursors"} {
		var projects []string
		require.NoError(t, rolePool.QueryRow(ctx, `SELECT coalesce(array_agg(DISTINCT project_id), '{}') FROM `+table).Scan(&projects))
		require.Equal(t, []string{"proj-a"}, projects, table)
	}

	_, err = rolePool.Exec(ctx, insertLogRow, "proj-b", "t2")
	requireSQLState(t, err, pgerrcode.InsufficientPrivilege) // the row violates the policy

	tag, err := rolePool.Exec(ctx, `UPDATE lifecycle_consumer_cursors SET last_acked_sequence = 99 WHERE project_id = 'proj-b'`)
	require.NoError(t, err)
	require.Zero(t, tag.RowsAffected(), "project B's cursor is invisible, so nothing is updated")

	// Project A still works for the role: the writer's insert, the ticker and the reader.
	_, err = rolePool.Exec(ctx, insertLogRow, "proj-a", "t2")
	require.NoError(t, err)
	heads, err := outbox.Sequence(ctx, rolePool, nil, 100)
	require.NoError(t, err)
	require.Len(t, heads, 1, "the role sees only its project's head")
	require.Equal(t, int64(2), heads["proj-a"].LastSequence)
	require.Equal(t, []string{"1=t1", "2=t2"}, numberedEvents(t, ctx, rolePool, "proj-a"))
	require.Empty(t, numberedEvents(t, ctx, rolePool, "proj-b"), "the reader, run by the role, reads nothing of B")
	require.Equal(t, []string{"1=t1"}, numberedEvents(t, ctx, admin, "proj-b"))
}

// allVersions is 1 .. SchemaVersion.
func allVersions() []int {
	var vs []int
	for v := 1; v <= outbox.SchemaVersion; v++ {
		vs = append(vs, v)
	}
	return vs
}

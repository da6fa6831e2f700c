package outbox_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/example/taskstore/schema"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
	"fusion/outbox/internal/testkit"
)

// leastPrivilege sets up a database the way a careful deployment does: an owner role that
// is not a superuser runs the migrations, and runtime roles get only the module's runtime
// grants (plus the host's own), each scoped to its projects.
type leastPrivilege struct {
	db     pgtest.DB
	owner  *pgxpool.Pool
	name   string
	schema string // where the module and the host's tables live; "" for public
}

// lpOptions vary the setup.
type lpOptions struct {
	through      int    // migrate the module only through this version (0: every migration)
	publicCreate bool   // let every role CREATE in public, as PostgreSQL 14 and older do
	schema       string // install the module and the host's tables in this schema instead of public
}

func newLeastPrivilege(t *testing.T) *leastPrivilege { return newLeastPrivilegeWith(t, lpOptions{}) }

func newLeastPrivilegeWith(t *testing.T, o lpOptions) *leastPrivilege {
	t.Helper()
	ctx := testkit.Ctx(t)
	db := pgtest.NewEmptyDB(t)
	admin := pgtest.Pool(t, db.URL)
	lp := &leastPrivilege{db: db, name: fmt.Sprintf("%s_%d", db.Name, roleCounter.Add(1)), schema: o.schema}
	owner := lp.name + "_owner"
	_, err := admin.Exec(ctx, `CREATE ROLE `+pgx.Identifier{owner}.Sanitize()+` LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE`)
	require.NoError(t, err)
	t.Cleanup(func() { dropRole(admin, owner) })
	if o.schema != "" {
		_, err = admin.Exec(ctx, `CREATE SCHEMA `+pgx.Identifier{o.schema}.Sanitize()+` AUTHORIZATION `+pgx.Identifier{owner}.Sanitize())
	} else {
		_, err = admin.Exec(ctx, `GRANT CREATE, USAGE ON SCHEMA public TO `+pgx.Identifier{owner}.Sanitize())
	}
	require.NoError(t, err)
	if o.publicCreate {
		_, err = admin.Exec(ctx, `GRANT CREATE ON SCHEMA public TO PUBLIC`)
		require.NoError(t, err)
	}
	lp.owner = pgtest.Pool(t, lp.url(owner))
	if o.through > 0 {
		_, err = outbox.MigrateThrough(ctx, lp.owner, o.through)
	} else {
		_, err = outbox.Migrate(ctx, lp.owner)
	}
	require.NoError(t, err, "the owner role migrates without superuser")
	require.NoError(t, schema.Migrate(ctx, lp.owner))
	return lp
}

// url is the database's connection string for role, on the module's schema.
func (lp *leastPrivilege) url(role string) string {
	u := lp.db.As(role)
	if lp.schema == "" {
		return u
	}
	if strings.HasPrefix(u, "postgres://") || strings.HasPrefix(u, "postgresql://") {
		sep := "?"
		if strings.Contains(u, "?") {
			sep = "&"
		}
		return u + sep + "search_path=" + lp.schema
	}
	return u + " search_path=" + lp.schema
}

// finishMigration applies the migrations newLeastPrivilegeWith left out.
func (lp *leastPrivilege) finishMigration(t *testing.T) {
	t.Helper()
	_, err := outbox.Migrate(testkit.Ctx(t), lp.owner)
	require.NoError(t, err)
}

// component creates a login role, lets grant give it a component's privileges (run as the
// owner), adds the reference host's grants on its own tables, and returns a pool logged in as
// it and its name.
func (lp *leastPrivilege) component(t *testing.T, suffix string, grant func(ctx context.Context, db outbox.DBTX, role string) error) (*pgxpool.Pool, string) {
	t.Helper()
	ctx := testkit.Ctx(t)
	role := lp.name + "_" + suffix
	admin := pgtest.Pool(t, lp.db.URL)
	_, err := admin.Exec(ctx, `CREATE ROLE `+pgx.Identifier{role}.Sanitize()+` LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE`)
	require.NoError(t, err)
	t.Cleanup(func() { dropRole(admin, role) })
	require.NoError(t, grant(ctx, lp.owner, role))
	_, err = lp.owner.Exec(ctx, `GRANT SELECT, INSERT, UPDATE ON tasks, run_audit, mailbox_notices, settings TO `+pgx.Identifier{role}.Sanitize())
	require.NoError(t, err)
	return pgtest.Pool(t, lp.url(role)), role
}

func dropRole(admin *pgxpool.Pool, role string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, _ = admin.Exec(ctx, `DROP OWNED BY `+pgx.Identifier{role}.Sanitize())
}

// runtime creates a role with every component's grants (consumer identity "dash") scoped to
// projects, as a host running every component on one pool, and returns a pool logged in as it.
func (lp *leastPrivilege) runtime(t *testing.T, suffix string, projects ...string) *pgxpool.Pool {
	t.Helper()
	ctx := testkit.Ctx(t)
	role := lp.name + "_" + suffix
	admin := pgtest.Pool(t, lp.db.URL)
	_, err := admin.Exec(ctx, `CREATE ROLE `+pgx.Identifier{role}.Sanitize()+` LOGIN NOSUPERUSER NOBYPASSRLS NOCREATEDB NOCREATEROLE`)
	require.NoError(t, err)
	t.Cleanup(func() { dropRole(admin, role) })
	require.NoError(t, grantEveryComponent(ctx, lp.owner, role, "dash", projects...))
	// The reference host's own tables: its business, granted by its owner.
	_, err = lp.owner.Exec(ctx, `GRANT SELECT, INSERT, UPDATE ON tasks, run_audit, mailbox_notices, settings TO `+pgx.Identifier{role}.Sanitize())
	require.NoError(t, err)
	return pgtest.Pool(t, lp.url(role))
}

func TestRuntimeRoleWorksScopedToItsProjects(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	lp := newLeastPrivilege(t)
	// Tasks exist in both projects (created by the owner, say by an import job).
	seed := testhost.New(lp.owner, testhost.Options{})
	for _, p := range []string{"proj-a", "proj-b"} {
		_, err := seed.CreateMany(ctx, p, "t", 5)
		require.NoError(t, err)
	}
	rtA := lp.runtime(t, "a", "proj-a")
	var super, bypass bool
	require.NoError(t, rtA.QueryRow(ctx, `SELECT rolsuper, rolbypassrls FROM pg_roles WHERE rolname = current_user`).Scan(&super, &bypass))
	require.False(t, super)
	require.False(t, bypass)

	t.Run("no DDL and no migrations", func(t *testing.T) {
		_, err := rtA.Exec(ctx, `CREATE TABLE sneaky (id int)`)
		requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
		_, err = outbox.Migrate(ctx, rtA)
		require.Error(t, err, "migrations need the owner role")
		require.NoError(t, outbox.VerifySchema(ctx, rtA), "but the runtime role can verify the schema")
	})

	// Writer, consumer and retention, all as the project-A runtime role.
	w, err := outbox.NewWriter(rtA, outbox.Config{}, zaptest.NewLogger(t))
	require.NoError(t, err)
	defer testkit.CloseWriter(t, w)
	store := testhost.New(rtA, testhost.Options{Writer: w})
	require.NoError(t, store.LoadCache(ctx, "proj-a"))
	for _, id := range []string{"t-1", "t-2"} {
		_, err := store.Delete(ctx, "proj-a", id)
		require.NoError(t, err)
	}

	t.Run("a delete in a foreign project fails whole", func(t *testing.T) {
		_, err := store.Delete(ctx, "proj-b", "t-1")
		requireSQLState(t, err, pgerrcode.InsufficientPrivilege) // the outbox row violates the role's policy
		task, err := seed.Get(ctx, "proj-b", "t-1")
		require.NoError(t, err)
		require.Nil(t, task.DeletedAt, "the task delete rolled back with its event")
	})

	cfg := testkit.FastConfig()
	rec := testkit.NewRecorder()
	// The consumer stands for another process of the same role: it observes the writes above.
	d := outbox.NewDispatcher(outbox.DispatcherOptions{Listeners: []outbox.Listener{rec}, Cache: store.Cache(), NoLocalWriter: true})
	c, err := outbox.NewConsumer(outbox.ConsumerOptions{ID: "dash", Pool: rtA, Config: cfg, Projects: outbox.StaticProjects{"proj-a"},
		Dispatcher: d, LiveTasks: store, Cache: store.Cache(), Logger: zaptest.NewLogger(t)})
	require.NoError(t, err)
	require.NoError(t, c.Start(ctx))
	rec.WaitCount(t, ctx, 2)
	require.NoError(t, c.Stop(ctx))

	r, err := outbox.NewRetention(rtA, outbox.Config{RetentionWindow: time.Hour}, zaptest.NewLogger(t), nil)
	require.NoError(t, err)
	ageEvents(t, ctx, lp.owner, 2*time.Hour)
	res, err := r.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, map[string]int64{"proj-a": 2}, res.PrunedByProject, "retention runs under the runtime role")

	t.Run("project B's outbox, cursors and deliveries are invisible and untouchable", func(t *testing.T) {
		// Project B's state, made by its own runtime role.
		rtB := lp.runtime(t, "b", "proj-b")
		wb, err := outbox.NewWriter(rtB, outbox.Config{NotifyDisabled: true}, zaptest.NewLogger(t))
		require.NoError(t, err)
		_, err = testhost.New(rtB, testhost.Options{Writer: wb}).Delete(ctx, "proj-b", "t-3")
		require.NoError(t, err)
		_, err = outbox.Sequence(ctx, rtB, nil, 100)
		require.NoError(t, err)
		_, err = rtB.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id) VALUES ('proj-b', 'dash')`)
		require.NoError(t, err)
		_, err = rtB.Exec(ctx, `UPDATE lifecycle_consumer_cursors SET last_acked_sequence = 0 WHERE project_id = 'proj-b' AND consumer_id = 'dash'`)
		require.NoError(t, err)
		_, err = rtB.Exec(ctx, `INSERT INTO lifecycle_consumer_deliveries (project_id, consumer_id, sequence, event_id, state, attempts, parked_at)
			SELECT 'proj-b', 'dash', 1, lifecycle_event_id(task_id, deleted_at), 'dead', 10, now() FROM lifecycle_outbox_read('proj-b', 0, 1, NULL, NULL, NULL)`)
		require.NoError(t, err)

		for _, table := range []string{"lifecycle_event_log", "lifecycle_tick_project", "lifecycle_outbox_heads", "lifecycle_outbox_head", "lifecycle_consumer_cursors", "lifecycle_consumer_deliveries"} {
			require.Zero(t, pgtest.QueryInt(t, rtA, `SELECT count(*) FROM `+table+` WHERE project_id = 'proj-b'`), "%s read across projects", table)
			require.Positive(t, pgtest.QueryInt(t, rtB, `SELECT count(*) FROM `+table+` WHERE project_id = 'proj-b'`), "%s is there for B", table)
		}
		for _, stmt := range []string{
			`UPDATE lifecycle_consumer_cursors SET last_acked_sequence = 99 WHERE project_id = 'proj-b'`,
			`UPDATE lifecycle_consumer_deliveries SET state = 'resolved', resolved_at = now() WHERE project_id = 'proj-b'`,
		} {
			tag, err := rtA.Exec(ctx, stmt)
			require.NoError(t, err)
			require.Zero(t, tag.RowsAffected(), stmt)
		}
		for _, stmt := range []string{
			`INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id) VALUES ('proj-b', 'intruder')`,
			`INSERT INTO lifecycle_consumer_deliveries (project_id, consumer_id, sequence, event_id, state, attempts, parked_at) VALUES ('proj-b', 'dash', 9, 'x', 'dead', 1, now())`,
			`INSERT INTO lifecycle_project_access (role_name, project_id) VALUES (current_user, 'proj-b')`,
			`DELETE FROM lifecycle_outbox WHERE project_id = 'proj-b'`, // no role but the owner deletes
			`DELETE FROM lifecycle_event_log WHERE project_id = 'proj-b'`,
			`UPDATE lifecycle_outbox_heads SET pruned_through = 1 WHERE project_id = 'proj-b'`,
			`SELECT * FROM lifecycle_outbox_prune('proj-b', 100, 0, interval '0', interval '1 hour')`,
		} {
			_, err := rtA.Exec(ctx, stmt)
			requireSQLState(t, err, pgerrcode.InsufficientPrivilege)
		}
		require.Zero(t, pgtest.QueryInt(t, rtA, `SELECT count(*) FROM lifecycle_outbox_read('proj-b', 0, 100, NULL, NULL, NULL)`),
			"the reader, run by A, reads nothing of B")
		require.Equal(t, 1, pgtest.QueryInt(t, rtB, `SELECT count(*) FROM lifecycle_outbox_read('proj-b', 0, 100, NULL, NULL, NULL)`))
		// The ticker numbers every project, whoever calls it; what it returns to A leaves B out.
		_, err = testhost.New(rtB, testhost.Options{Writer: wb}).Delete(ctx, "proj-b", "t-4")
		require.NoError(t, err)
		heads, err := outbox.Sequence(ctx, rtA, nil, 100)
		require.NoError(t, err)
		_, seesB := heads["proj-b"]
		require.False(t, seesB, "the heads A's tick returns leave B out")
		require.Equal(t, []string{"1=t-3", "2=t-4"}, numberedEvents(t, ctx, rtB, "proj-b"), "and B's events are numbered in B's order")
	})
}

package outbox_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
)

// The pending table (migration 0007): the writer's insert lands there, and the sequencer moves
// committed rows into the numbered stream.

const insertPendingRow = `INSERT INTO lifecycle_outbox_pending (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
	VALUES ($1, $2, '2026-01-02T03:04:05.000006Z', 'task:deleted', false, 1, now(), 'w')`

// insertPendingRows writes $3 pending rows into project $1, for tasks $2-1 to $2-$3.
const insertPendingRows = `INSERT INTO lifecycle_outbox_pending (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
	SELECT $1, $2 || '-' || g, '2026-01-02T03:04:05Z', 'task:deleted', false, 1, now(), 'w' FROM pg_catalog.generate_series(1, $3) g`

// statsSession is one session of a fresh database, whose statistics indexScans flushes first.
func statsSession(t *testing.T, ctx context.Context) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctx, pgtest.NewDB(t).URL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// numberedTasks lists the tasks of project's stream in sequence order.
func numberedTasks(t *testing.T, ctx context.Context, db outbox.DBTX, project string) []string {
	t.Helper()
	rows, err := db.Query(ctx, `SELECT task_id FROM lifecycle_outbox WHERE project_id = $1 ORDER BY sequence`, project)
	require.NoError(t, err)
	tasks, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return tasks
}

// indexScans is how many scans of index the session's statistics count.
func indexScans(t *testing.T, ctx context.Context, conn *pgx.Conn, index string) int {
	t.Helper()
	_, err := conn.Exec(ctx, `SELECT pg_catalog.pg_stat_force_next_flush()`)
	require.NoError(t, err)
	var n int
	require.NoError(t, conn.QueryRow(ctx, `SELECT coalesce(idx_scan, 0)::int FROM pg_catalog.pg_stat_user_indexes WHERE indexrelname = $1`, index).Scan(&n))
	return n
}

func TestWriterInsertsIntoPendingAndTheSequencerMovesIt(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	lp := newLeastPrivilege(t)
	writer, _ := lp.component(t, "writer", writerGrant("proj-a"))
	consumer, _ := lp.component(t, "consumer", consumerGrant("dash", "proj-a"))
	deleteTasksAs(t, lp, writer, "proj-a", 3)

	require.Equal(t, 3, pgtest.QueryInt(t, lp.owner, `SELECT count(*) FROM lifecycle_outbox_pending`))
	require.Zero(t, pgtest.QueryInt(t, lp.owner, `SELECT count(*) FROM lifecycle_outbox`), "the delete transaction wrote only the pending row")

	heads, err := outbox.Sequence(ctx, consumer, []string{"proj-a"}, 2)
	require.NoError(t, err)
	require.EqualValues(t, 3, heads["proj-a"].LastSequence)
	require.Equal(t, 3, heads["proj-a"].Assigned)
	require.Zero(t, pgtest.QueryInt(t, lp.owner, `SELECT count(*) FROM lifecycle_outbox_pending`))
	var seqs []int64
	rows, err := lp.owner.Query(ctx, `SELECT sequence FROM lifecycle_outbox WHERE project_id = 'proj-a' ORDER BY occurred_at, sequence`)
	require.NoError(t, err)
	seqs, err = pgx.CollectRows(rows, pgx.RowTo[int64])
	require.NoError(t, err)
	require.Equal(t, []int64{1, 2, 3}, seqs, "numbered 1..3 in the order the deletes committed")
}

// TestSequencerNumbersLegacyRowsFirst: a writer of schema 6 (a rolling deploy) still inserts
// unnumbered rows into the stream; they are older than what is pending, and numbered first.
func TestSequencerNumbersLegacyRowsFirst(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.NewPool(t)
	_, err := pool.Exec(ctx, insertRow, "p", "legacy")
	require.NoError(t, err)
	_, err = pool.Exec(ctx, insertPendingRow, "p", "pending")
	require.NoError(t, err)

	heads, err := outbox.Sequence(ctx, pool, nil, 10)
	require.NoError(t, err)
	require.EqualValues(t, 2, heads["p"].LastSequence)
	require.Equal(t, []string{"legacy", "pending"}, numberedTasks(t, ctx, pool, "p"))
	require.Zero(t, pgtest.QueryInt(t, pool, `SELECT count(*) FROM lifecycle_outbox WHERE sequence IS NULL`))
}

// TestSequencerDropsAPendingRowTheStreamAlreadyHolds: an identity is delivered once, however
// often it was written; the gap check holds because the duplicate takes no number.
func TestSequencerDropsAPendingRowTheStreamAlreadyHolds(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.NewPool(t)
	_, err := pool.Exec(ctx, insertPendingRow, "p", "t1")
	require.NoError(t, err)
	_, err = outbox.Sequence(ctx, pool, []string{"p"}, 10)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, insertPendingRow, "p", "t1") // the same identity again, after the move
	require.NoError(t, err)
	_, err = pool.Exec(ctx, insertPendingRow, "p", "t2")
	require.NoError(t, err)

	heads, err := outbox.Sequence(ctx, pool, []string{"p"}, 10)
	require.NoError(t, err)
	require.EqualValues(t, 2, heads["p"].LastSequence)
	require.Equal(t, 1, heads["p"].Assigned, "only t2 was numbered")
	require.Equal(t, 1, pgtest.QueryInt(t, pool, `SELECT count(*) FROM lifecycle_outbox WHERE task_id = 't1'`))
	require.Zero(t, pgtest.QueryInt(t, pool, `SELECT count(*) FROM lifecycle_outbox_pending`))
}

// TestSequencerMovesWithoutLookingUpEachRowFirst: the move lets the stream's key refuse a row
// it holds already (the test above) instead of looking every row up before inserting it, which
// cost as much as the key's own check (migration 0009). A batch of 200 new rows makes no index
// scan of the stream's key.
func TestSequencerMovesWithoutLookingUpEachRowFirst(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	conn := statsSession(t, ctx)
	_, err := conn.Exec(ctx, insertPendingRows, "p", "t", 200)
	require.NoError(t, err)
	keyScans := func() int { return indexScans(t, ctx, conn, "lifecycle_outbox_pkey") }
	before := keyScans()
	heads, err := outbox.Sequence(ctx, conn, []string{"p"}, 1000)
	require.NoError(t, err)
	require.Equal(t, 200, heads["p"].Assigned)
	require.Less(t, keyScans()-before, 10, "the move looked the rows up in the stream's key")
}

// TestSequencerMovesOnlyTheCallersProjects: the sequencer runs as its owner (it deletes pending
// rows, and no consumer role may hold DELETE there), so it decides itself which projects the
// caller may sequence. A project-A consumer can neither number, nor lock, nor see project B.
func TestSequencerMovesOnlyTheCallersProjects(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	lp := newLeastPrivilege(t)
	for _, p := range []string{"proj-a", "proj-b"} {
		_, err := lp.owner.Exec(ctx, insertPendingRow, p, "t1")
		require.NoError(t, err)
	}
	consumer, _ := lp.component(t, "consumer", consumerGrant("dash", "proj-a"))

	tx, err := consumer.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	rows, err := tx.Query(ctx, `SELECT project_id, last_sequence FROM lifecycle_outbox_sequence(ARRAY['proj-a', 'proj-b'], 100)`)
	require.NoError(t, err)
	heads, err := pgx.CollectRows(rows, pgx.RowToMap)
	require.NoError(t, err)
	require.Len(t, heads, 1, "project B's head is not returned")
	require.Equal(t, "proj-a", heads[0]["project_id"])

	// While the consumer's transaction is open, project B's heads row is free: it was never
	// locked, so no project-A role can stall project B's sequencing.
	_, err = lp.owner.Exec(ctx, `INSERT INTO lifecycle_outbox_heads (project_id) VALUES ('proj-b') ON CONFLICT DO NOTHING`)
	require.NoError(t, err)
	otx, err := lp.owner.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = otx.Rollback(ctx) }()
	_, err = otx.Exec(ctx, `SELECT 1 FROM lifecycle_outbox_heads WHERE project_id = 'proj-b' FOR UPDATE NOWAIT`)
	require.NoError(t, err)
	require.NoError(t, otx.Rollback(ctx))
	require.NoError(t, tx.Commit(ctx))

	require.Equal(t, 1, pgtest.QueryInt(t, lp.owner, `SELECT count(*) FROM lifecycle_outbox_pending WHERE project_id = 'proj-b'`))
	require.Zero(t, pgtest.QueryInt(t, lp.owner, `SELECT count(*) FROM lifecycle_outbox WHERE project_id = 'proj-b'`))
	require.Equal(t, 1, pgtest.QueryInt(t, lp.owner, `SELECT count(*) FROM lifecycle_outbox WHERE project_id = 'proj-a'`))

	// Every project at once (NULL) is every project the caller may sequence, no more.
	_, err = lp.owner.Exec(ctx, insertPendingRow, "proj-a", "t2")
	require.NoError(t, err)
	all, err := outbox.Sequence(ctx, consumer, nil, 100)
	require.NoError(t, err)
	require.Len(t, all, 1)
	require.EqualValues(t, 2, all["proj-a"].LastSequence)
	require.Equal(t, 1, pgtest.QueryInt(t, lp.owner, `SELECT count(*) FROM lifecycle_outbox_pending WHERE project_id = 'proj-b'`))

	// The consumer role cannot delete pending rows itself, nor lock the table writers insert into.
	_, err = consumer.Exec(ctx, `DELETE FROM lifecycle_outbox_pending`)
	requireSQLState(t, err, "42501")
	ltx, err := consumer.Begin(ctx)
	require.NoError(t, err)
	_, err = ltx.Exec(ctx, `LOCK TABLE lifecycle_outbox_pending IN ACCESS EXCLUSIVE MODE`)
	requireSQLState(t, err, "42501")
	_ = ltx.Rollback(ctx)
}

// TestPendingRefusesMalformedRows: the column types carry 0005's checks, so a hostile or broken
// writer cannot leave a row no consumer could deliver; and the writer role writes only its
// own projects.
func TestPendingRefusesMalformedRows(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	lp := newLeastPrivilege(t)
	writer, _ := lp.component(t, "writer", writerGrant("proj-a"))
	const insert = `INSERT INTO lifecycle_outbox_pending (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id, prior_column, trace_context)
		VALUES ($1, $2, $3::timestamptz, 'task:deleted', false, $4, now(), $5, $6, $7)`
	ok := []any{"proj-a", "t1", "2026-01-02T03:04:05Z", 1, "w-1", nil, nil}
	with := func(i int, v any) []any {
		args := append([]any(nil), ok...)
		args[i] = v
		return args
	}
	for name, args := range map[string][]any{
		"project with a space":       with(0, "proj a"),
		"task with a newline":        with(1, "t\n1"),
		"empty task":                 with(1, ""),
		"infinite deletion time":     with(2, "infinity"),
		"payload version zero":       with(3, 0),
		"writer with a slash":        with(4, "w/1"),
		"prior column with a tab":    with(5, "to\tdo"),
		"trace context of free text": with(6, "hello"),
	} {
		_, err := writer.Exec(ctx, insert, args...)
		require.Error(t, err, name)
		requireSQLState(t, err, "23514") // check_violation, from the column's domain
	}
	_, err := writer.Exec(ctx, insert, with(0, "proj-b")...)
	requireSQLState(t, err, "42501") // another project's row violates the policy
	_, err = writer.Exec(ctx, insert, ok...)
	require.NoError(t, err, "the well-formed row is accepted")
	require.Equal(t, 1, pgtest.QueryInt(t, lp.owner, `SELECT count(*) FROM lifecycle_outbox_pending`))
}

// TestSequencerSkipsAProjectAnotherHolds: the consumer's call (a negative limit) does not wait
// for a project whose heads row another sequencer holds: it returns the project as busy at
// once, with the head that sequencer last committed, and numbers the other projects. Sequence
// (a positive limit) waits, at most the function's lock timeout.
func TestSequencerSkipsAProjectAnotherHolds(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.NewPool(t)
	for _, p := range []string{"a", "b"} {
		_, err := pool.Exec(ctx, insertPendingRow, p, "t1")
		require.NoError(t, err)
	}
	_, err := outbox.Sequence(ctx, pool, nil, 10)
	require.NoError(t, err)
	for _, p := range []string{"a", "b"} {
		_, err := pool.Exec(ctx, insertPendingRow, p, "t2")
		require.NoError(t, err)
	}

	holder, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `SELECT 1 FROM lifecycle_outbox_heads WHERE project_id = 'a' FOR UPDATE`)
	require.NoError(t, err)

	rows, err := pool.Query(ctx, `SELECT project_id, last_sequence, assigned FROM lifecycle_outbox_sequence(ARRAY['a', 'b'], -10) ORDER BY 1`)
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, pgx.RowToMap)
	require.NoError(t, err)
	require.Len(t, got, 2)
	require.EqualValues(t, -1, got[0]["assigned"], "a is busy: skipped, not waited for")
	require.EqualValues(t, 1, got[0]["last_sequence"])
	require.EqualValues(t, 1, got[1]["assigned"], "b is numbered")
	require.EqualValues(t, 2, got[1]["last_sequence"])

	_, err = outbox.Sequence(ctx, pool, []string{"a"}, 10)
	requireSQLState(t, err, "55P03") // Sequence waits for the lock, at most the function's lock timeout

	require.NoError(t, holder.Rollback(ctx))
	heads, err := outbox.Sequence(ctx, pool, []string{"a"}, 10)
	require.NoError(t, err)
	require.EqualValues(t, 2, heads["a"].LastSequence)
	require.False(t, heads["a"].Busy)
}

// TestSequencerReachesRowsByIndexAsTheStreamGrows: the plan cache keeps a function's plans for
// the session, so a plan chosen while the tables were small (a seq scan and sort of the pending
// table for each batch) would be kept as they grow and make moving a backlog quadratic: 2,000
// rows/s over a 200k backlog, measured with the plans forced generic. The function reads every
// table by index instead.
func TestSequencerReachesRowsByIndexAsTheStreamGrows(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := pgtest.NewDB(t)
	conn, err := pgx.Connect(ctx, db.URL) // one session: one plan cache
	require.NoError(t, err)
	defer conn.Close(ctx)
	for round := range 8 { // past the five calls after which the plan cache may keep a generic plan
		_, err := conn.Exec(ctx, insertPendingRows, "p", "r"+string(rune('a'+round)), 1+round*round*100)
		require.NoError(t, err)
		_, err = outbox.Sequence(ctx, conn, []string{"p"}, 1000)
		require.NoError(t, err)
	}
	_, err = conn.Exec(ctx, `SELECT pg_catalog.pg_stat_force_next_flush()`)
	require.NoError(t, err)
	for _, table := range []string{"lifecycle_outbox", "lifecycle_outbox_pending"} {
		var seqScans, idxScans int64
		require.NoError(t, conn.QueryRow(ctx, `SELECT coalesce(seq_scan, 0), coalesce(idx_scan, 0) FROM pg_catalog.pg_stat_user_tables WHERE relname = $1`, table).
			Scan(&seqScans, &idxScans))
		require.Zero(t, seqScans, "the sequencer scanned the whole of %s", table)
		require.Positive(t, idxScans, table)
	}
}

// TestSequencerNumbersTheOldestPendingRowsFirst: a batch smaller than the backlog takes the
// project's oldest pending rows, whatever their task IDs (migration 0013). Before, it took the
// smallest task IDs, so on a backlog an event waited for as many batches as smaller IDs were
// pending. Here the task IDs run against the deletion times.
func TestSequencerNumbersTheOldestPendingRowsFirst(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	pool := pgtest.NewPool(t)
	_, err := pool.Exec(ctx, `INSERT INTO lifecycle_outbox_pending (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
		SELECT 'p', 'task-' || pg_catalog.chr(122 - g), '2026-01-02T03:04:05Z'::timestamptz + g * interval '1 second', 'task:deleted', false, 1,
		       '2026-01-02T03:04:05Z'::timestamptz + g * interval '1 second', 'w'
		FROM pg_catalog.generate_series(0, 9) g`) // task-z deleted first, task-q last
	require.NoError(t, err)

	numbered := func() []string { return numberedTasks(t, ctx, pool, "p") }
	batch := func() int { // one call, one batch of three
		return pgtest.QueryInt(t, pool, `SELECT assigned FROM lifecycle_outbox_sequence(ARRAY['p'], 3)`)
	}
	require.Equal(t, 3, batch())
	require.Equal(t, []string{"task-z", "task-y", "task-x"}, numbered(), "the three oldest, not the three smallest IDs")
	require.Equal(t, 3, batch())
	require.Equal(t, []string{"task-z", "task-y", "task-x", "task-w", "task-v", "task-u"}, numbered())
}

// TestKeysInArrivalOrderKeepEveryRowAcrossTheUpgrade: migration 0013 rebuilds both keys in
// (project_id, deleted_at, task_id) order under rows of every kind, which all survive; both keys
// still refuse an identity stored twice, and the writer's ON CONFLICT still finds its key.
func TestKeysInArrivalOrderKeepEveryRowAcrossTheUpgrade(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	lp := newLeastPrivilegeWith(t, lpOptions{through: 12})
	_, err := lp.owner.Exec(ctx, insertPendingRows, "p", "t", 5)
	require.NoError(t, err)
	require.Equal(t, 3, pgtest.QueryInt(t, lp.owner, `SELECT assigned FROM lifecycle_outbox_sequence(ARRAY['p'], 3)`))
	lp.finishMigration(t)

	keyOf := func(table string) string {
		var def string
		require.NoError(t, lp.owner.QueryRow(ctx, `SELECT pg_catalog.pg_get_constraintdef(oid) FROM pg_catalog.pg_constraint
			WHERE conrelid = $1::regclass AND contype = 'p'`, table).Scan(&def))
		return def
	}
	require.Equal(t, "PRIMARY KEY (project_id, deleted_at, task_id)", keyOf("lifecycle_outbox"))
	require.Equal(t, "PRIMARY KEY (project_id, deleted_at, task_id)", keyOf("lifecycle_outbox_pending"))
	require.Equal(t, 3, pgtest.QueryInt(t, lp.owner, `SELECT count(*) FROM lifecycle_outbox`))
	require.Equal(t, 2, pgtest.QueryInt(t, lp.owner, `SELECT count(*) FROM lifecycle_outbox_pending`))

	_, err = lp.owner.Exec(ctx, insertPendingRows, "p", "t", 1) // t-1 is in the stream now
	require.NoError(t, err, "the pending key does not know the stream's rows")
	_, err = lp.owner.Exec(ctx, insertPendingRows, "p", "t", 5)
	requireSQLState(t, err, "23505")
	_, err = lp.owner.Exec(ctx, `INSERT INTO lifecycle_outbox (project_id, sequence, event_type, task_id, deleted_at, archived, writer_process_id, payload_version, occurred_at)
		SELECT project_id, 99, event_type, task_id, deleted_at, archived, writer_process_id, payload_version, occurred_at FROM lifecycle_outbox WHERE sequence = 1`)
	requireSQLState(t, err, "23505")

	heads, err := outbox.Sequence(ctx, lp.owner, []string{"p"}, 10)
	require.NoError(t, err)
	require.Equal(t, 2, heads["p"].Assigned, "t-4 and t-5; the repeated t-1 takes no number")
	require.EqualValues(t, 5, heads["p"].LastSequence)
	require.Zero(t, pgtest.QueryInt(t, lp.owner, `SELECT count(*) FROM lifecycle_outbox_pending`))
}

// TestIdlePollOfManyProjectsProbesNoProject: a call for more than 64 projects looks once whether
// anything at all waits to be numbered (migration 0013) instead of probing the pending table
// for each project, and still numbers a row of any one of them, pending or legacy.
func TestIdlePollOfManyProjectsProbesNoProject(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	conn := statsSession(t, ctx)
	projects := make([]string, 200)
	for i := range projects {
		projects[i] = fmt.Sprintf("p%03d", i)
	}
	pendingScans := func() int { return indexScans(t, ctx, conn, "lifecycle_outbox_pending_pkey") }
	call := func() map[string]outbox.Head {
		heads, err := outbox.Sequence(ctx, conn, projects, 100)
		require.NoError(t, err)
		return heads
	}
	_, err := conn.Exec(ctx, `INSERT INTO lifecycle_outbox_pending (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
		SELECT p, 'first', now(), 'task:deleted', false, 1, now(), 'w' FROM pg_catalog.unnest($1::text[]) AS p`, projects)
	require.NoError(t, err)
	require.Equal(t, 1, call()["p199"].Assigned) // every project has its head now
	before := pendingScans()
	heads := call()
	require.Len(t, heads, 200)
	require.Less(t, pendingScans()-before, 5, "an idle call probed the pending table project by project")

	_, err = conn.Exec(ctx, insertPendingRows, "p123", "t", 2)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, insertRow, "p045", "legacy") // a schema-6 writer's row
	require.NoError(t, err)
	heads = call()
	require.Equal(t, 2, heads["p123"].Assigned)
	require.Equal(t, 1, heads["p045"].Assigned)
	require.Zero(t, heads["p000"].Assigned)
}

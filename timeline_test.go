package outbox_test

import (
	"bytes"
	"context"
	"io"
	"os"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgcluster"
)

// Ticks compare transaction IDs (migration 0018), so the xid timeline is part of the data: a
// logical dump restored into another cluster keeps the stored IDs (the log's txid column and
// the ticks' snapshots) but not the cluster's counter. The test below moves a database that
// way and follows docs/operations.md, "Moving the database".

const (
	timelineOwner = "outbox_owner"
	timelineDB    = "moved"
	// xidEpoch is 2^32: a full transaction ID (xid8) is epoch * xidEpoch + the 32-bit xid.
	xidEpoch = int64(1) << 32
	// originEpoch is the epoch the origin cluster runs at, so that its IDs are clearly ahead
	// of a fresh cluster's (epoch 0), as those of any long-lived cluster may be.
	originEpoch = 2
)

const timelineInsertSQL = `INSERT INTO lifecycle_event_log (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
VALUES ($1, $2, '2026-01-02T03:04:05Z'::timestamptz + $3::int * interval '1 second', 'task:deleted', false, 1, now(), 'w')`

// epochQuery is the query of docs/operations.md, "Moving the database", that gives the epoch to
// set on the new cluster.
const epochQuery = `SELECT floor(greatest(
         (SELECT max(pg_snapshot_xmax(snapshot)::text::numeric) FROM lifecycle_tick),
         (SELECT max(txid::text::numeric) FROM lifecycle_event_log)) / 4294967296)::bigint + 1`

// timelineTickCheck is the timeline check of lifecycle_outbox_tick, as the function's text has it.
const timelineTickCheck = `IF pg_catalog.pg_snapshot_xmax(v_last) OPERATOR(pg_catalog.>) pg_catalog.pg_snapshot_xmax(v_cur)
       OR v_newest OPERATOR(pg_catalog.>=) pg_catalog.pg_snapshot_xmax(v_cur) THEN`

// TestMovedDatabaseTicksAfterEpochBump moves a database from a cluster at epoch 2 into a fresh
// cluster by pg_dump and pg_restore, with events ticked, events committed but not ticked, and
// one event whose transaction was open at the last tick. The new cluster's ticker refuses with
// LX001 and a HINT naming the epoch; after pg_resetwal --epoch on the stopped cluster every
// event is read exactly once, in order, with the sequences the origin gave, and the new
// cluster's own events follow. A copy of the database whose ticker lacks the check loses the
// events committed after the last tick, without an error.
func TestMovedDatabaseTicksAfterEpochBump(t *testing.T) {
	if _, err := pgcluster.FindBinDir(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI=true: %v", err)
		}
		t.Skip(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	// The origin, at epoch 2.
	a := startTimelineCluster(t, ctx)
	require.NoError(t, a.StopServer(ctx))
	runClusterTool(t, ctx, a, nil, "pg_resetwal", "--epoch="+strconv.Itoa(originEpoch), "-D", a.DataDir())
	require.NoError(t, a.StartServer(ctx))
	createOwnerDatabases(t, ctx, a, timelineDB)
	ownerA := timelineConn(t, ctx, a, timelineDB)
	_, err := outbox.Migrate(ctx, ownerA)
	require.NoError(t, err)
	require.GreaterOrEqual(t, currentXid(t, ctx, ownerA), originEpoch*xidEpoch)

	w := &timelineWriter{}
	// Tick 2: four events.
	w.write(t, ctx, ownerA, "p1", "t1", "t2", "t3")
	w.write(t, ctx, ownerA, "p2", "u1")
	requireTick(t, ctx, ownerA, 4)
	// Tick 3 is taken while a transaction that wrote an event is open: its ID is in tick 3's
	// snapshot, and the event belongs to the first tick after it commits.
	open, err := pgx.Connect(ctx, a.DSN(timelineDB)+" user="+timelineOwner)
	require.NoError(t, err)
	defer open.Close(context.Background())
	openTx, err := open.Begin(ctx)
	require.NoError(t, err)
	w.write(t, ctx, openTx, "p1", "open")
	w.write(t, ctx, ownerA, "p1", "t4", "t5")
	w.write(t, ctx, ownerA, "p2", "u2")
	requireTick(t, ctx, ownerA, 3)
	require.NoError(t, openTx.Commit(ctx))
	// Committed, never ticked at the origin.
	w.write(t, ctx, ownerA, "p1", "t6", "t7")
	w.write(t, ctx, ownerA, "p2", "u3")
	require.Equal(t, numbered(1, "t1", "t2", "t3", "t4", "t5"), readProject(t, ctx, ownerA, "p1", 0))
	require.Equal(t, numbered(1, "u1", "u2"), readProject(t, ctx, ownerA, "p2", 0))

	dump := runClusterTool(t, ctx, a, nil, "pg_dump", "--format=custom", "--dbname="+a.DSN(timelineDB))

	// The new cluster, at epoch 0: the database, and a copy for the control below.
	b := startTimelineCluster(t, ctx)
	createOwnerDatabases(t, ctx, b, timelineDB, "unchecked")
	for _, db := range []string{timelineDB, "unchecked"} {
		runClusterTool(t, ctx, b, bytes.NewReader(dump), "pg_restore", "--exit-on-error", "--dbname="+b.DSN(db))
	}

	ownerB := timelineConn(t, ctx, b, timelineDB)
	require.Less(t, currentXid(t, ctx, ownerB), xidEpoch, "the new cluster's IDs start again in epoch 0")
	var wantEpoch int64
	require.NoError(t, ownerB.QueryRow(ctx, epochQuery).Scan(&wantEpoch))
	require.Equal(t, int64(originEpoch+1), wantEpoch, "the origin ran at epoch 2")
	_, _, err = tick(ctx, ownerB)
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr, "the ticker refuses on the moved database")
	require.Equal(t, outbox.SQLStateXIDTimeline, pgErr.Code, pgErr.Message)
	m := regexp.MustCompile(`pg_resetwal --epoch=(\d+) `).FindStringSubmatch(pgErr.Hint)
	require.NotNil(t, m, "HINT: %s", pgErr.Hint)
	require.Equal(t, strconv.FormatInt(wantEpoch, 10), m[1], "HINT: %s", pgErr.Hint)
	t.Logf("refused: %s\nHINT: %s", pgErr.Message, pgErr.Hint)

	// The control, on the new cluster's own timeline: the same database with a ticker that
	// lacks the check ticks without an error and never numbers what was committed after the
	// last tick (t6, t7, u3). Only the event of the transaction open at that tick is found,
	// by the snapshot's list of open IDs.
	unchecked := timelineConn(t, ctx, b, "unchecked")
	dropTimelineCheck(t, ctx, unchecked)
	requireTick(t, ctx, unchecked, 1)
	uw := &timelineWriter{n: w.n}
	uw.write(t, ctx, unchecked, "p1", "b1")
	uw.write(t, ctx, unchecked, "p2", "v1")
	requireTick(t, ctx, unchecked, 2)
	requireTick(t, ctx, unchecked, 0)
	require.Equal(t, numbered(1, "t1", "t2", "t3", "t4", "t5", "open", "b1"), readProject(t, ctx, unchecked, "p1", 0),
		"without the check t6 and t7 are never read")
	require.Equal(t, numbered(1, "u1", "u2", "v1"), readProject(t, ctx, unchecked, "p2", 0), "without the check u3 is never read")
	require.Equal(t, 13, countRows(t, ctx, unchecked, `SELECT count(*) FROM lifecycle_event_log`), "the lost events are in the log")
	require.NoError(t, unchecked.Close(ctx))

	// The procedure: stop the new cluster, bump its epoch to the HINT's, start it.
	require.NoError(t, ownerB.Close(ctx))
	require.NoError(t, b.StopServer(ctx))
	runClusterTool(t, ctx, b, nil, "pg_resetwal", "--epoch="+m[1], "-D", b.DataDir())
	require.NoError(t, b.StartServer(ctx))
	ownerB = timelineConn(t, ctx, b, timelineDB)
	require.GreaterOrEqual(t, currentXid(t, ctx, ownerB), wantEpoch*xidEpoch)

	// The first tick numbers everything committed at the origin after its last tick, in one
	// batch; then there is nothing new until the new cluster's writers write.
	requireTick(t, ctx, ownerB, 4)
	requireTick(t, ctx, ownerB, 0)
	w.write(t, ctx, ownerB, "p1", "b1", "b2")
	w.write(t, ctx, ownerB, "p2", "v1")
	requireTick(t, ctx, ownerB, 3)

	require.Equal(t, numbered(1, "t1", "t2", "t3", "t4", "t5", "open", "t6", "t7", "b1", "b2"), readProject(t, ctx, ownerB, "p1", 0))
	require.Equal(t, numbered(1, "u1", "u2", "u3", "v1"), readProject(t, ctx, ownerB, "p2", 0))
	// A consumer whose cursor was at the origin's head goes on from there.
	require.Equal(t, numbered(6, "open", "t6", "t7", "b1", "b2"), readProject(t, ctx, ownerB, "p1", 5))
	require.Equal(t, numbered(3, "u3", "v1"), readProject(t, ctx, ownerB, "p2", 2))
}

// startTimelineCluster starts a throwaway cluster, stopped and removed when t ends.
func startTimelineCluster(t *testing.T, ctx context.Context) *pgcluster.Cluster {
	t.Helper()
	c, err := pgcluster.Start(ctx, pgcluster.Options{MaxConnections: 20})
	require.NoError(t, err)
	t.Cleanup(c.Stop)
	return c
}

// runClusterTool runs a tool of c's binary directory as the cluster's OS user and returns its
// standard output.
func runClusterTool(t *testing.T, ctx context.Context, c *pgcluster.Cluster, stdin io.Reader, tool string, args ...string) []byte {
	t.Helper()
	cmd := c.Command(ctx, tool, args...)
	var out, stderr bytes.Buffer
	cmd.Stdin, cmd.Stdout, cmd.Stderr = stdin, &out, &stderr
	require.NoError(t, cmd.Run(), "%s: %s", tool, stderr.String())
	return out.Bytes()
}

// createOwnerDatabases creates the owner role (the role that applies the migrations and owns
// the module's objects) and databases it owns.
func createOwnerDatabases(t *testing.T, ctx context.Context, c *pgcluster.Cluster, dbs ...string) {
	t.Helper()
	conn, err := pgx.Connect(ctx, c.DSN("postgres"))
	require.NoError(t, err)
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, `CREATE ROLE `+timelineOwner+` LOGIN`)
	require.NoError(t, err)
	for _, db := range dbs {
		_, err = conn.Exec(ctx, `CREATE DATABASE `+pgx.Identifier{db}.Sanitize()+` OWNER `+timelineOwner)
		require.NoError(t, err)
	}
}

// timelineConn connects to db as the owner, until t ends.
func timelineConn(t *testing.T, ctx context.Context, c *pgcluster.Cluster, db string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctx, c.DSN(db)+" user="+timelineOwner)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	return conn
}

// timelineWriter writes events, each in its own transaction unless on an open one; n gives
// each a distinct deleted_at.
type timelineWriter struct{ n int }

func (w *timelineWriter) write(t *testing.T, ctx context.Context, db interface {
	Exec(context.Context, string, ...any) (pgconn.CommandTag, error)
}, project string, tasks ...string) {
	t.Helper()
	for _, task := range tasks {
		w.n++
		_, err := db.Exec(ctx, timelineInsertSQL, project, task, w.n)
		require.NoError(t, err)
	}
}

func currentXid(t *testing.T, ctx context.Context, conn *pgx.Conn) int64 {
	t.Helper()
	var xid int64
	require.NoError(t, conn.QueryRow(ctx, `SELECT pg_catalog.pg_current_xact_id()::text::bigint`).Scan(&xid))
	return xid
}

// tick runs the ticker once, in its own transaction.
func tick(ctx context.Context, conn *pgx.Conn) (*int64, int64, error) {
	var id *int64
	var events int64
	err := conn.QueryRow(ctx, `SELECT tick_id, events FROM lifecycle_outbox_tick(NULL)`).Scan(&id, &events)
	return id, events, err
}

// requireTick ticks and checks how many events the tick numbered (0: no tick was taken).
func requireTick(t *testing.T, ctx context.Context, conn *pgx.Conn, events int64) {
	t.Helper()
	id, got, err := tick(ctx, conn)
	require.NoError(t, err)
	require.Equal(t, events, got)
	require.Equal(t, events == 0, id == nil, "a tick is stored exactly when it numbered events")
}

type readEvent struct {
	Sequence int64
	Task     string
}

func numbered(first int64, tasks ...string) []readEvent {
	out := make([]readEvent, len(tasks))
	for i, task := range tasks {
		out[i] = readEvent{first + int64(i), task}
	}
	return out
}

// readProject reads everything of project after the given sequence.
func readProject(t *testing.T, ctx context.Context, conn *pgx.Conn, project string, after int64) []readEvent {
	t.Helper()
	rows, err := conn.Query(ctx, `SELECT sequence, task_id FROM lifecycle_outbox_read($1, $2, 1000, NULL, NULL, NULL)`, project, after)
	require.NoError(t, err)
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[readEvent])
	require.NoError(t, err)
	return got
}

func countRows(t *testing.T, ctx context.Context, conn *pgx.Conn, sql string) int {
	t.Helper()
	var n int
	require.NoError(t, conn.QueryRow(ctx, sql).Scan(&n))
	return n
}

// dropTimelineCheck replaces the database's ticker with a copy whose timeline check never fires.
func dropTimelineCheck(t *testing.T, ctx context.Context, conn *pgx.Conn) {
	t.Helper()
	var def string
	require.NoError(t, conn.QueryRow(ctx, `SELECT pg_catalog.pg_get_functiondef('lifecycle_outbox_tick(text)'::regprocedure)`).Scan(&def))
	require.Equal(t, 1, strings.Count(def, timelineTickCheck), "the ticker's timeline check:\n%s", def)
	_, err := conn.Exec(ctx, strings.Replace(def, timelineTickCheck, `IF false THEN`, 1))
	require.NoError(t, err)
}

package outbox_test

// Helpers shared by the root package's tests.

import (
	"context"
	"encoding/json"

	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/testkit"
)

// explainedSession is one superuser session whose statements, nested ones included, report
// their executed plans (auto_explain with ANALYZE, as notices): the rows each plan node
// produced and how often it ran, which measure a statement's work without timing it.
type explainedSession struct {
	conn *pgx.Conn
	mu   sync.Mutex
	log  []explainedPlan
}

type explainedPlan struct {
	Query string   `json:"Query Text"`
	Plan  planNode `json:"Plan"`
}

type planNode struct {
	Type     string  `json:"Node Type"`
	Relation string  `json:"Relation Name"`
	Rows     float64 `json:"Actual Rows"`
	Loops    float64 `json:"Actual Loops"`
	// Buffers the node and its children touched; present only when buffers are logged.
	SharedHit  float64 `json:"Shared Hit Blocks"`
	SharedRead float64 `json:"Shared Read Blocks"`
	// Rows a scan read and its filter dropped, over all its runs divided by Loops, as Rows.
	RemovedByFilter float64    `json:"Rows Removed by Filter"`
	Plans           []planNode `json:"Plans"`
}

// work is the node's and its children's output rows over all their runs, a run that produced
// nothing counting one.
func (n planNode) work() float64 {
	w := (n.Rows + 1) * n.Loops
	for _, c := range n.Plans {
		w += c.work()
	}
	return w
}

// walk calls f on the node and every node below it.
func (n planNode) walk(f func(planNode)) {
	f(n)
	for _, c := range n.Plans {
		c.walk(f)
	}
}

func newExplainedSession(t *testing.T, ctx context.Context, url string) *explainedSession {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	require.NoError(t, err)
	s := &explainedSession{}
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		i := strings.IndexByte(n.Message, '{')
		if !strings.HasPrefix(n.Message, "duration:") || i < 0 {
			return
		}
		var p explainedPlan
		if err := json.Unmarshal([]byte(n.Message[i:]), &p); err != nil {
			t.Errorf("decode auto_explain plan: %v", err)
			return
		}
		s.mu.Lock()
		s.log = append(s.log, p)
		s.mu.Unlock()
	}
	s.conn, err = pgx.ConnectConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(func() { s.conn.Close(context.Background()) })
	for _, stmt := range []string{
		`LOAD 'auto_explain'`,
		`SET auto_explain.log_min_duration = 0`,
		`SET auto_explain.log_analyze = on`,
		`SET auto_explain.log_timing = off`,
		`SET auto_explain.log_nested_statements = on`,
		`SET auto_explain.log_format = 'json'`,
		`SET auto_explain.log_level = 'notice'`,
	} {
		_, err := s.conn.Exec(ctx, stmt)
		require.NoError(t, err, stmt)
	}
	return s
}

// plans runs sql and returns the plans of the statements it ran.
func (s *explainedSession) plans(t *testing.T, ctx context.Context, sql string, args ...any) []explainedPlan {
	t.Helper()
	s.mu.Lock()
	s.log = nil
	s.mu.Unlock()
	_, err := s.conn.Exec(ctx, sql, args...)
	require.NoError(t, err)
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.log
}

func queryString(t *testing.T, db outbox.DBTX, sql string, args ...any) string {
	t.Helper()
	var v string
	require.NoError(t, db.QueryRow(testkit.Ctx(t), sql, args...).Scan(&v))
	return v
}

// insertLogRow writes an event of project $1, task $2, into the log as the writer hook does,
// with no hint to the ticker.
const insertLogRow = `INSERT INTO lifecycle_event_log (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
	VALUES ($1, $2, '2026-01-02T03:04:05.000006Z', 'task:deleted', false, 1, now(), 'w')`

// holdTickerElection holds the ticker's election lock on a session of its own until the test
// ends, as a session that never ticks could: no consumer is elected, so none ticks on hints or
// follows a tick up, and each ticks only once per TickFallbackInterval.
func holdTickerElection(t *testing.T, ctx context.Context, url string) {
	t.Helper()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	_, err = conn.Exec(ctx, `SELECT pg_catalog.pg_advisory_lock($1)`, outbox.TickerLockKey)
	require.NoError(t, err)
}

// Rows of writers of schema 16 and earlier, which the ticker adopts into the log.
const insertPendingRow = `INSERT INTO lifecycle_outbox_pending (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
	VALUES ($1, $2, '2026-01-02T03:04:05.000006Z', 'task:deleted', false, 1, now(), 'w')`

// insertPendingRows writes $3 pending rows into project $1, for tasks $2-1 to $2-$3.
const insertPendingRows = `INSERT INTO lifecycle_outbox_pending (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
	SELECT $1, $2 || '-' || g, '2026-01-02T03:04:05Z', 'task:deleted', false, 1, now(), 'w' FROM pg_catalog.generate_series(1, $3) g`

// numberedEvents lists project's events as read (the frozen stream, then the log as ticked), as
// "sequence=task" in sequence order.
func numberedEvents(t *testing.T, ctx context.Context, db outbox.DBTX, project string) []string {
	t.Helper()
	rows, err := db.Query(ctx, `SELECT sequence || '=' || task_id FROM lifecycle_outbox_read($1, 0, 100000, NULL, NULL, NULL) ORDER BY sequence`, project)
	require.NoError(t, err)
	events, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	return events
}

// ageEvents makes every stored event older by d as retention sees it: the frozen stream's by
// their occurred_at, the log's by the time of the tick that numbered them (retention takes the
// log by whole parts of ticks).
func ageEvents(t *testing.T, ctx context.Context, db outbox.DBTX, d time.Duration) {
	t.Helper()
	for _, stmt := range []string{
		`UPDATE lifecycle_outbox SET occurred_at = occurred_at - $1::interval`,
		`UPDATE lifecycle_tick SET ticked_at = ticked_at - $1::interval`,
	} {
		_, err := db.Exec(ctx, stmt, d)
		require.NoError(t, err, stmt)
	}
}

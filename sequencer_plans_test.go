package outbox_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"fusion/outbox/internal/pgtest"
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

// sequencerCall is a consumer's call: as a holder, announcing what it numbers.
const sequencerCall = `SELECT count(*) FROM lifecycle_outbox_sequence($1::text[], -1000, 'c@0123456789abcdef',
	'1 second'::interval, 'lifecycle_outbox', '1 millisecond'::interval)`

const insertPendingPerProject = `INSERT INTO lifecycle_outbox_pending
	(project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
SELECT p, $2, '2026-01-02T03:04:05Z', 'task:deleted', false, 1, now(), 'w' FROM pg_catalog.unnest($1::text[]) AS p`

// TestSequencerWorkGrowsWithTheProjectsOfACallNotTheirSquare: a consumer observes thousands of
// projects, and after a pause every one of them may have something to number. Schema 10
// matched the projects of a call by nested loops over two lists (5,000 projects with one row
// each: 8.8s a call, measured); now each project is looked up, so four times the projects
// cost about four times the work, where nested loops cost sixteen.
func TestSequencerWorkGrowsWithTheProjectsOfACallNotTheirSquare(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	s := newExplainedSession(t, ctx, pgtest.NewDB(t).URL)
	work := func(n int) float64 {
		projects := make([]string, n)
		for i := range projects {
			projects[i] = fmt.Sprintf("n%d-%d", n, i)
		}
		_, err := s.conn.Exec(ctx, insertPendingPerProject, projects, "t")
		require.NoError(t, err)
		var w float64
		for _, p := range s.plans(t, ctx, sequencerCall, projects) {
			w += p.Plan.work()
		}
		require.Equal(t, n, pgtest.QueryInt(t, s.conn, `SELECT count(*) FROM lifecycle_outbox WHERE project_id LIKE $1`, fmt.Sprintf("n%d-%%", n)),
			"every project's row was numbered")
		return w
	}
	work(10) // the session's plans are made here, as a consumer's are on its first call
	small, large := work(150), work(600)
	t.Logf("plan-node work: %.0f for 150 projects, %.0f for 600", small, large)
	require.Less(t, large, 6*small, "the work grew faster than the number of projects")
}

// TestSequencerMoveKeepsOnePlanWhateverTheBacklog: the move keeps one generic plan per session,
// made when the session first moves rows, possibly before the pending table was ever analyzed.
// Whatever the statistics said then, each call of a drain costs its batch: the batch is taken
// by the pending key in order, and deleted by row address.
func TestSequencerMoveKeepsOnePlanWhateverTheBacklog(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	s := newExplainedSession(t, ctx, pgtest.NewDB(t).URL)
	project := []string{"p"}
	_, err := s.conn.Exec(ctx, insertPendingPerProject, project, "first")
	require.NoError(t, err)
	s.plans(t, ctx, sequencerCall, project) // the plans, made on one pending row
	_, err = s.conn.Exec(ctx, insertPendingRows, "p", "t", 6000)
	require.NoError(t, err)

	var works []float64
	for range 6 {
		var move *explainedPlan
		for _, p := range s.plans(t, ctx, sequencerCall, project) {
			if strings.Contains(p.Query, "DELETE FROM lifecycle_outbox_pending") {
				move = &p
			}
		}
		require.NotNil(t, move, "the call moved rows")
		move.Plan.walk(func(n planNode) {
			require.NotEqual(t, "Bitmap Heap Scan", n.Type, "the batch is taken by the key, in order")
			if n.Relation == "lifecycle_outbox_pending" && n.Type != "ModifyTable" && n.Type != "Index Scan" {
				require.Equal(t, "Tid Scan", n.Type, "the batch is deleted by row address")
			}
		})
		works = append(works, move.Plan.work())
	}
	require.Equal(t, 0, pgtest.QueryInt(t, s.conn, `SELECT count(*) FROM lifecycle_outbox_pending`), "six batches of 1,000 moved the backlog")
	t.Logf("the move's plan-node work per call: %v", works)
	// The first call had 6,000 rows behind its batch and the last none; a plan that read the
	// backlog would cost the first call several times the last.
	require.Less(t, works[0], 1.5*works[len(works)-1], "a call cost more with more rows behind its batch")
}

// TestSequencerCallDoesNotReadTheStreamWhateverItsStatistics: a deployment that installed the
// schema analyzed an empty stream, and a first consumer then drains a large backlog in one
// session, whose plans were made on those statistics. Each call looked for unnumbered rows of
// older writers by a plan that could walk the stream's key from end to end (a 1M backlog in
// one project took 66ms a call for it by the end, measured): the drain's cost grew with the
// square of the backlog. The look is now answered by the partial index of such rows alone.
func TestSequencerCallDoesNotReadTheStreamWhateverItsStatistics(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	s := newExplainedSession(t, ctx, pgtest.NewDB(t).URL)
	_, err := s.conn.Exec(ctx, `VACUUM ANALYZE lifecycle_outbox`)
	require.NoError(t, err)
	project := []string{"p"}
	_, err = s.conn.Exec(ctx, insertPendingPerProject, project, "first")
	require.NoError(t, err)
	s.plans(t, ctx, sequencerCall, project) // the session's plans, made on those statistics
	_, err = s.conn.Exec(ctx, insertPendingRows, "p", "t", 5000)
	require.NoError(t, err)
	for range 5 {
		s.plans(t, ctx, sequencerCall, project)
	}
	require.Equal(t, 5001, pgtest.QueryInt(t, s.conn, `SELECT count(*) FROM lifecycle_outbox WHERE project_id = 'p'`))
	_, err = s.conn.Exec(ctx, insertPendingRows, "p", "u", 1000)
	require.NoError(t, err)

	read := 0.0
	for _, p := range s.plans(t, ctx, sequencerCall, project) {
		p.Plan.walk(func(n planNode) {
			if n.Relation == "lifecycle_outbox" && n.Type != "ModifyTable" {
				read += (n.Rows + n.RemovedByFilter) * n.Loops
			}
		})
	}
	require.Equal(t, 6001, pgtest.QueryInt(t, s.conn, `SELECT count(*) FROM lifecycle_outbox WHERE project_id = 'p'`), "the call numbered its batch")
	require.Less(t, read, 100.0, "the call read the stream's rows, not only the partial index of unnumbered ones")
}

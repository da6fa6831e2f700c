package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"

	"fusion/outbox"
	"fusion/outbox/internal/testhost"
)

// txStamps holds when a delete transaction sent BEGIN and when its COMMIT returned, as seen
// by stampTracer on the context the transaction ran with.
type txStamps struct{ begin, commit time.Time }

type stampKey struct{}

func withStamps(ctx context.Context) (context.Context, *txStamps) {
	s := &txStamps{}
	return context.WithValue(ctx, stampKey{}, s), s
}

// stampTracer timestamps BEGIN and COMMIT of transactions whose context carries txStamps:
// pgx sends both as plain statements on the transaction's context, so the commit instant is
// taken right after the server acknowledged it, before the host's post-commit work. It also
// counts the statements its pool sent (those of a batch one by one), the round trips (a batch is
// one), and among the statements the wake-ups (pg_notify).
type stampTracer struct {
	statements, roundTrips, notifies atomic.Int64
}

// TraceBatchStart counts a batch as one round trip; its statements are counted one by one.
func (t *stampTracer) TraceBatchStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceBatchStartData) context.Context {
	t.roundTrips.Add(1)
	return ctx
}

func (t *stampTracer) TraceBatchQuery(_ context.Context, _ *pgx.Conn, d pgx.TraceBatchQueryData) {
	t.statements.Add(1)
	if strings.Contains(d.SQL, "pg_notify") {
		t.notifies.Add(1)
	}
}

func (*stampTracer) TraceBatchEnd(context.Context, *pgx.Conn, pgx.TraceBatchEndData) {}

func (t *stampTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	t.statements.Add(1)
	t.roundTrips.Add(1)
	if strings.Contains(d.SQL, "pg_notify") {
		t.notifies.Add(1)
	}
	if s, ok := ctx.Value(stampKey{}).(*txStamps); ok && s.begin.IsZero() && strings.HasPrefix(strings.ToLower(d.SQL), "begin") {
		s.begin = time.Now()
	}
	return ctx
}

func (*stampTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	if s, ok := ctx.Value(stampKey{}).(*txStamps); ok && d.Err == nil && s.commit.IsZero() && d.CommandTag.String() == "COMMIT" {
		s.commit = time.Now()
	}
}

// createTasksSQL inserts live tasks "<prefix>-<i>" of @project for i in
// generate_series(@from, @to, @step).
const createTasksSQL = `
INSERT INTO tasks (project_id, id, title)
SELECT @project, @prefix::text || '-' || i, 'task ' || i FROM generate_series(@from::bigint, @to::bigint, @step::bigint) AS i`

func createTasks(ctx context.Context, db outbox.DBTX, project, prefix string, from, to, step int) error {
	if _, err := db.Exec(ctx, createTasksSQL, pgx.StrictNamedArgs{"project": project, "prefix": prefix, "from": from, "to": to,
		"step": step}); err != nil {
		return fmt.Errorf("create tasks: %w", err)
	}
	return nil
}

// backlogEventsSQL inserts task:deleted events of project $1 for tasks "<prefix>-$3" ..
// "<prefix>-$4" into the log, in one transaction, each deleted at its own microsecond.
const backlogEventsSQL = `
INSERT INTO lifecycle_event_log
    (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
SELECT $1, x.t, x.d, 'task:deleted', false, 1, now(), 'bench-prewrite'
FROM generate_series($3::bigint, $4::bigint) AS i,
     LATERAL (SELECT $2::text || '-' || i AS t,
                     timestamptz '2024-01-01 00:00:00+00' + i * interval '1 microsecond' AS d) AS x`

// backlogTickEvents is how many events each tick of a bulk-loaded backlog numbers: about what
// the consumers' ticker finds per tick, at its default floor of 5 ms, behind writers committing
// 20,000 deletes a second.
const backlogTickEvents = 100

// insertBacklog bulk-loads n events into an empty project, numbered 1..n as the ticker leaves a
// stream that it kept up with: a transaction of backlogTickEvents events, then a tick, and so on.
// The log is then vacuumed and analysed, as autovacuum would have done by the time an observer
// restarts onto such a backlog, and a checkpoint writes the load out so that it does not land
// inside the measurement.
func insertBacklog(ctx context.Context, pool *pgxpool.Pool, project, prefix string, n int) error {
	for from := 1; from <= n; from += backlogTickEvents {
		if _, err := pool.Exec(ctx, backlogEventsSQL, project, prefix, from, min(from+backlogTickEvents-1, n)); err != nil {
			return fmt.Errorf("insert backlog: %w", err)
		}
		if _, err := outbox.Tick(ctx, pool); err != nil {
			return fmt.Errorf("number backlog: %w", err)
		}
	}
	return settleBacklog(ctx, pool, `VACUUM ANALYZE lifecycle_event_log, lifecycle_tick_project`)
}

// streamBacklogSQL inserts n task:deleted events of project $1 for tasks "<prefix>-1" ..
// "-n" into the stream frozen at schema 18, numbered 1..n, each deleted at its own
// microsecond and occurred $4 ago.
const streamBacklogSQL = `
INSERT INTO lifecycle_outbox
    (project_id, sequence, event_type, task_id, deleted_at, archived, writer_process_id, payload_version, occurred_at)
SELECT $1, i, 'task:deleted', x.t, x.d, false, 'bench-prewrite', 1, now() - $4::interval
FROM generate_series(1, $3::bigint) AS i,
     LATERAL (SELECT $2::text || '-' || i AS t,
                     timestamptz '2024-01-01 00:00:00+00' + i * interval '1 microsecond' AS d) AS x`

const streamBacklogHeadSQL = `
INSERT INTO lifecycle_outbox_heads (project_id, last_sequence, sequenced_at) VALUES ($1, $2, now())
ON CONFLICT (project_id) DO UPDATE SET last_sequence = excluded.last_sequence, sequenced_at = excluded.sequenced_at`

// insertStreamBacklog bulk-loads n events, occurred age ago, into an empty project's part of
// the stream numbered before schema 18, with its heads row: what a database upgraded from an
// earlier schema holds. Only retention still removes rows from it.
func insertStreamBacklog(ctx context.Context, pool *pgxpool.Pool, project, prefix string, n int, age time.Duration) error {
	if _, err := pool.Exec(ctx, streamBacklogSQL, project, prefix, n, age); err != nil {
		return fmt.Errorf("insert backlog: %w", err)
	}
	if _, err := pool.Exec(ctx, streamBacklogHeadSQL, project, n); err != nil {
		return fmt.Errorf("insert backlog head: %w", err)
	}
	return settleBacklog(ctx, pool, `VACUUM ANALYZE lifecycle_outbox`)
}

// settleBacklog runs vacuum, a VACUUM ANALYZE of the tables loaded, and takes a checkpoint.
func settleBacklog(ctx context.Context, pool *pgxpool.Pool, vacuum string) error {
	if _, err := pool.Exec(ctx, vacuum); err != nil {
		return fmt.Errorf("vacuum backlog: %w", err)
	}
	if _, err := pool.Exec(ctx, "CHECKPOINT"); err != nil {
		return fmt.Errorf("checkpoint backlog: %w", err)
	}
	return nil
}

// newHost builds a reference-host store; withOutbox wires the writer hook, whose post-commit
// NOTIFY is on unless notify is false.
func newHost(pool *pgxpool.Pool, withOutbox, notify bool) (*testhost.Store, *outbox.Writer, error) {
	if !withOutbox {
		return testhost.New(pool, testhost.Options{}), nil, nil
	}
	w, err := outbox.NewWriter(pool, outbox.Config{WriterLabel: "bench", NotifyDisabled: !notify}, moduleLog())
	if err != nil {
		return nil, nil, fmt.Errorf("new writer: %w", err)
	}
	return testhost.New(pool, testhost.Options{Writer: w}), w, nil
}

// closeWriter returns a stop for w, bounded like the bench's other stop paths.
func closeWriter(w *outbox.Writer) func() {
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = w.Close(ctx)
	}
}

// deleteJob is one delete: a task of a project.
type deleteJob struct{ project, task string }

// deleteRun is what a set of writers measured.
type deleteRun struct {
	tx      int64
	errors  int64
	elapsed time.Duration
	calls   []time.Duration // Store.Delete calls, as the host runs them
	txOnly  []time.Duration // BEGIN sent to COMMIT returned
	events  []string        // event IDs recorded, when asked for
	commits []time.Time     // their commit instants
	firstEr error
}

// deleteFunc deletes one task and returns the event ID it recorded ("" without the outbox).
type deleteFunc func(ctx context.Context, j deleteJob) (eventID string, err error)

// hostDelete runs the reference host's Store.Delete, as the host runs it.
func hostDelete(store *testhost.Store) deleteFunc {
	return func(ctx context.Context, j deleteJob) (string, error) {
		res, err := store.Delete(ctx, j.project, j.task)
		if err == nil && !res.Deleted {
			err = fmt.Errorf("task %s/%s was already deleted", j.project, j.task)
		}
		return res.Event.EventID, err
	}
}

// runDeletes runs every job through del on writers goroutines; writer w takes jobs
// w, w+writers, ... so projects spread evenly when jobs cycle through them.
func runDeletes(ctx context.Context, del deleteFunc, writers int, jobs []deleteJob, keepEvents bool) deleteRun {
	type part struct {
		calls, txOnly []time.Duration
		events        []string
		commits       []time.Time
		errs          int64
		first         error
	}
	parts := make([]part, writers)
	var wg sync.WaitGroup
	started := time.Now()
	for w := range writers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			p := &parts[w]
			for i := w; i < len(jobs) && ctx.Err() == nil; i += writers {
				sctx, st := withStamps(ctx)
				t0 := time.Now()
				eventID, err := del(sctx, jobs[i])
				d := time.Since(t0)
				if err != nil {
					p.errs++
					if p.first == nil {
						p.first = err
					}
					continue
				}
				p.calls = append(p.calls, d)
				if !st.begin.IsZero() && !st.commit.IsZero() {
					p.txOnly = append(p.txOnly, st.commit.Sub(st.begin))
				}
				if keepEvents {
					p.events = append(p.events, eventID)
					p.commits = append(p.commits, st.commit)
				}
			}
		}()
	}
	wg.Wait()
	r := deleteRun{elapsed: time.Since(started)}
	for _, p := range parts {
		r.tx += int64(len(p.calls))
		r.errors += p.errs
		r.calls = append(r.calls, p.calls...)
		r.txOnly = append(r.txOnly, p.txOnly...)
		r.events = append(r.events, p.events...)
		r.commits = append(r.commits, p.commits...)
		if r.firstEr == nil {
			r.firstEr = p.first
		}
	}
	return r
}

// consumerSpec describes a consumer to start.
type consumerSpec struct {
	id string
	// pool, when set, is a pool the consumer shares with others of one process (it is not
	// closed with the consumer); otherwise the consumer opens one of its own, as a process would.
	pool      *pgxpool.Pool
	projects  []string
	cfg       outbox.Config
	listeners []outbox.Listener
	live      outbox.LiveTasks
	cache     outbox.TaskCache
	tracer    pgx.QueryTracer // on the consumer's pool; may be nil
}

// runningConsumer is a started consumer with its own pool, as a separate process would have
// (pool nil: it shares one it does not own).
type runningConsumer struct {
	*outbox.Consumer
	pool *pgxpool.Pool
}

func (r *runningConsumer) Close() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_ = r.Stop(ctx)
	if r.pool != nil {
		r.pool.Close()
	}
}

// moduleLogger holds the writers' and consumers' logger: nothing in tests, their warnings on
// stderr in a run (see run), where a failing step, a lock that timed out or a wake-up that was
// not sent explains a stall in the figures. A command line run by a test sets it while other
// tests' cases read it, hence the atomic pointer.
var moduleLogger atomic.Pointer[zap.Logger]

// moduleLog is the logger moduleLogger holds, or one that logs nothing.
func moduleLog() *zap.Logger {
	if l := moduleLogger.Load(); l != nil {
		return l
	}
	return zap.NewNop()
}

func startConsumer(ctx context.Context, db *DB, s consumerSpec) (*runningConsumer, error) {
	pool, owned := s.pool, s.pool == nil
	if owned {
		// Two pool connections at most, plus the hijacked LISTEN connection.
		p, err := db.ConsumerPool(ctx, 4, s.tracer)
		if err != nil {
			return nil, err
		}
		pool = p
	}
	closePool := func() {
		if owned {
			pool.Close()
		}
	}
	c, err := outbox.NewConsumer(outbox.ConsumerOptions{
		ID: outbox.ConsumerID(s.id), Pool: pool, Config: s.cfg, Projects: outbox.StaticProjects(s.projects),
		// A separate process that records no events.
		Dispatcher: outbox.NewDispatcher(outbox.DispatcherOptions{Listeners: s.listeners, Cache: s.cache, NoLocalWriter: true}),
		LiveTasks:  s.live, Cache: s.cache, Logger: moduleLog(),
	})
	if err != nil {
		closePool()
		return nil, fmt.Errorf("new consumer: %w", err)
	}
	if err := c.Start(ctx); err != nil {
		closePool()
		return nil, fmt.Errorf("start consumer: %w", err)
	}
	if !owned {
		pool = nil
	}
	return &runningConsumer{Consumer: c, pool: pool}, nil
}

// waitCursor polls until the consumer's cursor in project is at least seq and returns when
// that was seen; ok is false on timeout.
func waitCursor(ctx context.Context, pool *pgxpool.Pool, consumer, project string, seq int64, timeout time.Duration) (time.Time, bool) {
	deadline := time.Now().Add(timeout)
	for {
		var acked int64
		err := pool.QueryRow(ctx, `SELECT coalesce(last_acked_sequence, -1) FROM lifecycle_consumer_cursors
			WHERE project_id = $1 AND consumer_id = $2`, project, consumer).Scan(&acked)
		now := time.Now()
		if err == nil && acked >= seq {
			return now, true
		}
		if now.After(deadline) || ctx.Err() != nil {
			return now, false
		}
		time.Sleep(500 * time.Microsecond)
	}
}

// waitPositioned waits until each of the consumers ids has a positioned cursor in each of
// its projects (want cursors in all), as the operator's status call reports them.
func waitPositioned(ctx context.Context, admin *outbox.Admin, ids []string, want int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		n := 0
		for _, id := range ids {
			st, err := admin.Status(ctx, outbox.StatusFilter{ConsumerID: id})
			if err != nil {
				return fmt.Errorf("consumer status: %w", err)
			}
			for _, s := range st {
				if s.Cursor != nil {
					n++
				}
			}
		}
		if n >= want {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("only %d of %d cursors positioned after %s", n, want, timeout)
		}
		// The status call reads every cursor: poll a large fleet less often.
		time.Sleep(100*time.Millisecond + time.Duration(want)*50*time.Microsecond)
	}
}

// startConsumers starts one consumer per spec at once (as separate processes starting
// together) and returns them all, or stops those that started when one fails.
func startConsumers(ctx context.Context, db *DB, specs []consumerSpec) ([]*runningConsumer, error) {
	running := make([]*runningConsumer, len(specs))
	errs := make([]error, len(specs))
	var wg sync.WaitGroup
	for i := range specs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			running[i], errs[i] = startConsumer(ctx, db, specs[i])
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		closeConsumers(running)
		return nil, err
	}
	return running, nil
}

// closeConsumers stops the consumers, all at once, as separate processes would stop.
func closeConsumers(cs []*runningConsumer) {
	var wg sync.WaitGroup
	for _, c := range cs {
		if c != nil {
			wg.Add(1)
			go func() { defer wg.Done(); c.Close() }()
		}
	}
	wg.Wait()
}

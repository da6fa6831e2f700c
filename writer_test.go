package outbox_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"
	"golang.org/x/sync/errgroup"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
	"fusion/outbox/internal/testkit"
)

func newWriter(t *testing.T, pool *pgxpool.Pool, cfg outbox.Config) *outbox.Writer {
	t.Helper()
	w, err := outbox.NewWriter(pool, cfg, zaptest.NewLogger(t))
	require.NoError(t, err)
	t.Cleanup(func() { testkit.CloseWriter(t, w) })
	return w
}

// stamp returns a deletedAt with the database's microsecond precision.
func stamp(i int) time.Time {
	return time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC).Add(time.Duration(i) * time.Microsecond)
}

// streamReader plays a consumer's read side: it ticks, then reads on from its cursor through the
// reader function, continuing after the key of the last event it read as the consumer does, and
// checks that every sequence is the cursor plus one.
type streamReader struct {
	pool    *pgxpool.Pool
	cursors map[string]int64
	keys    map[string]streamKey // the key of the event at each cursor
	seen    map[string]int       // event ID -> times read
	order   map[string][]string
}

type streamKey struct {
	txid      *string
	deletedAt *time.Time
	taskID    *string
}

func newStreamReader(pool *pgxpool.Pool) *streamReader {
	return &streamReader{pool: pool, cursors: map[string]int64{}, keys: map[string]streamKey{}, seen: map[string]int{}, order: map[string][]string{}}
}

func (r *streamReader) poll(ctx context.Context, projects []string) error {
	if _, err := outbox.Tick(ctx, r.pool); err != nil {
		return err
	}
	for _, p := range projects {
		for {
			k := r.keys[p]
			rows, err := r.pool.Query(ctx, `SELECT sequence, lifecycle_event_id(task_id, deleted_at), txid::text, deleted_at, task_id
				FROM lifecycle_outbox_read($1, $2, 500, $3::text::xid8, $4, $5)`, p, r.cursors[p], k.txid, k.deletedAt, k.taskID)
			if err != nil {
				return err
			}
			type row struct {
				Seq       int64
				ID        string
				TxID      *string
				DeletedAt time.Time
				TaskID    string
			}
			got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
			if err != nil {
				return err
			}
			for _, e := range got {
				if e.Seq != r.cursors[p]+1 {
					return fmt.Errorf("project %s: read sequence %d after %d: a gap", p, e.Seq, r.cursors[p])
				}
				r.cursors[p] = e.Seq
				r.keys[p] = streamKey{e.TxID, &e.DeletedAt, &e.TaskID}
				r.seen[e.ID]++
				r.order[p] = append(r.order[p], e.ID)
			}
			if len(got) < 500 {
				break
			}
		}
	}
	return nil
}

func TestOutOfOrderCommitsAreReadWithoutGaps(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	w := newWriter(t, pool, outbox.Config{NotifyDisabled: true})
	reader := newStreamReader(pool)
	projects := []string{"p1"}

	const n = 8
	const rolledBack = 3
	txs := make([]pgx.Tx, n)
	ids := make([]string, n)
	for i := range n {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
		ev, inserted, err := w.RecordTaskDeletedTx(ctx, tx, outbox.TaskDeletion{ProjectID: "p1", TaskID: fmt.Sprintf("t%d", i), DeletedAt: stamp(i)})
		require.NoError(t, err)
		require.True(t, inserted)
		txs[i], ids[i] = tx, ev.EventID
	}
	// Nothing committed: the reader sees nothing, but it must not move past the open rows.
	require.NoError(t, reader.poll(ctx, projects))
	require.Empty(t, reader.seen)

	var committed []string
	for i := n - 1; i >= 0; i-- { // the newest insert commits first
		if i == rolledBack {
			require.NoError(t, txs[i].Rollback(ctx))
		} else {
			require.NoError(t, txs[i].Commit(ctx))
			committed = append(committed, ids[i])
		}
		require.NoError(t, reader.poll(ctx, projects))
		require.Len(t, reader.seen, len(committed), "after transaction %d ends", i)
	}
	require.Equal(t, committed, reader.order["p1"], "read in commit order, which is sequence order")
	for id, times := range reader.seen {
		require.Equal(t, 1, times, id)
	}
	var head int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT last_sequence FROM lifecycle_outbox_head WHERE project_id = 'p1'`).Scan(&head))
	require.EqualValues(t, n-1, head, "the rolled-back event took no sequence")
}

func TestConcurrentWritersAndReaderAgree(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		projects int
		perProc  int
	}{
		{"one project", 1, 500},
		{"eight projects", 8, 250},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := testkit.Ctx(t)
			pool := pgtest.NewPool(t)
			w := newWriter(t, pool, outbox.Config{NotifyDisabled: true})
			projects := make([]string, tc.projects)
			for i := range projects {
				projects[i] = fmt.Sprintf("proj-%d", i)
			}
			const writers = 16

			var mu sync.Mutex
			committed := map[string]bool{}
			writerGroup, wctx := errgroup.WithContext(ctx)
			for g := range writers {
				writerGroup.Go(func() error {
					for i := range tc.perProc {
						tx, err := pool.Begin(wctx)
						if err != nil {
							return err
						}
						ev, _, err := w.RecordTaskDeletedTx(wctx, tx, outbox.TaskDeletion{
							ProjectID: projects[(g+i)%len(projects)], TaskID: fmt.Sprintf("g%d-t%d", g, i), DeletedAt: stamp(i),
						})
						if err != nil {
							_ = tx.Rollback(wctx)
							return err
						}
						if i%7 == 3 { // some deletes roll back
							if err := tx.Rollback(wctx); err != nil {
								return err
							}
							continue
						}
						if err := tx.Commit(wctx); err != nil {
							return err
						}
						mu.Lock()
						committed[ev.EventID] = true
						mu.Unlock()
					}
					return nil
				})
			}
			// The reader runs throughout, racing the writers.
			reader := newStreamReader(pgtest.Pool(t, pool.Config().ConnString()))
			done := make(chan error, 1)
			go func() { done <- writerGroup.Wait() }()
			var writeErr error
		loop:
			for {
				require.NoError(t, reader.poll(ctx, projects))
				select {
				case writeErr = <-done:
					break loop
				default:
				}
			}
			require.NoError(t, writeErr)
			require.NoError(t, reader.poll(ctx, projects)) // the tail committed after the last poll

			require.Len(t, reader.seen, len(committed))
			for id, times := range reader.seen {
				require.True(t, committed[id], "read an event that never committed: %s", id)
				require.Equal(t, 1, times, "read twice: %s", id)
			}
		})
	}
}

// TestCompetingTickersNeverDuplicateOrSkip: two tickers (two processes) tick while writers
// commit; every committed event is numbered once, 1 to n with none skipped, and each tick's
// count of the project starts where the one before ended.
func TestCompetingTickersNeverDuplicateOrSkip(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	w := newWriter(t, pool, outbox.Config{NotifyDisabled: true})

	const events = 3000
	var g errgroup.Group
	for s := range 4 { // four writers, each committing small batches
		g.Go(func() error {
			for i := s; i < events; i += 4 {
				tx, err := pool.Begin(ctx)
				if err != nil {
					return err
				}
				if _, _, err := w.RecordTaskDeletedTx(ctx, tx, outbox.TaskDeletion{ProjectID: "p", TaskID: fmt.Sprintf("t%d", i), DeletedAt: stamp(i)}); err != nil {
					return err
				}
				if err := tx.Commit(ctx); err != nil {
					return err
				}
			}
			return nil
		})
	}
	// Two tickers on their own pools (two processes).
	stop := make(chan struct{})
	var tickGroup errgroup.Group
	for range 2 {
		other := pgtest.Pool(t, db.URL)
		tickGroup.Go(func() error {
			for {
				if _, err := outbox.Tick(ctx, other); err != nil {
					return err
				}
				select {
				case <-stop:
					return nil
				default:
				}
			}
		})
	}
	require.NoError(t, g.Wait())
	close(stop)
	require.NoError(t, tickGroup.Wait())
	_, err := outbox.Tick(ctx, pool)
	require.NoError(t, err)

	var count, distinct, minSeq, maxSeq int64
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT sequence), coalesce(min(sequence), 0), coalesce(max(sequence), 0)
		FROM lifecycle_outbox_read('p', 0, 100000, NULL, NULL, NULL)`).Scan(&count, &distinct, &minSeq, &maxSeq))
	require.EqualValues(t, events, count, "every event numbered")
	require.Equal(t, count, distinct, "no sequence assigned twice")
	require.Equal(t, []int64{1, count}, []int64{minSeq, maxSeq}, "1..n with none skipped")
	require.Equal(t, events, pgtest.QueryInt(t, pool, `SELECT count(DISTINCT task_id) FROM lifecycle_outbox_read('p', 0, 100000, NULL, NULL, NULL)`),
		"each event once")
	require.Equal(t, events, pgtest.QueryInt(t, pool, `SELECT last_sequence::int FROM lifecycle_outbox_head WHERE project_id = 'p'`))
	require.Zero(t, pgtest.QueryInt(t, pool, `
		SELECT count(*) FROM (
		    SELECT first_sequence, lag(first_sequence + events) OVER (ORDER BY first_sequence) AS expected
		    FROM lifecycle_tick_project WHERE project_id = 'p') x
		WHERE first_sequence <> coalesce(expected, 1)`), "each tick's count starts where the last one ended")
}

// hostWithOutbox is a reference host wired with the writer hook.
func hostWithOutbox(t *testing.T, pool *pgxpool.Pool) (*testhost.Store, *outbox.Writer) {
	w := newWriter(t, pool, outbox.Config{})
	return testhost.New(pool, testhost.Options{Writer: w, Logger: zaptest.NewLogger(t)}), w
}

func TestFirstDeletionOnlyAndAtomicity(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	store, w := hostWithOutbox(t, pool)

	_, err := store.Create(ctx, "p1", "t1", "first", "doing")
	require.NoError(t, err)
	res, err := store.Delete(ctx, "p1", "t1")
	require.NoError(t, err)
	require.True(t, res.Deleted)
	require.True(t, res.EventRecorded)
	require.Equal(t, outbox.TaskDeletedEventID("t1", *res.Task.DeletedAt), res.Event.EventID)
	require.Equal(t, w.ProcessID(), res.Event.WriterProcessID)
	require.Equal(t, "doing", res.Event.PriorColumn)

	t.Run("re-delete writes nothing", func(t *testing.T) {
		again, err := store.Delete(ctx, "p1", "t1")
		require.NoError(t, err)
		require.False(t, again.Deleted)
		require.Equal(t, 1, pgtest.QueryInt(t, pool, `SELECT count(*) FROM lifecycle_event_log WHERE task_id = 't1'`))
		require.Equal(t, 1, pgtest.QueryInt(t, pool, `SELECT count(*) FROM run_audit WHERE task_id = 't1' AND action = 'task:deleted'`))
	})

	t.Run("the hook called twice for one deletion inserts once", func(t *testing.T) {
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		ev, inserted, err := w.RecordTaskDeletedTx(ctx, tx, outbox.TaskDeletion{ProjectID: "p1", TaskID: "t1", DeletedAt: *res.Task.DeletedAt})
		require.NoError(t, err)
		require.False(t, inserted)
		require.Equal(t, res.Event.EventID, ev.EventID)
		require.Equal(t, res.Event.OccurredAt, ev.OccurredAt, "returns the stored event")
	})

	t.Run("concurrent deletes of one task produce one event", func(t *testing.T) {
		_, err := store.Create(ctx, "p1", "t2", "raced", "todo")
		require.NoError(t, err)
		other, _ := hostWithOutbox(t, pgtest.Pool(t, pool.Config().ConnString()))
		var g errgroup.Group
		results := make([]testhost.DeleteResult, 8)
		for i := range results {
			s := store
			if i%2 == 1 {
				s = other
			}
			g.Go(func() (err error) { results[i], err = s.Delete(ctx, "p1", "t2"); return err })
		}
		require.NoError(t, g.Wait())
		deleted := 0
		for _, r := range results {
			if r.Deleted {
				deleted++
			}
		}
		require.Equal(t, 1, deleted)
		require.Equal(t, 1, pgtest.QueryInt(t, pool, `SELECT count(*) FROM lifecycle_event_log WHERE task_id = 't2'`))
		require.Equal(t, 1, pgtest.QueryInt(t, pool, `SELECT count(*) FROM run_audit WHERE task_id = 't2'`))
	})

	t.Run("a rolled-back delete leaves nothing", func(t *testing.T) {
		_, err := store.Create(ctx, "p1", "t3", "kept", "todo")
		require.NoError(t, err)
		tx, err := pool.Begin(ctx)
		require.NoError(t, err)
		var deletedAt time.Time
		require.NoError(t, tx.QueryRow(ctx, `UPDATE tasks SET deleted_at = now() WHERE project_id = 'p1' AND id = 't3' RETURNING deleted_at`).Scan(&deletedAt))
		_, inserted, err := w.RecordTaskDeletedTx(ctx, tx, outbox.TaskDeletion{ProjectID: "p1", TaskID: "t3", DeletedAt: deletedAt})
		require.NoError(t, err)
		require.True(t, inserted)
		require.NoError(t, tx.Rollback(ctx))
		require.Zero(t, pgtest.QueryInt(t, pool, `SELECT count(*) FROM lifecycle_event_log WHERE task_id = 't3'`))
		task, err := store.Get(ctx, "p1", "t3")
		require.NoError(t, err)
		require.Nil(t, task.DeletedAt)
	})

	t.Run("an archived task's delete keeps the pre-delete snapshot", func(t *testing.T) {
		_, err := store.Create(ctx, "p1", "t4", "old", "done")
		require.NoError(t, err)
		_, err = store.Archive(ctx, "p1", "t4")
		require.NoError(t, err)
		require.Zero(t, pgtest.QueryInt(t, pool, `SELECT count(*) FROM lifecycle_event_log WHERE task_id = 't4'`), "archiving is not a deletion")
		res, err := store.Delete(ctx, "p1", "t4")
		require.NoError(t, err)
		require.True(t, res.Event.Archived)
		require.Equal(t, "done", res.Event.PriorColumn)
		var archived bool
		var prior string
		require.NoError(t, pool.QueryRow(ctx, `SELECT archived, prior_column FROM lifecycle_event_log WHERE task_id = 't4'`).Scan(&archived, &prior))
		require.True(t, archived)
		require.Equal(t, "done", prior)
		require.Equal(t, 1, pgtest.QueryInt(t, pool, `SELECT count(*) FROM lifecycle_event_log WHERE task_id = 't4'`))
	})
}

func TestWriterRefusesObservedContextAndBadInput(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	w := newWriter(t, pool, outbox.Config{})
	good := outbox.TaskDeletion{ProjectID: "p1", TaskID: "t1", DeletedAt: stamp(1)}

	tx, err := pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()

	observed := outbox.WithObserved(ctx, outbox.Observed{ConsumerID: "dash", EventID: "x"})
	_, _, err = w.RecordTaskDeletedTx(observed, tx, good)
	require.ErrorIs(t, err, outbox.ErrObservedContext)
	var fence *outbox.FenceError
	require.ErrorAs(t, err, &fence)
	require.Equal(t, "record task:deleted", fence.Operation)

	_, _, err = w.RecordTaskDeletedTx(ctx, nil, good)
	require.ErrorContains(t, err, "nil transaction")

	for name, d := range map[string]outbox.TaskDeletion{
		"ProjectID":   {ProjectID: "", TaskID: "t", DeletedAt: stamp(1)},
		"ProjectID ":  {ProjectID: "has space", TaskID: "t", DeletedAt: stamp(1)},
		"ProjectID  ": {ProjectID: strings.Repeat("p", 129), TaskID: "t", DeletedAt: stamp(1)},
		"TaskID":      {ProjectID: "p", TaskID: "", DeletedAt: stamp(1)},
		"TaskID ":     {ProjectID: "p", TaskID: strings.Repeat("t", 257), DeletedAt: stamp(1)},
		"TaskID  ":    {ProjectID: "p", TaskID: "t\n1", DeletedAt: stamp(1)},
		"DeletedAt":   {ProjectID: "p", TaskID: "t"},
		"DeletedAt ":  {ProjectID: "p", TaskID: "t", DeletedAt: stamp(1).Add(1)},
		"PriorColumn": {ProjectID: "p", TaskID: "t", DeletedAt: stamp(1), PriorColumn: strings.Repeat("c", 129)},
	} {
		_, _, err := w.RecordTaskDeletedTx(ctx, tx, d)
		var verr *outbox.ValidationError
		require.ErrorAs(t, err, &verr, name)
		require.Equal(t, "TaskDeletion."+strings.TrimSpace(name), verr.Field)
	}
	require.NoError(t, tx.Commit(ctx))
	require.Zero(t, pgtest.QueryInt(t, pool, `SELECT count(*) FROM lifecycle_event_log`), "nothing was written")
}

func TestWriterNotifiesAfterCommitCoalescedPerProject(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	store, w := hostWithOutbox(t, pool)

	listener, err := pgx.Connect(ctx, db.URL)
	require.NoError(t, err)
	defer listener.Close(ctx)
	_, err = listener.Exec(ctx, `LISTEN lifecycle_outbox`)
	require.NoError(t, err)

	ids, err := store.CreateMany(ctx, "proj-n", "t", 20)
	require.NoError(t, err)
	for _, id := range ids {
		_, err := store.Delete(ctx, "proj-n", id)
		require.NoError(t, err)
	}
	require.NoError(t, w.Close(ctx)) // every wake-up in flight has been sent

	got := 0
	for _, n := range receivedNotifications(t, ctx, listener) {
		require.Equal(t, "proj-n", n.Payload, "the payload names the project only")
		got++
	}
	require.GreaterOrEqual(t, got, 1)
	require.LessOrEqual(t, got, len(ids), "at most one per commit, fewer when coalesced")
}

func TestDisabledWriterRecordsNothing(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	w := newWriter(t, pool, outbox.Config{Disabled: true})
	store := testhost.New(pool, testhost.Options{Writer: w})
	_, err := store.Create(ctx, "p", "t", "x", "")
	require.NoError(t, err)
	res, err := store.Delete(ctx, "p", "t")
	require.NoError(t, err)
	require.True(t, res.Deleted)
	require.False(t, res.EventRecorded)
	require.Zero(t, pgtest.QueryInt(t, pool, `SELECT count(*) FROM lifecycle_event_log`))
	require.Equal(t, 1, pgtest.QueryInt(t, pool, `SELECT count(*) FROM run_audit`), "the host's own delete path is unchanged")
}

// receivedNotifications returns the notifications on lifecycle_outbox that listener received
// from others, up to the moment of the call: it sends a marker after them, and notifications
// come in commit order, so all of them come before the marker however slowly a busy machine
// delivers them.
func receivedNotifications(t *testing.T, ctx context.Context, listener *pgx.Conn) []*pgconn.Notification {
	t.Helper()
	const marker = "end-of-received-notifications"
	_, err := listener.Exec(ctx, `SELECT pg_notify('lifecycle_outbox', $1)`, marker)
	require.NoError(t, err)
	own := listener.PgConn().PID()
	var out []*pgconn.Notification
	for {
		n, err := listener.WaitForNotification(ctx)
		require.NoError(t, err)
		if n.PID == own && n.Payload == marker {
			return out
		}
		out = append(out, n)
	}
}

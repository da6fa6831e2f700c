package outbox

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"
	"unicode"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"

	"fusion/outbox/startstop"
)

// TaskDeletion is what the host's delete transaction tells the writer hook.
type TaskDeletion struct {
	ProjectID string
	TaskID    string
	// DeletedAt is the value the database stored, read back in the same transaction (for
	// example with RETURNING deleted_at). It must have microsecond precision, as PostgreSQL
	// stores it, because the event identity is derived from it.
	DeletedAt time.Time
	// PriorColumn is the task's column or status just before the delete.
	PriorColumn string
	// Archived says whether the task was archived when it was deleted.
	Archived bool
}

// Writer is the transactional writer hook. It is safe for concurrent use.
//
// Its only cost inside the delete transaction is one insert into lifecycle_event_log, which is
// never updated afterwards: no lock that another delete waits on, no NOTIFY (which would
// serialise commits database-wide on the notification queue lock). After commit the host calls
// Committed, and the writer sends one coalesced hint per project from outside any delete
// transaction; the ticker, which numbers what committed, takes its next tick on it.
type Writer struct {
	processID string
	disabled  bool
	notify    *notifier // nil when notifications are off or the module is disabled
	clock     Clock
	log       *zap.Logger
	trace     tracing
}

// NewWriter builds a writer from cfg (defaults applied, then validated), for a host that
// builds the parts one by one; New builds its writer from the Config it validated already. db
// is used only for post-commit notifications and may be nil when cfg.NotifyDisabled is set.
func NewWriter(db DBTX, cfg Config, log *zap.Logger) (*Writer, error) {
	cfg, err := validConfig(cfg)
	if err != nil {
		return nil, err
	}
	if err := checkPooledDB(cfg, db); err != nil {
		return nil, err
	}
	return newWriter(db, cfg.writerOptions(), log)
}

// writerOptions are what the writer takes from a validated Config.
type writerOptions struct {
	label    string        // Config.WriterLabel
	disabled bool          // Config.Disabled: record nothing
	notify   bool          // neither Config.Disabled nor Config.NotifyDisabled
	channel  string        // Config.NotifyChannel
	gap      time.Duration // Config.NotifyGap
	clock    Clock
	tracer   trace.TracerProvider
}

func (c Config) writerOptions() writerOptions {
	return writerOptions{label: c.WriterLabel, disabled: c.Disabled, notify: !c.Disabled && !c.NotifyDisabled,
		channel: c.NotifyChannel, gap: c.NotifyGap, clock: c.Clock, tracer: c.TracerProvider}
}

// newWriter builds a writer from options a validated Config gave (see NewWriter).
func newWriter(db DBTX, opts writerOptions, log *zap.Logger) (*Writer, error) {
	if log == nil {
		log = zap.NewNop()
	}
	id, err := newWriterProcessID(opts.label)
	if err != nil {
		return nil, err
	}
	w := &Writer{processID: id, disabled: opts.disabled, clock: opts.clock, log: log.Named("outbox.writer"), trace: newTracing(opts.tracer)}
	if opts.notify {
		if db == nil {
			return nil, errors.New("outbox writer: a database is needed for notifications (or set NotifyDisabled)")
		}
		n, err := newNotifier(db, opts.channel, opts.gap, w.log)
		if err != nil {
			return nil, err
		}
		w.notify = n
	}
	return w, nil
}

// ProcessID is this boot's writer process ID, stamped on every event it records.
func (w *Writer) ProcessID() string { return w.processID }

// insertEventSQL records a task:deleted event (the arguments are insertArgs), occurred at the
// time of the clock shifted by @clock_offset; insertTracedEventSQL is the same insert with
// the event's trace context.
const insertEventSQL = `
INSERT INTO lifecycle_event_log
    (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id, prior_column)
VALUES (@project, @task_id, @deleted_at, 'task:deleted', @archived, @payload_version, pg_catalog.now() + @clock_offset::interval,
        @writer_process_id, @prior_column)
ON CONFLICT (project_id, task_id, deleted_at) DO NOTHING
RETURNING occurred_at`

// selectEventByIDSQL reads a recorded event back wherever it is: in the log (its sequence is
// known only when read, so 0 here), pending from a writer of schema 16 or earlier (0), or
// numbered in the stream of before schema 18.
const selectEventByIDSQL = `
SELECT writer_process_id::text, occurred_at::timestamptz, 0::bigint
FROM lifecycle_event_log WHERE project_id = $1 AND task_id = $2 AND deleted_at = $3
UNION ALL
SELECT writer_process_id::text, occurred_at::timestamptz, 0::bigint
FROM lifecycle_outbox_pending WHERE project_id = $1 AND task_id = $2 AND deleted_at = $3
UNION ALL
SELECT writer_process_id, occurred_at, coalesce(sequence, 0)
FROM lifecycle_outbox WHERE project_id = $1 AND task_id = $2 AND deleted_at = $3
LIMIT 1`

// RecordTaskDeletedTx records the first deletion of a task inside the caller's delete
// transaction, so that the delete and its event commit or roll back together. It returns the
// event and whether this call inserted it: a second call for the same deletion (same task,
// same stored deletedAt) inserts nothing and returns the stored event. Called from an observed
// context it refuses with a *FenceError and writes nothing. QueueTaskDeleted is the same hook
// for a host that sends its statements in one batch.
func (w *Writer) RecordTaskDeletedTx(ctx context.Context, tx pgx.Tx, d TaskDeletion) (Event, bool, error) {
	if err := RefuseObserved(ctx, "record "+EventTypeTaskDeleted); err != nil {
		return Event{}, false, err
	}
	if tx == nil {
		return Event{}, false, errors.New("record task:deleted: nil transaction: the hook must run inside the delete transaction")
	}
	ev, prior, err := w.prepare(ctx, d)
	if err != nil || w.disabled {
		return ev, false, err
	}
	if w.trace.tracer != nil {
		err = w.insertTraced(ctx, tx, &ev, prior) // tracing.go
	} else {
		err = tx.QueryRow(ctx, insertEventSQL, w.insertArgs(ev, prior)).Scan(&ev.OccurredAt)
	}
	if err == nil {
		return ev, true, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return Event{}, false, fmt.Errorf("record task:deleted: %w", err)
	}
	return readRecorded(ctx, tx, ev)
}

// prepare refuses an observed context, validates d and builds its event.
func (w *Writer) prepare(ctx context.Context, d TaskDeletion) (Event, *string, error) {
	if err := RefuseObserved(ctx, "record "+EventTypeTaskDeleted); err != nil {
		return Event{}, nil, err
	}
	if err := d.validate(); err != nil {
		return Event{}, nil, fmt.Errorf("record task:deleted: %w", err)
	}
	ev := Event{
		ProjectID:       d.ProjectID,
		EventID:         TaskDeletedEventID(d.TaskID, d.DeletedAt),
		EventType:       EventTypeTaskDeleted,
		TaskID:          d.TaskID,
		DeletedAt:       d.DeletedAt.UTC(),
		PriorColumn:     d.PriorColumn,
		Archived:        d.Archived,
		WriterProcessID: w.processID,
		PayloadVersion:  PayloadVersion,
	}
	var prior *string
	if d.PriorColumn != "" {
		prior = &d.PriorColumn
	}
	return ev, prior, nil
}

// insertArgs are insertEventSQL's arguments for ev; insertTracedEventSQL takes trace_context
// too.
func (w *Writer) insertArgs(ev Event, prior *string) pgx.StrictNamedArgs {
	return pgx.StrictNamedArgs{"project": ev.ProjectID, "task_id": ev.TaskID, "deleted_at": ev.DeletedAt, "archived": ev.Archived,
		"payload_version": ev.PayloadVersion, "clock_offset": w.clock.Offset(), "writer_process_id": ev.WriterProcessID,
		"prior_column": prior}
}

// readRecorded returns the stored event of a deletion recorded before.
func readRecorded(ctx context.Context, tx pgx.Tx, ev Event) (Event, bool, error) {
	if err := tx.QueryRow(ctx, selectEventByIDSQL, ev.ProjectID, ev.TaskID, ev.DeletedAt).
		Scan(&ev.WriterProcessID, &ev.OccurredAt, &ev.Sequence); err != nil {
		return Event{}, false, fmt.Errorf("read recorded task:deleted: %w", err)
	}
	return ev, false, nil
}

func (d TaskDeletion) validate() error {
	if err := ValidateProjectID(d.ProjectID); err != nil {
		return invalid("TaskDeletion.ProjectID", "%v", err)
	}
	if err := validateTaskID("TaskDeletion.TaskID", d.TaskID); err != nil {
		return err
	}
	if d.DeletedAt.IsZero() {
		return invalid("TaskDeletion.DeletedAt", "is zero: pass the deleted_at value the database stored")
	}
	if d.DeletedAt.Nanosecond()%1000 != 0 {
		return invalid("TaskDeletion.DeletedAt", "%s has sub-microsecond precision: pass the value the database stored, not a client clock reading", d.DeletedAt.Format(time.RFC3339Nano))
	}
	if y := d.DeletedAt.UTC().Year(); y < 1 || y > 9999 {
		return invalid("TaskDeletion.DeletedAt", "year %d is out of range", y)
	}
	if len(d.PriorColumn) > 128 || strings.IndexFunc(d.PriorColumn, unicode.IsControl) >= 0 {
		return invalid("TaskDeletion.PriorColumn", "must be at most 128 bytes without control characters")
	}
	return nil
}

// Committed tells the writer that a transaction holding events of these projects committed.
// It never blocks: the wake-up is sent in the background, coalesced per project, and a lost
// one only costs consumers one poll interval. After Close it sends nothing.
func (w *Writer) Committed(projectIDs ...string) {
	if w.notify != nil {
		w.notify.enqueue(projectIDs)
	}
}

// Close waits for the wake-ups in flight to be sent, bounded by ctx: when ctx ends first it
// cancels them and returns ctx's error (consumers then find those events on their next poll).
// The writer hook keeps recording events after Close; only their wake-ups are no longer sent.
func (w *Writer) Close(ctx context.Context) error {
	if w.notify == nil {
		return nil
	}
	return w.notify.close(ctx)
}

// notifier sends post-commit wake-ups. The first commit after a quiet spell is announced at
// once; commits that arrive within gap of the last notification, or while one is being sent,
// are gathered and announced together by the same goroutine, one notification per project.
// No goroutine runs while nothing is pending.
//
// Its lifecycle is one startstop run, from NewWriter to Close: Close stops it (enqueue takes
// nothing from then on), and the run finishes once the flush in flight has sent what was
// pending.
type notifier struct {
	db      DBTX
	channel string
	gap     time.Duration
	log     *zap.Logger

	lifecycle startstop.Base
	run       *startstop.Run

	// base is the parent of every notification's context. Close cancels it, which abandons
	// the notifications in flight when Close's own context ends before they are sent.
	base   context.Context
	cancel context.CancelFunc

	mu       sync.Mutex
	pending  map[string]struct{}
	flushing bool // a flush goroutine runs: it takes what is pending
	lastSent time.Time
	wg       sync.WaitGroup // the flush goroutine
}

// newNotifier begins the notifier's run; Close (close) stops it.
func newNotifier(db DBTX, channel string, gap time.Duration, log *zap.Logger) (*notifier, error) {
	n := &notifier{db: db, channel: channel, gap: gap, log: log, pending: map[string]struct{}{}}
	run, err := n.lifecycle.Begin()
	if err != nil {
		return nil, err // not reached: a new base always begins
	}
	n.run = run
	n.base, n.cancel = context.WithCancel(context.Background())
	// Once Stop cancels the run, no enqueue starts a flush (each checks under mu): the run
	// finishes when the flush goroutine, if one runs, has sent what is pending. AfterFunc
	// starts no goroutine before then.
	context.AfterFunc(run.Ctx, func() {
		n.mu.Lock()
		flushing := n.flushing
		n.mu.Unlock()
		if flushing {
			n.wg.Wait()
		}
		run.Finished()
	})
	return n, nil
}

// notifySQL sends the wake-ups in a transaction of their own that does not wait for its commit
// record to reach disk: a notifying transaction gets a transaction ID and a commit record, and
// a hint has no need to be durable, so it should not add a WAL flush beside the deletes.
const notifySQL = `SELECT pg_catalog.set_config('synchronous_commit', 'off', true), pg_catalog.pg_notify($1, p) FROM pg_catalog.unnest($2::text[]) AS p`

func (n *notifier) enqueue(projects []string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.run.Stopping() {
		return
	}
	for _, p := range projects {
		n.pending[p] = struct{}{}
	}
	if n.flushing || len(n.pending) == 0 {
		return
	}
	n.flushing = true
	n.wg.Add(1)
	go n.flush()
}

func (n *notifier) flush() {
	defer n.wg.Done()
	for {
		n.mu.Lock()
		if len(n.pending) == 0 || n.base.Err() != nil {
			clear(n.pending) // abandoned by Close: consumers poll for these
			n.flushing = false
			n.mu.Unlock()
			return
		}
		if wait := time.Until(n.lastSent.Add(n.gap)); wait > 0 {
			n.mu.Unlock()
			t := time.NewTimer(wait) // commits meanwhile join this notification
			select {
			case <-t.C:
			case <-n.base.Done():
				t.Stop()
			}
			continue
		}
		batch := make([]string, 0, len(n.pending))
		for p := range n.pending {
			batch = append(batch, p)
		}
		clear(n.pending)
		n.lastSent = time.Now()
		n.mu.Unlock()

		ctx, cancel := context.WithTimeout(n.base, 5*time.Second)
		if _, err := n.db.Exec(ctx, notifySQL, n.channel, batch); err != nil {
			n.log.Warn("wake-up notification not sent; consumers will find the events on their next poll",
				zap.Strings("projects", batch), zap.Error(err))
		}
		cancel()
	}
}

// close refuses further wake-ups and waits for those in flight, bounded by ctx; when ctx
// ends first, the ones in flight are abandoned.
func (n *notifier) close(ctx context.Context) error {
	defer n.cancel()
	if err := n.lifecycle.Stop(ctx); err != nil {
		return fmt.Errorf("close writer: %w", err)
	}
	return nil
}

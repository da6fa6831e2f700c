// Package taskstore is the reference host: a small but real task store on PostgreSQL that plays
// the part of an existing host process. It owns its tables (tasks, run_audit, mailbox_notices,
// settings), its delete path with the writer-owned side effects (one task:deleted audit row in
// the delete transaction, a best-effort mailbox notice after commit) and a process-local event
// emitter. The outbox module is wired into it the way a real host would wire it; tests, the demo
// and the benchmarks all use it.
package taskstore

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"

	"fusion/outbox"
)

// ErrTaskNotFound is returned for a task that does not exist in the project.
var ErrTaskNotFound = errors.New("task not found")

// Task is a row of the tasks table.
type Task struct {
	ProjectID  string
	ID         string
	Title      string
	Column     string
	Archived   bool
	ArchivedAt *time.Time
	DeletedAt  *time.Time
}

// Options configure a Store.
type Options struct {
	// Writer is the outbox writer hook; nil runs the store without the outbox, as it was
	// before the module existed.
	Writer *outbox.Writer
	// Cache is the process's live-task cache; nil gives the store a new empty one.
	Cache *Cache
	// Logger defaults to a no-op logger.
	Logger *zap.Logger
	// Actor names this process in its audit rows. Defaults to "taskstore".
	Actor string
}

// Store is the reference task store.
type Store struct {
	pool    *pgxpool.Pool
	writer  *outbox.Writer
	cache   *Cache
	emitter *Emitter
	log     *zap.Logger
	actor   string
}

// New returns a store on pool.
func New(pool *pgxpool.Pool, opts Options) *Store {
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	if opts.Cache == nil {
		opts.Cache = NewCache()
	}
	if opts.Actor == "" {
		opts.Actor = "taskstore"
	}
	return &Store{pool: pool, writer: opts.Writer, cache: opts.Cache, emitter: &Emitter{},
		log: opts.Logger.Named("taskstore"), actor: opts.Actor}
}

// Emitter is the store's process-local event emitter: only this process's listeners hear it.
func (s *Store) Emitter() *Emitter { return s.emitter }

// Cache is the store's live-task cache.
func (s *Store) Cache() *Cache { return s.cache }

// Pool is the store's database pool.
func (s *Store) Pool() *pgxpool.Pool { return s.pool }

// Create inserts a live task.
func (s *Store) Create(ctx context.Context, projectID, id, title, column string) (Task, error) {
	if column == "" {
		column = "todo"
	}
	_, err := s.pool.Exec(ctx, `INSERT INTO tasks (project_id, id, title, "column") VALUES ($1, $2, $3, $4)`,
		projectID, id, title, column)
	if err != nil {
		return Task{}, fmt.Errorf("create task: %w", err)
	}
	s.cache.add(projectID, id)
	return Task{ProjectID: projectID, ID: id, Title: title, Column: column}, nil
}

// CreateMany inserts n live tasks named prefix-1 ... prefix-n in one statement.
func (s *Store) CreateMany(ctx context.Context, projectID, prefix string, n int) ([]string, error) {
	rows, err := s.pool.Query(ctx, `INSERT INTO tasks (project_id, id, title)
		SELECT $1, $2 || '-' || i, 'task ' || i FROM generate_series(1, $3) AS i RETURNING id`, projectID, prefix, n)
	if err != nil {
		return nil, fmt.Errorf("create tasks: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("create tasks: %w", err)
	}
	for _, id := range ids {
		s.cache.add(projectID, id)
	}
	return ids, nil
}

// Get reads one task, deleted or not.
func (s *Store) Get(ctx context.Context, projectID, id string) (Task, error) {
	return getTask(ctx, s.pool, projectID, id)
}

func getTask(ctx context.Context, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, projectID, id string) (Task, error) {
	t := Task{ProjectID: projectID, ID: id}
	err := db.QueryRow(ctx, `SELECT title, "column", archived, archived_at, deleted_at FROM tasks WHERE project_id = $1 AND id = $2`,
		projectID, id).Scan(&t.Title, &t.Column, &t.Archived, &t.ArchivedAt, &t.DeletedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return Task{}, ErrTaskNotFound
	}
	if err != nil {
		return Task{}, fmt.Errorf("get task: %w", err)
	}
	return t, nil
}

// Archive moves a live task to the archive. It is not a deletion and records no event.
func (s *Store) Archive(ctx context.Context, projectID, id string) (Task, error) {
	tag, err := s.pool.Exec(ctx, `UPDATE tasks SET archived = true, archived_at = now(), updated_at = now()
		WHERE project_id = $1 AND id = $2 AND deleted_at IS NULL AND NOT archived`, projectID, id)
	if err != nil {
		return Task{}, fmt.Errorf("archive task: %w", err)
	}
	if tag.RowsAffected() == 0 {
		if _, err := s.Get(ctx, projectID, id); err != nil {
			return Task{}, err
		}
	}
	return s.Get(ctx, projectID, id)
}

// DeleteResult says what Delete did.
type DeleteResult struct {
	Task    Task // the pre-delete snapshot (DeletedAt set to the stored value)
	Deleted bool // false: the task was already deleted and nothing was written
	// Event is the outbox event recorded with the delete, when the writer hook is wired.
	Event         outbox.Event
	EventRecorded bool
}

// Delete soft-deletes a task. In one transaction it sets deleted_at (first transition only),
// writes the one task:deleted audit row and, when wired, records the outbox event; after
// commit it sends the best-effort mailbox notice, updates the cache, emits task:deleted on the
// local emitter and wakes consumers. Deleting an already deleted task changes nothing.
// Called from an observed context it refuses with a *outbox.FenceError and writes nothing.
func (s *Store) Delete(ctx context.Context, projectID, id string) (DeleteResult, error) {
	if err := outbox.RefuseObserved(ctx, "delete task"); err != nil {
		return DeleteResult{}, err
	}
	res, err := s.deleteTx(ctx, projectID, id)
	if err != nil || !res.Deleted {
		return res, err
	}
	// After commit: the writer-owned, best-effort side effects and the local path.
	if err := s.SendDeleteNotice(ctx, res.Task); err != nil {
		s.log.Warn("delete notice not sent", zap.String("project_id", projectID), zap.String("task_id", id), zap.Error(err))
	}
	s.cache.remove(projectID, id)
	s.emitter.Emit(ctx, TaskDeleted{
		ProjectID: projectID, TaskID: id, DeletedAt: *res.Task.DeletedAt, Column: res.Task.Column,
		Archived: res.Task.Archived, EventID: res.Event.EventID, OriginProcessID: res.Event.WriterProcessID,
	})
	if s.writer != nil && res.EventRecorded {
		s.writer.Committed(projectID)
	}
	return res, nil
}

func (s *Store) deleteTx(ctx context.Context, projectID, id string) (DeleteResult, error) {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return DeleteResult{}, fmt.Errorf("delete task: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()

	t := Task{ProjectID: projectID, ID: id}
	var deletedAt time.Time
	err = tx.QueryRow(ctx, `UPDATE tasks SET deleted_at = now(), updated_at = now()
		WHERE project_id = $1 AND id = $2 AND deleted_at IS NULL
		RETURNING title, "column", archived, archived_at, deleted_at`, projectID, id).
		Scan(&t.Title, &t.Column, &t.Archived, &t.ArchivedAt, &deletedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		existing, err := getTask(ctx, tx, projectID, id)
		if err != nil {
			return DeleteResult{}, err
		}
		return DeleteResult{Task: existing}, nil
	}
	if err != nil {
		return DeleteResult{}, fmt.Errorf("delete task: %w", err)
	}
	t.DeletedAt = &deletedAt
	// The audit row and the outbox event go in one round trip: the hook's insert is queued on
	// the same batch as the audit row.
	b := &pgx.Batch{}
	if err := s.queueDeleteAudit(ctx, b, t); err != nil {
		return DeleteResult{}, err
	}
	var queued *outbox.QueuedEvent
	if s.writer != nil {
		if queued, err = s.writer.QueueTaskDeleted(ctx, b, outbox.TaskDeletion{
			ProjectID: projectID, TaskID: id, DeletedAt: deletedAt, PriorColumn: t.Column, Archived: t.Archived,
		}); err != nil {
			return DeleteResult{}, err
		}
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return DeleteResult{}, fmt.Errorf("delete task: %w", err)
	}
	res := DeleteResult{Task: t, Deleted: true}
	if queued != nil {
		if res.Event, res.EventRecorded, err = queued.Result(ctx, tx); err != nil {
			return DeleteResult{}, err
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return DeleteResult{}, fmt.Errorf("commit delete: %w", err)
	}
	return res, nil
}

const insertDeleteAuditSQL = `INSERT INTO run_audit (project_id, task_id, action, actor, metadata) VALUES ($1, $2, 'task:deleted', $3, $4)`

// WriteDeleteAuditTx writes the delete's one task:deleted run-audit row. It is writer-owned:
// an observed context is refused.
func (s *Store) WriteDeleteAuditTx(ctx context.Context, tx pgx.Tx, t Task) error {
	if err := outbox.RefuseObserved(ctx, "task:deleted audit row"); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, insertDeleteAuditSQL, s.deleteAuditArgs(t)...); err != nil {
		return fmt.Errorf("write delete audit: %w", err)
	}
	return nil
}

// queueDeleteAudit is WriteDeleteAuditTx queued on the delete transaction's batch.
func (s *Store) queueDeleteAudit(ctx context.Context, b *pgx.Batch, t Task) error {
	if err := outbox.RefuseObserved(ctx, "task:deleted audit row"); err != nil {
		return err
	}
	b.Queue(insertDeleteAuditSQL, s.deleteAuditArgs(t)...)
	return nil
}

func (s *Store) deleteAuditArgs(t Task) []any {
	meta, _ := json.Marshal(map[string]any{"column": t.Column, "archived": t.Archived})
	// JSON goes as a string: in the exec and simple-protocol modes a pooler needs, pgx sends a
	// []byte as bytea, which a json column refuses.
	return []any{t.ProjectID, t.ID, s.actor, string(meta)}
}

// SendDeleteNotice writes the operator mailbox notice for a deleted task. It is writer-owned:
// an observed context is refused.
func (s *Store) SendDeleteNotice(ctx context.Context, t Task) error {
	if err := outbox.RefuseObserved(ctx, "mailbox notice"); err != nil {
		return err
	}
	body := fmt.Sprintf("Task %q (%s) was deleted from column %q by %s.", t.Title, t.ID, t.Column, s.actor)
	if _, err := s.pool.Exec(ctx, `INSERT INTO mailbox_notices (project_id, task_id, kind, body) VALUES ($1, $2, 'task-deleted', $3)`,
		t.ProjectID, t.ID, body); err != nil {
		return fmt.Errorf("send delete notice: %w", err)
	}
	return nil
}

// LiveTaskIDs returns the IDs of a project's live tasks.
func (s *Store) LiveTaskIDs(ctx context.Context, projectID string) ([]string, error) {
	rows, err := s.pool.Query(ctx, liveTaskIDsSQL, projectID)
	if err != nil {
		return nil, fmt.Errorf("live tasks: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// insertObserverAuditSQL is an audit row an observer writes (a poisoned or replayed event).
const insertObserverAuditSQL = `INSERT INTO run_audit (project_id, task_id, action, actor, metadata)
VALUES (@project, @task, @action, @actor, @metadata)`

const liveTaskIDsSQL = `SELECT id FROM tasks WHERE project_id = $1 AND deleted_at IS NULL`

// LiveTaskIDsTx implements outbox.LiveTasks.
func (s *Store) LiveTaskIDsTx(ctx context.Context, tx pgx.Tx, projectID string) ([]string, error) {
	rows, err := tx.Query(ctx, liveTaskIDsSQL, projectID)
	if err != nil {
		return nil, fmt.Errorf("live tasks: %w", err)
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// LoadCache fills the cache with the live tasks of projects, as a store does when it opens.
func (s *Store) LoadCache(ctx context.Context, projects ...string) error {
	for _, p := range projects {
		ids, err := s.LiveTaskIDs(ctx, p)
		if err != nil {
			return err
		}
		if err := s.cache.ReplaceLive(ctx, p, ids); err != nil {
			return err
		}
	}
	return nil
}

// WriteAuditTx implements outbox.AuditSink: the module's audit records become run-audit rows
// whose metadata holds only identifiers and counts.
func (s *Store) WriteAuditTx(ctx context.Context, tx pgx.Tx, rec outbox.AuditRecord) error {
	meta := map[string]any{"consumerId": string(rec.ConsumerID)}
	if rec.EventID != "" {
		meta["eventId"] = rec.EventID
		meta["sequence"] = rec.Sequence
		meta["attempts"] = rec.Attempts
	}
	if rec.Reason != "" {
		meta["reason"] = rec.Reason
	}
	actor := rec.Actor
	if actor == "" {
		actor = "outbox:" + string(rec.ConsumerID)
	}
	b, err := json.Marshal(meta)
	if err != nil {
		return err
	}
	var taskID *string
	if id, _, err := outbox.ParseEventID(rec.EventID); err == nil {
		taskID = &id
	}
	if _, err := tx.Exec(ctx, insertObserverAuditSQL, pgx.StrictNamedArgs{"project": rec.ProjectID, "task": taskID,
		"action": rec.Action, "actor": actor, "metadata": string(b)}); err != nil {
		return fmt.Errorf("write run audit: %w", err)
	}
	return nil
}

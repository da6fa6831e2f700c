package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// The host seams: what the module asks of the process that embeds it (Deps carries them to
// New; the fx Module takes them from the graph). The reference host in example/taskstore
// implements each one.

// TaskCache is the host's local cache of live tasks. Both methods must be idempotent.
type TaskCache interface {
	// RemoveTask drops a task deleted at deletedAt. removed is false when the task was not
	// cached, which the consumer counts as a suppressed re-delivery.
	RemoveTask(ctx context.Context, projectID, taskID string, deletedAt time.Time) (removed bool, err error)
	// ReplaceLive makes liveTaskIDs the project's complete live set, dropping every other ID.
	// The set comes from a reconciliation snapshot, so it may hold a task the host deleted
	// (and removed from the cache) after the snapshot was taken; the consumer removes every
	// such task again, through RemoveTask, right after ReplaceLive returns.
	ReplaceLive(ctx context.Context, projectID string, liveTaskIDs []string) error
}

// LiveTasks reads the host's live tasks for full reconciliation.
type LiveTasks interface {
	// LiveTaskIDsTx returns the IDs of the project's tasks with deleted_at IS NULL. It runs in
	// tx, a REPEATABLE READ transaction that also reads the outbox head, so both come from one
	// snapshot.
	LiveTaskIDsTx(ctx context.Context, tx pgx.Tx, projectID string) ([]string, error)
}

// AuditAction names what an audit row records.
type AuditAction string

// Audit actions the module writes.
const (
	AuditConsumerPoisoned AuditAction = "lifecycle-observation:consumer-poisoned"
	AuditConsumerReplayed AuditAction = "lifecycle-observation:consumer-replayed"
	AuditConsumerRetired  AuditAction = "lifecycle-observation:consumer-retired"
	AuditConsumerRestored AuditAction = "lifecycle-observation:consumer-reinstated"
)

// AuditRecord is a run-audit row the module asks the host to write. It holds identifiers and
// counts only: never error text, payload prose or free-form notes.
type AuditRecord struct {
	Action     AuditAction
	ProjectID  string
	ConsumerID ConsumerID
	EventID    string // empty for consumer-level actions
	Sequence   int64  // 0 for consumer-level actions
	Attempts   int    // delivery attempts so far
	Actor      string // who asked, for operator actions (an identifier)
	Reason     string // why, for operator actions (a ticket or short code)
}

// AuditSink writes run-audit rows inside the module's transaction, so the audited change and
// its audit row commit together.
type AuditSink interface {
	WriteAuditTx(ctx context.Context, tx pgx.Tx, rec AuditRecord) error
}

// TableAuditSink writes to the module's own lifecycle_audit table. It is used when the host
// provides no sink.
type TableAuditSink struct{}

// WriteAuditTx inserts rec into lifecycle_audit.
func (TableAuditSink) WriteAuditTx(ctx context.Context, tx pgx.Tx, rec AuditRecord) error {
	_, err := tx.Exec(ctx, insertAuditSQL, pgx.StrictNamedArgs{"project": rec.ProjectID, "action": string(rec.Action),
		"consumer": nullable(string(rec.ConsumerID)), "event_id": nullable(rec.EventID), "sequence": nullableInt(rec.Sequence),
		"attempts": nullableInt(int64(rec.Attempts)), "actor": nullable(rec.Actor), "reason": nullable(rec.Reason)})
	return err
}

// insertAuditSQL writes an audit row; the parameters are its columns, NULL where they do not
// apply.
const insertAuditSQL = `
INSERT INTO lifecycle_audit (project_id, action, consumer_id, event_id, sequence, attempts, actor, reason)
VALUES (@project, @action, @consumer, @event_id, @sequence, @attempts, @actor, @reason)`

func nullable(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}

func nullableInt(v int64) *int64 {
	if v == 0 {
		return nil
	}
	return &v
}

// Projects says which projects this process observes. It is asked again at every heartbeat,
// and when the host calls RefreshProjects (Outbox or Consumer), so projects may come
// and go while the consumer runs. ProjectRuntimes is a Projects whose set follows the
// per-project runtimes a host adds and removes.
type Projects interface {
	ObservedProjects(ctx context.Context) ([]string, error)
}

// StaticProjects is a fixed project list.
type StaticProjects []string

// ObservedProjects returns the list.
func (p StaticProjects) ObservedProjects(context.Context) ([]string, error) { return p, nil }

// Settings is the host seam for persisted configuration: the reference host reads its
// settings table. Setting reports found=false when the named field has no row.
type Settings interface {
	Setting(ctx context.Context, name string) (value string, found bool, err error)
}

// Listener is an observed-safe listener. It must be idempotent (delivery is at-least-once) and
// must not perform writer-owned side effects: the context it gets is marked observed, and the
// writer hook and the host's writer-owned paths refuse such a context.
type Listener interface {
	// Name identifies the listener in logs.
	Name() string
	HandleObserved(ctx context.Context, ev ObservedEvent) error
}

// ListenerFunc adapts a function to a Listener.
func ListenerFunc(name string, fn func(context.Context, ObservedEvent) error) Listener {
	return listenerFunc{name, fn}
}

type listenerFunc struct {
	name string
	fn   func(context.Context, ObservedEvent) error
}

func (l listenerFunc) Name() string { return l.name }
func (l listenerFunc) HandleObserved(ctx context.Context, ev ObservedEvent) error {
	return l.fn(ctx, ev)
}

// MaintenanceTask is one unit of the host's self-healing sweep, run at store open and on the
// host's schedule. The module contributes its retention sweep as one.
type MaintenanceTask struct {
	Name string
	Run  func(ctx context.Context) (fmt.Stringer, error)
}

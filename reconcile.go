package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	semconv "go.opentelemetry.io/otel/semconv/v1.37.0"
	"go.uber.org/zap"
)

// ReconcileReason is why a consumer reconciled: stored on the cursor (reconcile_reason, as
// ProjectStatus.ReconcileReason shows it), logged and counted.
type ReconcileReason string

// Why a consumer reconciles.
const (
	ReasonMissingCursor          ReconcileReason = "missing_cursor"
	ReasonCursorAheadOfHead      ReconcileReason = "cursor_ahead_of_head"
	ReasonCursorBelowPrunedFloor ReconcileReason = "cursor_below_pruned_floor"
	// ReasonStreamHole: an event its tick counted is no longer stored (removed by hand by the
	// schema's owner; no runtime role can delete one), so the stream cannot be replayed past it.
	ReasonStreamHole ReconcileReason = "stream_hole"
)

const headSQL = `SELECT coalesce((SELECT last_sequence FROM lifecycle_outbox_head WHERE project_id = $1), 0)`

// reconcileCursorSQL restarts consumer @consumer's cursor of @project at @head, recording
// @reason and the time of the clock shifted by @clock_offset.
const reconcileCursorSQL = `
UPDATE lifecycle_consumer_cursors
SET last_acked_sequence = @head, acked_at = pg_catalog.now(),
    reconciled_at = pg_catalog.now() + @clock_offset::interval, reconcile_reason = @reason
WHERE project_id = @project AND consumer_id = @consumer`

const supersedeRetriesSQL = `
UPDATE lifecycle_consumer_deliveries
SET state = 'resolved', resolved_at = pg_catalog.now() + $4::interval, next_attempt_at = NULL
WHERE project_id = $1 AND consumer_id = $2 AND state = 'retrying' AND sequence <= $3`

// reconciler rebuilds a project's live set when its history cannot be replayed.
type reconciler struct {
	id    ConsumerID
	pool  *pgxpool.Pool
	cfg   consumerConfig
	cache TaskCache
	live  LiveTasks
}

// rebuilds reports whether reconciliation rebuilds the cache, or only moves the cursor.
func (r *reconciler) rebuilds() bool { return r.cache != nil && r.live != nil }

// reconcile rebuilds the project's live set when its history cannot be replayed, and restarts
// the cursor at the head. The head and the live tasks come from one REPEATABLE READ snapshot:
// a delete committed before it is absent from the live set and sequenced at or below the head
// or later; a delete committed after it is sequenced above the head and delivered normally.
func (l *scanLoop) reconcile(ctx context.Context, st *stream, reason ReconcileReason) (err error) {
	ctx, span := l.trace.start(ctx, spanReconcile, semconv.MessagingDestinationName(st.project),
		semconv.MessagingConsumerGroupName(string(l.id)), attrReason.String(string(reason)))
	defer func() { endSpan(span, err) }()
	r := l.recon
	// The snapshot comes from the scan's source: on a standby, a state of the primary it has
	// replayed, whose head and live set agree as they do on the primary. What was deleted
	// since is read on the primary, which has it all.
	var head int64
	var live []string
	err = l.read(ctx, func(db *pgxpool.Pool) (err error) {
		head, live, err = r.snapshot(ctx, db, st.project)
		return err
	})
	if err != nil {
		return err
	}
	if r.rebuilds() {
		if err := r.cache.ReplaceLive(ctx, st.project, live); err != nil {
			return fmt.Errorf("reconcile: replace cache: %w", err)
		}
		if err := r.removeDeletedSince(ctx, st.project, head); err != nil {
			return err
		}
	}
	err = l.leases.fencedTx(ctx, st.project, st.epoch, func(tx pgx.Tx) error {
		return r.restartCursorTx(ctx, tx, st.project, head, reason)
	})
	if err != nil {
		st.forgetOpen()
		return fmt.Errorf("reconcile: %w", err)
	}
	previous := st.acked
	st.reconciled(head)
	l.stats.reconciliations.Add(1)
	l.metrics.reconciled(st.project, string(l.id), string(reason))
	fields := []zap.Field{zap.String("project_id", st.project), zap.String("reason", string(reason)),
		zap.Int64("previous_cursor", previous), zap.Int64("head", head), zap.Int("live_tasks", len(live))}
	if !r.rebuilds() {
		l.log.Warn("reconciled the cursor only: no live-task source or cache to rebuild", fields...)
	} else {
		l.log.Info("reconciled", fields...)
	}
	return nil
}

// restartCursorTx moves the cursor to head, records why, and resolves the retries it
// supersedes.
func (r *reconciler) restartCursorTx(ctx context.Context, tx pgx.Tx, project string, head int64, reason ReconcileReason) error {
	offset := r.cfg.Clock.Offset()
	if _, err := tx.Exec(ctx, reconcileCursorSQL, pgx.StrictNamedArgs{"project": project, "consumer": r.id, "head": head,
		"reason": string(reason), "clock_offset": offset}); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, supersedeRetriesSQL, project, r.id, head, offset)
	return err
}

// deletedSinceSQL lists the deletions that may have committed after a snapshot whose head was
// $2: those numbered above it, those the last tick has not numbered yet (their transaction is
// not visible in its snapshot), and those of older writers waiting to be adopted (rows that
// committed before the snapshot come too; removing them again is harmless).
const deletedSinceSQL = `
SELECT task_id, deleted_at FROM lifecycle_outbox_read($1::text, $2::bigint, 100000, NULL, NULL, NULL)
UNION ALL
SELECT e.task_id::text, e.deleted_at::timestamptz
FROM (SELECT t.snapshot FROM lifecycle_tick t ORDER BY t.tick_id DESC LIMIT 1) AS t, lifecycle_event_log e
WHERE e.txid >= pg_catalog.pg_snapshot_xmin(t.snapshot) AND e.project_id = $1
  AND NOT pg_catalog.pg_visible_in_snapshot(e.txid, t.snapshot)
UNION ALL
SELECT task_id, deleted_at FROM lifecycle_outbox_pending WHERE project_id = $1
UNION ALL
SELECT task_id, deleted_at FROM lifecycle_outbox WHERE project_id = $1 AND sequence IS NULL`

// removeDeletedSince removes from the cache the tasks deleted after the snapshot whose head
// was head. The live set just installed is older than those deletes, and the process's own
// delete path may have removed a task from the cache after the snapshot was taken:
// ReplaceLive put it back. Every such delete has committed by now (the local path removes a
// task only after commit), so it is listed here and removed again before anything else reads
// the reconciled stream. Removal is idempotent; the events are still delivered as usual.
func (r *reconciler) removeDeletedSince(ctx context.Context, project string, head int64) error {
	rows, err := r.pool.Query(ctx, deletedSinceSQL, project, head)
	if err != nil {
		return fmt.Errorf("reconcile: read deletions since the snapshot: %w", err)
	}
	type deletion struct {
		TaskID    string
		DeletedAt time.Time
	}
	gone, err := pgx.CollectRows(rows, pgx.RowToStructByPos[deletion])
	if err != nil {
		return fmt.Errorf("reconcile: read deletions since the snapshot: %w", err)
	}
	octx := WithObserved(ctx, Observed{ConsumerID: r.id})
	for _, d := range gone {
		if _, err := r.cache.RemoveTask(octx, project, d.TaskID, d.DeletedAt); err != nil {
			return fmt.Errorf("reconcile: update cache: %w", err)
		}
	}
	return nil
}

// snapshot reads the head and the live task IDs in one REPEATABLE READ transaction.
func (r *reconciler) snapshot(ctx context.Context, db *pgxpool.Pool, project string) (int64, []string, error) {
	tx, err := db.BeginTx(ctx, r.cfg.txOptions(pgx.RepeatableRead, pgx.ReadOnly))
	if err != nil {
		return 0, nil, fmt.Errorf("reconcile: begin snapshot: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var head int64
	if err := tx.QueryRow(ctx, headSQL, project).Scan(&head); err != nil {
		return 0, nil, fmt.Errorf("reconcile: read head: %w", err)
	}
	var live []string
	if r.live != nil {
		if live, err = r.live.LiveTaskIDsTx(ctx, tx, project); err != nil {
			return 0, nil, fmt.Errorf("reconcile: read live tasks: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, nil, fmt.Errorf("reconcile: end snapshot: %w", err)
	}
	return head, live, nil
}

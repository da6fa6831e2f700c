package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	semconv "go.opentelemetry.io/otel/semconv/v1.37.0"
	"go.uber.org/zap"
)

// Why a consumer reconciles. They are stored on the cursor and logged.
const (
	ReasonMissingCursor          = "missing_cursor"
	ReasonCursorAheadOfHead      = "cursor_ahead_of_head"
	ReasonCursorBelowPrunedFloor = "cursor_below_pruned_floor"
)

const headSQL = `SELECT coalesce((SELECT last_sequence FROM lifecycle_outbox_heads WHERE project_id = $1), 0)`

const reconcileCursorSQL = `
UPDATE lifecycle_consumer_cursors
SET last_acked_sequence = $3, acked_at = pg_catalog.now(), reconciled_at = pg_catalog.now() + $5::interval, reconcile_reason = $4
WHERE project_id = $1 AND consumer_id = $2`

const supersedeRetriesSQL = `
UPDATE lifecycle_consumer_deliveries
SET state = 'resolved', resolved_at = pg_catalog.now() + $4::interval, next_attempt_at = NULL
WHERE project_id = $1 AND consumer_id = $2 AND state = 'retrying' AND sequence <= $3`

// reconcile rebuilds the project's live set when its history cannot be replayed, and restarts
// the cursor at the head. The head and the live tasks come from one REPEATABLE READ snapshot:
// a delete committed before it is absent from the live set and sequenced at or below the head
// or later; a delete committed after it is sequenced above the head and delivered normally.
func (c *Consumer) reconcile(ctx context.Context, st *streamState, reason string) (err error) {
	ctx, span := c.trace.start(ctx, spanReconcile, semconv.MessagingDestinationName(st.project),
		semconv.MessagingConsumerGroupName(string(c.id)), attrReason.String(reason))
	defer func() { endSpan(span, err) }()
	head, live, err := c.snapshot(ctx, st.project)
	if err != nil {
		return err
	}
	if c.cache != nil && c.live != nil {
		if err := c.cache.ReplaceLive(ctx, st.project, live); err != nil {
			return fmt.Errorf("reconcile: replace cache: %w", err)
		}
		if err := c.removeDeletedSince(ctx, st.project, head); err != nil {
			return err
		}
	}
	err = c.fencedTx(ctx, st, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, reconcileCursorSQL, st.project, c.id, head, reason, c.offset()); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, supersedeRetriesSQL, st.project, c.id, head, c.offset())
		return err
	})
	if err != nil {
		return fmt.Errorf("reconcile: %w", err)
	}
	previous := st.acked
	// Every in-memory position restarts at the head: sequences above it are new events even
	// if this instance delivered events under those numbers before (a database restored to an
	// older head reuses them).
	st.acked, st.position, st.delivered, st.deliveredID, st.checkDelivered = head, head, head, "", false
	st.blocked = false
	c.stats.reconciliations.Add(1)
	c.metrics.reconciled(st.project, string(c.id), reason)
	fields := []zap.Field{zap.String("project_id", st.project), zap.String("reason", reason),
		zap.Int64("previous_cursor", previous), zap.Int64("head", head), zap.Int("live_tasks", len(live))}
	if c.live == nil || c.cache == nil {
		c.log.Warn("reconciled the cursor only: no live-task source or cache to rebuild", fields...)
	} else {
		c.log.Info("reconciled", fields...)
	}
	return nil
}

// deletedSinceSQL lists the deletions that may have committed after a snapshot whose head was
// $2: those numbered above it and those not numbered yet (unnumbered rows that committed
// before the snapshot come too; removing them again is harmless). Two branches, so that each
// uses its partial index.
const deletedSinceSQL = `
SELECT task_id, deleted_at FROM lifecycle_outbox WHERE project_id = $1 AND sequence > $2
UNION ALL
SELECT task_id, deleted_at FROM lifecycle_outbox WHERE project_id = $1 AND sequence IS NULL`

// removeDeletedSince removes from the cache the tasks deleted after the snapshot whose head
// was head. The live set just installed is older than those deletes, and the process's own
// delete path may have removed a task from the cache after the snapshot was taken:
// ReplaceLive put it back. Every such delete has committed by now (the local path removes a
// task only after commit), so it is listed here and removed again before anything else reads
// the reconciled stream. Removal is idempotent; the events are still delivered as usual.
func (c *Consumer) removeDeletedSince(ctx context.Context, project string, head int64) error {
	rows, err := c.pool.Query(ctx, deletedSinceSQL, project, head)
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
	octx := WithObserved(ctx, Observed{ConsumerID: c.id})
	for _, d := range gone {
		if _, err := c.cache.RemoveTask(octx, project, d.TaskID, d.DeletedAt); err != nil {
			return fmt.Errorf("reconcile: update cache: %w", err)
		}
	}
	return nil
}

// snapshot reads the head and the live task IDs in one REPEATABLE READ transaction.
func (c *Consumer) snapshot(ctx context.Context, project string) (int64, []string, error) {
	tx, err := c.pool.BeginTx(ctx, c.cfg.txOptions(pgx.RepeatableRead, pgx.ReadOnly))
	if err != nil {
		return 0, nil, fmt.Errorf("reconcile: begin snapshot: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var head int64
	if err := tx.QueryRow(ctx, headSQL, project).Scan(&head); err != nil {
		return 0, nil, fmt.Errorf("reconcile: read head: %w", err)
	}
	var live []string
	if c.live != nil {
		if live, err = c.live.LiveTaskIDsTx(ctx, tx, project); err != nil {
			return 0, nil, fmt.Errorf("reconcile: read live tasks: %w", err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, nil, fmt.Errorf("reconcile: end snapshot: %w", err)
	}
	return head, live, nil
}

const fenceSQL = `
SELECT coalesce(last_acked_sequence, -1) FROM lifecycle_consumer_cursors
WHERE project_id = $1 AND consumer_id = $2 AND lease_owner = $3 AND lease_epoch = $4
  AND lease_expires_at > pg_catalog.now() + $5::interval AND retired_at IS NULL
FOR UPDATE`

// fencedTx runs fn in a transaction that first locks the cursor row under the stream's lease.
// When the lease no longer matches it returns ErrLeaseLost and fn never runs. Holding the row
// lock until commit keeps a takeover from slipping in between the check and the writes.
func (c *Consumer) fencedTx(ctx context.Context, st *streamState, fn func(pgx.Tx) error) error {
	tx, err := c.pool.BeginTx(ctx, c.cfg.txOptions("", ""))
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var cursor int64
	err = tx.QueryRow(ctx, fenceSQL, st.project, c.id, c.owner, st.epoch, c.offset()).Scan(&cursor)
	if errors.Is(err, pgx.ErrNoRows) {
		return ErrLeaseLost
	}
	if err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

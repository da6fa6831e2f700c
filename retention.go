package outbox

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/zap"
)

// Retention prunes what no one needs any more. It is run by the host's self-healing sweep
// (see Task), never by a consumer:
//
//   - an event goes once it is older than the retention window AND every non-retired
//     consumer of its project has acknowledged it, unless an unresolved delivery of a
//     non-retired consumer still points at it (a dead letter must stay replayable);
//   - events of the log (schema 18 on) go a project's part of a tick at a time, whole: their
//     sequences are ranks inside the part, so deleting some would renumber the others. A part
//     stays while any of it is unacknowledged, inside the window or pointed at; the ticks no
//     remaining part needs go too, except the newest;
//   - each batch records the project's pruned floor in the same transaction, so a cursor left
//     below it (a new or reinstated consumer) reconciles instead of silently skipping;
//   - a resolved dead letter goes after DeadLetterRetention; an unresolved one stays until an
//     operator resolves it or retires its consumer.
//
// Pruning never blocks writers: the delete transaction only inserts, and the rows pruned are
// old rows no writer touches. The heads row (which the ticker locks) is updated after the
// deletes in each batch, and the ticks are deleted only when the ticker does not hold their
// table, so the ticker waits at most for one batch's commit.
type Retention struct {
	pool    *pgxpool.Pool
	cfg     retentionConfig
	log     *zap.Logger
	metrics *Metrics

	beforeBatch func(project string) // test hook: runs before each batch's transaction
	trace       tracing
}

// retentionConfig is what the sweep takes from a validated Config: its fields, by their
// Config names.
type retentionConfig struct {
	RetentionWindow     time.Duration
	DeadLetterRetention time.Duration
	RetentionBatchSize  int
	RetentionBudget     int
	LockTimeout         time.Duration
	StatementTimeout    time.Duration
	Clock               Clock
	TracerProvider      trace.TracerProvider
}

func (c Config) retentionConfig() retentionConfig {
	return retentionConfig{RetentionWindow: c.RetentionWindow, DeadLetterRetention: c.DeadLetterRetention,
		RetentionBatchSize: c.RetentionBatchSize, RetentionBudget: c.RetentionBudget, LockTimeout: c.LockTimeout,
		StatementTimeout: c.StatementTimeout, Clock: c.Clock, TracerProvider: c.TracerProvider}
}

// txOptions are the options of a pruning transaction (see boundedTx).
func (c retentionConfig) txOptions(iso pgx.TxIsoLevel, mode pgx.TxAccessMode) pgx.TxOptions {
	return boundedTx(iso, mode, c.LockTimeout, c.StatementTimeout)
}

// NewRetention builds the retention sweep from cfg (defaults applied, then validated), for a
// host that builds the parts one by one; New builds its sweep from the Config it validated
// already.
func NewRetention(pool *pgxpool.Pool, cfg Config, log *zap.Logger, metrics *Metrics) (*Retention, error) {
	cfg, err := validConfig(cfg)
	if err != nil {
		return nil, err
	}
	if err := checkPooledDB(cfg, pool); err != nil {
		return nil, err
	}
	return newRetention(pool, cfg.retentionConfig(), log, metrics), nil
}

func newRetention(pool *pgxpool.Pool, cfg retentionConfig, log *zap.Logger, metrics *Metrics) *Retention {
	if log == nil {
		log = zap.NewNop()
	}
	return &Retention{pool: pool, cfg: cfg, log: log.Named("outbox.retention"), metrics: metrics, trace: newTracing(cfg.TracerProvider)}
}

// RetentionResult is what one sweep did.
type RetentionResult struct {
	PrunedByProject   map[string]int64 // outbox rows pruned, per project
	DeadLettersPruned int64            // resolved (or orphaned by retirement) deliveries pruned
	BudgetExhausted   bool             // the sweep stopped at its row budget; the next one goes on
	Batches           int
	LongestBatch      time.Duration
	Elapsed           time.Duration
}

// Pruned is the total of rows pruned across projects.
func (r RetentionResult) Pruned() int64 {
	var n int64
	for _, v := range r.PrunedByProject {
		n += v
	}
	return n
}

// String summarises the result for the sweep's log line.
func (r RetentionResult) String() string {
	return fmt.Sprintf("pruned %d outbox rows in %d projects and %d dead letters in %d batches (longest %s, budget exhausted: %t)",
		r.Pruned(), len(r.PrunedByProject), r.DeadLettersPruned, r.Batches, r.LongestBatch.Round(time.Millisecond), r.BudgetExhausted)
}

// PrunePlan is, for one project, what a sweep may prune now.
type PrunePlan struct {
	ProjectID     string `json:"projectId"`
	Head          int64  `json:"head"`
	PrunedThrough int64  `json:"prunedThrough"`
	// Through is the highest sequence every non-retired consumer acknowledged.
	Through int64 `json:"through"`
	// Prunable events are at or below Through, older than the window, and no open delivery of
	// a non-retired consumer points at them; in the log, whole parts of ticks that are.
	Prunable int64 `json:"prunable"`
	// HeldBy names the slowest non-retired consumer, the one holding pruning back.
	HeldBy string `json:"heldBy,omitempty"`
}

// planSQL computes, per project, the highest sequence that every non-retired consumer has
// acknowledged. A cursor never positioned counts as zero: it holds pruning until it reads or
// is retired. A project with no active consumer may be pruned up to its head.
const planSQL = `
SELECT h.project_id, h.last_sequence, h.pruned_through,
       coalesce(pg_catalog.min(coalesce(c.last_acked_sequence, 0)) FILTER (WHERE c.consumer_id IS NOT NULL), h.last_sequence) AS through,
       coalesce((pg_catalog.array_agg(c.consumer_id ORDER BY coalesce(c.last_acked_sequence, 0), c.consumer_id)
                 FILTER (WHERE c.consumer_id IS NOT NULL))[1], '') AS held_by
FROM lifecycle_outbox_head h
LEFT JOIN lifecycle_consumer_cursors c ON c.project_id = h.project_id AND c.retired_at IS NULL
GROUP BY h.project_id, h.last_sequence, h.pruned_through
ORDER BY h.project_id`

// countPrunableSQL counts the events of project $1 that may go: at or below $2, older than the
// window ($4 before now shifted by $3), not pointed at by an open delivery of a live consumer.
// Rows of the frozen stream (before schema 18) count one by one; the log counts whole parts
// of ticks, whose last sequence is at or below $2, whose tick is older than the window and
// that no such delivery points into, since a part is pruned whole or not at all.
// lifecycle_outbox_prune deletes by the same rules (migration 0019).
const countPrunableSQL = `
SELECT (SELECT pg_catalog.count(*) FROM lifecycle_outbox o
        WHERE o.project_id = $1 AND o.sequence IS NOT NULL AND o.sequence <= $2
          AND o.occurred_at < pg_catalog.now() + $3::interval - $4::interval
          AND NOT EXISTS (
              SELECT 1 FROM lifecycle_consumer_deliveries d
              JOIN lifecycle_consumer_cursors c ON c.project_id = d.project_id AND c.consumer_id = d.consumer_id
              WHERE d.project_id = o.project_id AND d.sequence = o.sequence
                AND d.state <> 'resolved' AND c.retired_at IS NULL))
     + coalesce((SELECT pg_catalog.sum(tp.events) FROM lifecycle_tick_project tp
                 JOIN lifecycle_tick t ON t.tick_id = tp.tick_id
                 WHERE tp.project_id = $1 AND tp.first_sequence + tp.events - 1 <= $2
                   AND t.ticked_at < pg_catalog.now() + $3::interval - $4::interval
                   AND NOT EXISTS (
                       SELECT 1 FROM lifecycle_consumer_deliveries d
                       JOIN lifecycle_consumer_cursors c ON c.project_id = d.project_id AND c.consumer_id = d.consumer_id
                       WHERE d.project_id = tp.project_id
                         AND d.sequence >= tp.first_sequence AND d.sequence <= tp.first_sequence + tp.events - 1
                         AND d.state <> 'resolved' AND c.retired_at IS NULL)), 0)`

// pruneBatchSQL deletes, as the schema owner (migrations 0017 and 0019), up to @limit events
// of @project above @after, the highest sequence this sweep pruned in the project before (more
// than @limit when one part of a tick holds more: parts go whole), that every live cursor
// acknowledged (read again inside the call: a cursor created or reinstated since the plan
// holds its events back too) and that are older than @window on the clock shifted by
// @clock_offset; it raises the project's floor to the highest sequence it deleted. Starting
// above @after keeps a batch from stepping over the index entries of every row the sweep
// deleted so far, which cannot be marked dead while a snapshot from before their deletion
// lives.
const pruneBatchSQL = `
SELECT pruned, max_sequence FROM lifecycle_outbox_prune(@project, @limit, @after, @clock_offset::interval, @window::interval)`

// pruneDeadLettersSQL deletes, as the schema owner, up to $1 deliveries of the caller's
// projects resolved more than $3 ago on the clock shifted by $2, or left by a retired consumer.
const pruneDeadLettersSQL = `SELECT lifecycle_outbox_prune_dead_letters($1, $2::interval, $3::interval)`

// Plan reports, per project, what a sweep would prune now: a dry run that changes nothing.
func (r *Retention) Plan(ctx context.Context) ([]PrunePlan, error) {
	plans, err := r.plan(ctx)
	if err != nil {
		return nil, err
	}
	for i := range plans {
		p := &plans[i]
		if p.Through <= p.PrunedThrough {
			continue
		}
		if err := r.pool.QueryRow(ctx, countPrunableSQL, p.ProjectID, p.Through, r.cfg.Clock.Offset(), r.cfg.RetentionWindow).Scan(&p.Prunable); err != nil {
			return nil, fmt.Errorf("retention plan: %w", err)
		}
	}
	return plans, nil
}

func (r *Retention) plan(ctx context.Context) ([]PrunePlan, error) {
	rows, err := r.pool.Query(ctx, planSQL)
	if err != nil {
		return nil, fmt.Errorf("retention plan: %w", err)
	}
	var plans []PrunePlan
	for rows.Next() {
		var p PrunePlan
		if err := rows.Scan(&p.ProjectID, &p.Head, &p.PrunedThrough, &p.Through, &p.HeldBy); err != nil {
			rows.Close()
			return nil, fmt.Errorf("retention plan: %w", err)
		}
		plans = append(plans, p)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("retention plan: %w", err)
	}
	return plans, nil
}

// Sweep prunes in bounded batches until nothing is left or the budget is spent. When some
// projects could not be pruned it prunes the others and returns what it did together with a
// *ProjectErrors naming them.
func (r *Retention) Sweep(ctx context.Context) (RetentionResult, error) {
	ctx, span := r.trace.start(ctx, spanRetention)
	res, err := r.sweep(ctx)
	endSpan(span, err, attrPruned.Int64(res.Pruned()))
	return res, err
}

func (r *Retention) sweep(ctx context.Context) (RetentionResult, error) {
	started := time.Now()
	res := RetentionResult{PrunedByProject: map[string]int64{}}
	plans, err := r.plan(ctx)
	if err != nil {
		return res, err
	}
	budget := int64(r.cfg.RetentionBudget)
	// One project's trouble (a heads row another role holds, a row the checks refuse) costs
	// that project's pruning only: the others and the dead letters are pruned all the same.
	failed := map[string]error{}
	for _, p := range plans {
		var after int64 // the highest sequence pruned in p by this sweep
		for budget > 0 {
			n, err := r.pruneBatch(ctx, p, min(int64(r.cfg.RetentionBatchSize), budget), &after, &res)
			if err != nil && ctx.Err() != nil {
				return res, err
			}
			if err != nil {
				failed[p.ProjectID] = err
				r.metrics.projectError(p.ProjectID, "", "retention")
				r.log.Warn("retention skipped a project whose pruning failed; the others go on",
					zap.String("project_id", p.ProjectID), zap.Error(err))
				break
			}
			budget -= n
			if n < int64(r.cfg.RetentionBatchSize) {
				break
			}
		}
		if budget <= 0 {
			res.BudgetExhausted = true
			break
		}
	}
	for budget > 0 {
		var n int64
		err := r.pool.QueryRow(ctx, pruneDeadLettersSQL, min(int64(r.cfg.RetentionBatchSize), budget), r.cfg.Clock.Offset(), r.cfg.DeadLetterRetention).Scan(&n)
		if err != nil {
			return res, fmt.Errorf("prune dead letters: %w", err)
		}
		res.DeadLettersPruned += n
		budget -= n
		if n < int64(r.cfg.RetentionBatchSize) {
			break
		}
	}
	if budget <= 0 {
		res.BudgetExhausted = true
	}
	r.metrics.prunedDeadLetters(res.DeadLettersPruned)
	res.Elapsed = time.Since(started)
	if len(failed) > 0 {
		err = &ProjectErrors{Op: "retention", Failed: failed}
	}
	r.log.Info("retention sweep", zap.Int64("pruned_rows", res.Pruned()), zap.Int("projects", len(res.PrunedByProject)),
		zap.Int64("dead_letters_pruned", res.DeadLettersPruned), zap.Int("batches", res.Batches),
		zap.Duration("longest_batch", res.LongestBatch), zap.Bool("budget_exhausted", res.BudgetExhausted),
		zap.Int("failed_projects", len(failed)), zap.Duration("elapsed", res.Elapsed))
	return res, err
}

// pruneBatch deletes up to limit rows of one project above *after and raises its floor, in one
// call of the owner's prune function; *after becomes the highest sequence it deleted.
// The plan is a sweep's starting point; each batch re-reads the slowest live cursor, so that
// one created or reinstated since holds its rows back. (One that appears between that read
// and the commit finds the raised floor and reconciles.)
func (r *Retention) pruneBatch(ctx context.Context, p PrunePlan, limit int64, after *int64, res *RetentionResult) (int64, error) {
	if p.Through <= 0 {
		return 0, nil
	}
	if r.beforeBatch != nil {
		r.beforeBatch(p.ProjectID)
	}
	started := time.Now()
	var n, maxSeq int64
	err := pgx.BeginTxFunc(ctx, r.pool, r.cfg.txOptions("", ""), func(tx pgx.Tx) error {
		return tx.QueryRow(ctx, pruneBatchSQL, pgx.StrictNamedArgs{"project": p.ProjectID, "limit": limit, "after": *after,
			"clock_offset": r.cfg.Clock.Offset(), "window": r.cfg.RetentionWindow}).Scan(&n, &maxSeq)
	})
	if err != nil {
		return 0, fmt.Errorf("prune project %s: %w", p.ProjectID, err)
	}
	if n > 0 {
		*after = maxSeq
		res.Batches++
		res.PrunedByProject[p.ProjectID] += n
		res.LongestBatch = max(res.LongestBatch, time.Since(started))
		r.metrics.pruned(p.ProjectID, n)
	}
	return n, nil
}

// Task returns the retention sweep as a maintenance task.
func (r *Retention) Task() MaintenanceTask {
	return MaintenanceTask{Name: "outbox-retention", Run: func(ctx context.Context) (fmt.Stringer, error) {
		res, err := r.Sweep(ctx)
		return res, err
	}}
}

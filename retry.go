package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
)

// A failed event is not acknowledged. Its delivery row keeps the attempt count, the next
// attempt time (on the database clock) and the failure class, so the backoff survives a
// restart and a takeover by another process with the same identity. The stream waits for it:
// order is the contract. After Config.MaxAttempts failures one fenced transaction parks it as
// a dead letter, writes the consumer-poisoned audit row and moves the cursor past it.

// Delivery states.
const (
	stateRetrying        = "retrying"
	stateDead            = "dead"
	stateReplayRequested = "replay_requested"
	stateResolved        = "resolved"
)

// delivery is an open delivery row: a head-of-line retry or a replay request.
type delivery struct {
	sequence int64
	eventID  string
	state    string
	attempts int
	due      bool
	wait     time.Duration // until next_attempt_at, for a retry not yet due
}

// FailureUndecodableEvent is the class of a row the consumer cannot decode or deliver as it is
// (a deleted_at that is not finite, an identifier the writer would refuse): it is parked at
// once, since no retry can change it.
const FailureUndecodableEvent FailureClass = "undecodable_event"

// openDeliveriesSQL reads a consumer's head-of-line retries and replay requests. A retry falls
// due at its next_attempt_at, or a day after its last failure if that is sooner: the longest
// delay the configuration allows, and all the database accepts since it checks the column, so
// a next_attempt_at centuries ahead (or 'infinity') written before cannot hold a stream back
// for ever. The wait is computed without subtracting a time that may not be finite, and is
// capped at that day.
const openDeliveriesSQL = `
SELECT project_id, sequence, event_id, state, attempts,
       coalesce(due_at <= pg_catalog.now() + $3::interval + interval '1 millisecond', true),
       CASE WHEN due_at IS NULL OR due_at <= pg_catalog.now() + $3::interval THEN 0
            WHEN due_at >= pg_catalog.now() + $3::interval + interval '1 day' THEN 86400
            ELSE extract(epoch FROM due_at - (pg_catalog.now() + $3::interval))::float8
       END
FROM (
    SELECT project_id, sequence, event_id, state, attempts,
           least(next_attempt_at, last_failed_at + interval '1 day') AS due_at
    FROM lifecycle_consumer_deliveries
    WHERE consumer_id = $1 AND project_id = ANY ($2::text[]) AND state IN ('retrying', 'replay_requested')
) d
ORDER BY project_id, sequence`

// openDeliveries reads the open deliveries of projects. When the read of them all fails it
// reads each project alone and returns, with a *ProjectErrors, what the others have.
func (c *Consumer) openDeliveries(ctx context.Context, projects []string) (map[string][]delivery, error) {
	out, err := c.queryOpenDeliveries(ctx, projects)
	if err == nil || len(projects) < 2 || ctx.Err() != nil || !readIsolatable(err) {
		return out, err
	}
	out = map[string][]delivery{}
	failed := map[string]error{}
	for _, p := range projects {
		got, err := c.queryOpenDeliveries(ctx, []string{p})
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			failed[p] = err
			continue
		}
		out[p] = got[p]
	}
	if len(failed) > 0 {
		return out, &ProjectErrors{Op: "read open deliveries", Failed: failed}
	}
	return out, nil
}

func (c *Consumer) queryOpenDeliveries(ctx context.Context, projects []string) (map[string][]delivery, error) {
	rows, err := c.pool.Query(ctx, openDeliveriesSQL, c.id, projects, c.offset())
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string][]delivery{}
	for rows.Next() {
		var p string
		var d delivery
		var waitSeconds float64
		if err := rows.Scan(&p, &d.sequence, &d.eventID, &d.state, &d.attempts, &d.due, &waitSeconds); err != nil {
			return nil, err
		}
		d.wait = clampWait(waitSeconds)
		out[p] = append(out[p], d)
	}
	return out, rows.Err()
}

const lockDeliverySQL = `
SELECT attempts FROM lifecycle_consumer_deliveries
WHERE project_id = $1 AND consumer_id = $2 AND sequence = $3
FOR UPDATE`

const upsertRetryingSQL = `
INSERT INTO lifecycle_consumer_deliveries AS d
    (project_id, consumer_id, sequence, event_id, state, attempts, next_attempt_at, last_failure_class, first_failed_at, last_failed_at)
VALUES ($1, $2, $3, $4, 'retrying', $5, pg_catalog.now() + $7::interval + $6::interval, $8, pg_catalog.now() + $7::interval, pg_catalog.now() + $7::interval)
ON CONFLICT (project_id, consumer_id, sequence) DO UPDATE
SET state = 'retrying', attempts = excluded.attempts, next_attempt_at = excluded.next_attempt_at,
    last_failure_class = excluded.last_failure_class, last_failed_at = excluded.last_failed_at`

const upsertDeadSQL = `
INSERT INTO lifecycle_consumer_deliveries AS d
    (project_id, consumer_id, sequence, event_id, state, attempts, last_failure_class, first_failed_at, last_failed_at, parked_at)
VALUES ($1, $2, $3, $4, 'dead', $5, $7, pg_catalog.now() + $6::interval, pg_catalog.now() + $6::interval, pg_catalog.now() + $6::interval)
ON CONFLICT (project_id, consumer_id, sequence) DO UPDATE
SET state = 'dead', attempts = excluded.attempts, next_attempt_at = NULL, last_failure_class = excluded.last_failure_class,
    last_failed_at = excluded.last_failed_at, parked_at = excluded.parked_at`

const advanceCursorSQL = `
UPDATE lifecycle_consumer_cursors SET last_acked_sequence = $3, acked_at = pg_catalog.now()
WHERE project_id = $1 AND consumer_id = $2 AND (last_acked_sequence IS NULL OR last_acked_sequence < $3)`

// recordFailure persists one failed attempt of ev, parking it when the attempts are spent; it
// reports whether it parked (and so moved the cursor past ev).
func (c *Consumer) recordFailure(ctx context.Context, st *streamState, ev Event, class FailureClass) (parked bool, err error) {
	c.stats.failures.Add(1)
	c.metrics.failure(st.project, string(c.id), class)
	var attempts int
	err = c.fencedTx(ctx, st, func(tx pgx.Tx) error {
		err := tx.QueryRow(ctx, lockDeliverySQL, st.project, c.id, ev.Sequence).Scan(&attempts)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
		attempts++
		if attempts < c.cfg.MaxAttempts && class != FailureUndecodableEvent {
			_, err := tx.Exec(ctx, upsertRetryingSQL, st.project, c.id, ev.Sequence, ev.EventID, attempts,
				c.cfg.retryDelay(attempts), c.offset(), string(class))
			return err
		}
		parked = true
		if _, err := tx.Exec(ctx, upsertDeadSQL, st.project, c.id, ev.Sequence, ev.EventID, attempts, c.offset(), string(class)); err != nil {
			return err
		}
		if err := c.audit.WriteAuditTx(ctx, tx, AuditRecord{Action: AuditConsumerPoisoned, ProjectID: st.project,
			ConsumerID: c.id, EventID: ev.EventID, Sequence: ev.Sequence, Attempts: attempts}); err != nil {
			return fmt.Errorf("write poison audit: %w", err)
		}
		_, err = tx.Exec(ctx, advanceCursorSQL, st.project, c.id, ev.Sequence)
		return err
	})
	if err != nil {
		return false, fmt.Errorf("record failed delivery: %w", err)
	}
	fields := []zap.Field{zap.String("project_id", st.project), zap.Int64("sequence", ev.Sequence),
		zap.String("event_id", ev.EventID), zap.String("class", string(class)), zap.Int("attempts", attempts)}
	if !parked {
		delay := c.cfg.retryDelay(attempts)
		st.blocked, st.retryAt = true, c.now().Add(delay)
		c.log.Warn("delivery failed; the stream waits for the retry", append(fields, zap.Duration("retry_in", delay))...)
		return false, nil
	}
	st.acked, st.position = ev.Sequence, ev.Sequence
	if class != FailureUndecodableEvent {
		c.dispatch.applyToCache(ctx, ev)
	}
	c.stats.parked.Add(1)
	c.metrics.parked(st.project, string(c.id))
	c.log.Error("event parked as a dead letter; the stream moves on", fields...)
	return true, nil
}

// parkUndecodable parks a row that cannot be delivered as a dead letter of its own class, with
// the consumer-poisoned audit row, and moves the cursor past it in the same fenced
// transaction. Its task is left in the cache: what the row names cannot be trusted.
func (c *Consumer) parkUndecodable(ctx context.Context, st *streamState, row storedEvent) (bool, error) {
	c.log.Error("event cannot be decoded; parking it as a dead letter", zap.String("project_id", st.project),
		zap.Int64("sequence", row.Sequence), zap.String("event_id", row.EventID), zap.Error(row.bad))
	c.metrics.observeDispatch(st.project, string(c.id), Failed, 0)
	return c.recordFailure(ctx, st, row.Event, FailureUndecodableEvent)
}

const resolveRetriedSQL = `
UPDATE lifecycle_consumer_deliveries
SET state = 'resolved', attempts = attempts + 1, resolved_at = pg_catalog.now() + $4::interval, next_attempt_at = NULL
WHERE project_id = $1 AND consumer_id = $2 AND sequence = $3 AND state = 'retrying'`

// resolveRetried closes a retried event's delivery row and acknowledges it in one transaction.
func (c *Consumer) resolveRetried(ctx context.Context, st *streamState, ev Event) error {
	err := c.fencedTx(ctx, st, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, resolveRetriedSQL, st.project, c.id, ev.Sequence, c.offset()); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, advanceCursorSQL, st.project, c.id, ev.Sequence)
		return err
	})
	if err != nil {
		return fmt.Errorf("resolve retried delivery: %w", err)
	}
	st.acked = ev.Sequence
	c.log.Info("retried delivery succeeded", zap.String("project_id", st.project), zap.Int64("sequence", ev.Sequence), zap.String("event_id", ev.EventID))
	return nil
}

const readEventSQL = `SELECT ` + eventColumns + `
FROM lifecycle_outbox
WHERE project_id = $1 AND sequence = $2`

const replayResolvedSQL = `
UPDATE lifecycle_consumer_deliveries
SET state = 'resolved', attempts = attempts + 1, resolved_at = pg_catalog.now() + $4::interval
WHERE project_id = $1 AND consumer_id = $2 AND sequence = $3 AND state = 'replay_requested'
RETURNING attempts, coalesce(replay_requested_by, ''), coalesce(replay_reason, '')`

const replayMissingSQL = `
UPDATE lifecycle_consumer_deliveries SET state = 'dead', parked_at = pg_catalog.now() + $4::interval
WHERE project_id = $1 AND consumer_id = $2 AND sequence = $3 AND state = 'replay_requested'`

const replayFailedSQL = `
UPDATE lifecycle_consumer_deliveries
SET state = 'dead', attempts = attempts + 1, last_failure_class = $5,
    last_failed_at = pg_catalog.now() + $4::interval, parked_at = pg_catalog.now() + $4::interval
WHERE project_id = $1 AND consumer_id = $2 AND sequence = $3 AND state = 'replay_requested'`

// replay re-dispatches a dead letter an operator asked to replay. Only the consumer that owns
// the delivery row sees it; success resolves it with a consumer-replayed audit row, failure
// puts it back to dead with its count.
func (c *Consumer) replay(ctx context.Context, st *streamState, d delivery) error {
	rows, err := c.pool.Query(ctx, readEventSQL, st.project, d.sequence)
	if err != nil {
		return fmt.Errorf("read replayed event: %w", err)
	}
	evs, err := scanEvents(rows, 1)
	if err != nil {
		return fmt.Errorf("read replayed event: %w", err)
	}
	if len(evs) == 0 {
		// Retention keeps the events of unresolved dead letters, so this takes a manual delete;
		// put the request back to dead rather than trying on every scan.
		c.log.Error("replay requested for an event that is no longer stored; left as a dead letter", zap.String("project_id", st.project),
			zap.Int64("sequence", d.sequence), zap.String("event_id", d.eventID))
		return c.fencedTx(ctx, st, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, replayMissingSQL, st.project, c.id, d.sequence, c.offset())
			return err
		})
	}
	ev := evs[0].Event
	started := time.Now()
	outcome, class := Failed, FailureUndecodableEvent
	if evs[0].bad == nil {
		pctx, oev, span := c.processSpan(ctx, ObservedEvent{Event: ev, ConsumerID: c.id, Attempt: d.attempts + 1, Replay: true})
		outcome, class = c.dispatch.dispatch(pctx, oev, &c.run)
		endProcessSpan(span, outcome, class)
	}
	c.metrics.observeDispatch(st.project, string(c.id), outcome, time.Since(started))
	if outcome == Interrupted {
		return nil
	}
	fields := []zap.Field{zap.String("project_id", st.project), zap.Int64("sequence", ev.Sequence), zap.String("event_id", ev.EventID)}
	if outcome == Failed {
		c.stats.failures.Add(1)
		c.metrics.failure(st.project, string(c.id), class)
		err := c.fencedTx(ctx, st, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, replayFailedSQL, st.project, c.id, ev.Sequence, c.offset(), string(class))
			return err
		})
		if err != nil {
			return fmt.Errorf("record failed replay: %w", err)
		}
		c.log.Error("replay failed; the event is a dead letter again", append(fields, zap.String("class", string(class)))...)
		return nil
	}
	err = c.fencedTx(ctx, st, func(tx pgx.Tx) error {
		var attempts int
		var actor, reason string
		if err := tx.QueryRow(ctx, replayResolvedSQL, st.project, c.id, ev.Sequence, c.offset()).Scan(&attempts, &actor, &reason); err != nil {
			return err
		}
		// The audit row names who asked only if it is an identifier: a request written before
		// the database checked it could hold anything, and no free text reaches the sink.
		if (Operator{Actor: actor, Reason: reason}).Validate() != nil {
			c.log.Warn("replay request names no valid actor and reason; the audit row leaves them out",
				zap.String("project_id", st.project), zap.Int64("sequence", ev.Sequence))
			actor, reason = "", ""
		}
		return c.audit.WriteAuditTx(ctx, tx, AuditRecord{Action: AuditConsumerReplayed, ProjectID: st.project, ConsumerID: c.id,
			EventID: ev.EventID, Sequence: ev.Sequence, Attempts: attempts, Actor: actor, Reason: reason})
	})
	if err != nil {
		return fmt.Errorf("resolve replay: %w", err)
	}
	c.stats.replayed.Add(1)
	c.metrics.replayed(st.project, string(c.id))
	c.log.Info("dead letter replayed and resolved", fields...)
	return nil
}

package outbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// The delivery store: a consumer's rows in lifecycle_consumer_deliveries, read and written
// over DBTX (the fenced transaction, for every write). A failed event is not acknowledged. Its
// delivery row keeps the attempt count, the next attempt time (on the database clock) and the
// failure class, so the backoff survives a restart and a takeover by another process with the
// same identity. After Config.MaxAttempts failures one fenced transaction parks it as a dead
// letter, writes the consumer-poisoned audit row and moves the cursor past it.

// DeliveryState is the state of a delivery row, as stored and as DeadLetter.State shows it.
type DeliveryState string

// Delivery states.
const (
	DeliveryRetrying        DeliveryState = "retrying"         // the head-of-line event waits for its next attempt
	DeliveryDead            DeliveryState = "dead"             // parked after its last attempt
	DeliveryReplayRequested DeliveryState = "replay_requested" // an operator asked to replay a dead letter
	DeliveryResolved        DeliveryState = "resolved"         // delivered at last, replayed, or superseded
)

// delivery is an open delivery row: a head-of-line retry or a replay request.
type delivery struct {
	sequence int64
	eventID  string
	state    DeliveryState
	attempts int
	// dueAt is when a retry falls due, on the consumer's shifted clock (shiftedNow); zero when
	// it was due when read. The database computes the wait; the consumer adds it to the time
	// the read returned, so a retry never falls due here before it does in the row.
	dueAt time.Time
}

// dueBy reports whether the delivery's next attempt may run at now (shifted clock).
func (d *delivery) dueBy(now time.Time) bool { return d.dueAt.IsZero() || !now.Before(d.dueAt) }

// dueAfter turns what the database said of a retry (due now, or the wait until it is) into
// dueAt, from readAt, when the read returned.
func dueAfter(readAt time.Time, due bool, wait time.Duration) time.Time {
	if due {
		return time.Time{}
	}
	return readAt.Add(wait)
}

// FailureUndecodableEvent is the class of a row the consumer cannot decode or deliver as it is
// (a deleted_at that is not finite, an identifier the writer would refuse): it is parked at
// once, since no retry can change it.
const FailureUndecodableEvent FailureClass = "undecodable_event"

// deliveryStore reads and writes one consumer's delivery rows.
type deliveryStore struct {
	id    ConsumerID
	cfg   consumerConfig
	audit AuditSink
}

func (s *deliveryStore) offset() time.Duration { return s.cfg.Clock.Offset() }

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

// open reads the open deliveries of projects. When the read of them all fails it reads each
// project alone and returns, with a *ProjectErrors, what the others have.
func (s *deliveryStore) open(ctx context.Context, db DBTX, projects []string) (map[string][]delivery, error) {
	out, err := s.queryOpen(ctx, db, projects)
	if err == nil || len(projects) < 2 || ctx.Err() != nil || !readIsolatable(err) {
		return out, err
	}
	out = map[string][]delivery{}
	failed := map[string]error{}
	for _, p := range projects {
		got, err := s.queryOpen(ctx, db, []string{p})
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

func (s *deliveryStore) queryOpen(ctx context.Context, db DBTX, projects []string) (map[string][]delivery, error) {
	rows, err := db.Query(ctx, openDeliveriesSQL, s.id, projects, s.offset())
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	type row struct {
		project string
		d       delivery
		due     bool
		wait    time.Duration
	}
	var got []row
	for rows.Next() {
		var r row
		var waitSeconds float64
		if err := rows.Scan(&r.project, &r.d.sequence, &r.d.eventID, &r.d.state, &r.d.attempts, &r.due, &waitSeconds); err != nil {
			return nil, err
		}
		r.wait = clampWait(waitSeconds)
		got = append(got, r)
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	readAt := shiftedNow(s.cfg.Clock)
	out := map[string][]delivery{}
	for _, r := range got {
		r.d.dueAt = dueAfter(readAt, r.due, r.wait)
		out[r.project] = append(out[r.project], r.d)
	}
	return out, nil
}

const lockDeliverySQL = `
SELECT attempts FROM lifecycle_consumer_deliveries
WHERE project_id = $1 AND consumer_id = $2 AND sequence = $3
FOR UPDATE`

// upsertRetryingSQL records @attempts failed attempts of consumer @consumer to deliver event
// @event_id at @sequence of @project, the last of class @failure_class, and its next attempt
// @retry_delay from now, on the clock shifted by @clock_offset.
const upsertRetryingSQL = `
INSERT INTO lifecycle_consumer_deliveries AS d
    (project_id, consumer_id, sequence, event_id, state, attempts, next_attempt_at, last_failure_class, first_failed_at, last_failed_at)
VALUES (@project, @consumer, @sequence, @event_id, 'retrying', @attempts,
        pg_catalog.now() + @clock_offset::interval + @retry_delay::interval, @failure_class,
        pg_catalog.now() + @clock_offset::interval, pg_catalog.now() + @clock_offset::interval)
ON CONFLICT (project_id, consumer_id, sequence) DO UPDATE
SET state = 'retrying', attempts = excluded.attempts, next_attempt_at = excluded.next_attempt_at,
    last_failure_class = excluded.last_failure_class, last_failed_at = excluded.last_failed_at`

// upsertDeadSQL parks the delivery upsertRetryingSQL records, after its last attempt.
const upsertDeadSQL = `
INSERT INTO lifecycle_consumer_deliveries AS d
    (project_id, consumer_id, sequence, event_id, state, attempts, last_failure_class, first_failed_at, last_failed_at, parked_at)
VALUES (@project, @consumer, @sequence, @event_id, 'dead', @attempts, @failure_class,
        pg_catalog.now() + @clock_offset::interval, pg_catalog.now() + @clock_offset::interval, pg_catalog.now() + @clock_offset::interval)
ON CONFLICT (project_id, consumer_id, sequence) DO UPDATE
SET state = 'dead', attempts = excluded.attempts, next_attempt_at = NULL, last_failure_class = excluded.last_failure_class,
    last_failed_at = excluded.last_failed_at, parked_at = excluded.parked_at`

const advanceCursorSQL = `
UPDATE lifecycle_consumer_cursors SET last_acked_sequence = $3, acked_at = pg_catalog.now()
WHERE project_id = $1 AND consumer_id = $2 AND (last_acked_sequence IS NULL OR last_acked_sequence < $3)`

// recordFailureTx records one failed attempt of ev in tx: a retrying row with its next
// attempt time, or, when the attempts are spent (or no attempt can succeed), a dead letter
// with its consumer-poisoned audit row and the cursor moved past it. It returns the attempt
// count and whether it parked.
func (s *deliveryStore) recordFailureTx(ctx context.Context, tx pgx.Tx, project string, ev Event, class FailureClass) (attempts int, parked bool, err error) {
	err = tx.QueryRow(ctx, lockDeliverySQL, project, s.id, ev.Sequence).Scan(&attempts)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return 0, false, err
	}
	attempts++
	args := pgx.StrictNamedArgs{"project": project, "consumer": s.id, "sequence": ev.Sequence, "event_id": ev.EventID,
		"attempts": attempts, "failure_class": string(class), "clock_offset": s.offset()}
	if attempts < s.cfg.MaxAttempts && class != FailureUndecodableEvent {
		args["retry_delay"] = s.cfg.retryDelay(attempts)
		_, err := tx.Exec(ctx, upsertRetryingSQL, args)
		return attempts, false, err
	}
	if _, err := tx.Exec(ctx, upsertDeadSQL, args); err != nil {
		return 0, false, err
	}
	if err := s.audit.WriteAuditTx(ctx, tx, AuditRecord{Action: AuditConsumerPoisoned, ProjectID: project,
		ConsumerID: s.id, EventID: ev.EventID, Sequence: ev.Sequence, Attempts: attempts}); err != nil {
		return 0, false, fmt.Errorf("write poison audit: %w", err)
	}
	_, err = tx.Exec(ctx, advanceCursorSQL, project, s.id, ev.Sequence)
	return attempts, true, err
}

const resolveRetriedSQL = `
UPDATE lifecycle_consumer_deliveries
SET state = 'resolved', attempts = attempts + 1, resolved_at = pg_catalog.now() + $4::interval, next_attempt_at = NULL
WHERE project_id = $1 AND consumer_id = $2 AND sequence = $3 AND state = 'retrying'`

// resolveRetriedTx closes a retried event's delivery row and acknowledges it.
func (s *deliveryStore) resolveRetriedTx(ctx context.Context, tx pgx.Tx, project string, sequence int64) error {
	if _, err := tx.Exec(ctx, resolveRetriedSQL, project, s.id, sequence, s.offset()); err != nil {
		return err
	}
	_, err := tx.Exec(ctx, advanceCursorSQL, project, s.id, sequence)
	return err
}

const replayResolvedSQL = `
UPDATE lifecycle_consumer_deliveries
SET state = 'resolved', attempts = attempts + 1, resolved_at = pg_catalog.now() + $4::interval
WHERE project_id = $1 AND consumer_id = $2 AND sequence = $3 AND state = 'replay_requested'
RETURNING attempts, coalesce(replay_requested_by, ''), coalesce(replay_reason, '')`

const replayMissingSQL = `
UPDATE lifecycle_consumer_deliveries SET state = 'dead', parked_at = pg_catalog.now() + $4::interval
WHERE project_id = $1 AND consumer_id = $2 AND sequence = $3 AND state = 'replay_requested'`

// replayFailedSQL parks again, with one more attempt of class @failure_class, the replay of
// consumer @consumer's delivery at @sequence of @project, at the time of the clock shifted by
// @clock_offset.
const replayFailedSQL = `
UPDATE lifecycle_consumer_deliveries
SET state = 'dead', attempts = attempts + 1, last_failure_class = @failure_class,
    last_failed_at = pg_catalog.now() + @clock_offset::interval, parked_at = pg_catalog.now() + @clock_offset::interval
WHERE project_id = @project AND consumer_id = @consumer AND sequence = @sequence AND state = 'replay_requested'`

// replayMissingTx puts a replay request whose event is no longer stored back to dead.
func (s *deliveryStore) replayMissingTx(ctx context.Context, tx pgx.Tx, project string, sequence int64) error {
	_, err := tx.Exec(ctx, replayMissingSQL, project, s.id, sequence, s.offset())
	return err
}

// replayFailedTx puts a replay that failed back to dead, counting the attempt.
func (s *deliveryStore) replayFailedTx(ctx context.Context, tx pgx.Tx, project string, sequence int64, class FailureClass) error {
	_, err := tx.Exec(ctx, replayFailedSQL, pgx.StrictNamedArgs{"project": project, "consumer": s.id, "sequence": sequence,
		"failure_class": string(class), "clock_offset": s.offset()})
	return err
}

// replayResolvedTx resolves a replayed dead letter with its consumer-replayed audit row.
// warnActor is set when the request names no valid actor and reason: the audit row then
// leaves them out.
func (s *deliveryStore) replayResolvedTx(ctx context.Context, tx pgx.Tx, project string, ev Event) (warnActor bool, err error) {
	var attempts int
	var actor, reason string
	if err := tx.QueryRow(ctx, replayResolvedSQL, project, s.id, ev.Sequence, s.offset()).Scan(&attempts, &actor, &reason); err != nil {
		return false, err
	}
	// The audit row names who asked only if it is an identifier: a request written before
	// the database checked it could hold anything, and no free text reaches the sink.
	if (Operator{Actor: actor, Reason: reason}).Validate() != nil {
		warnActor, actor, reason = true, "", ""
	}
	return warnActor, s.audit.WriteAuditTx(ctx, tx, AuditRecord{Action: AuditConsumerReplayed, ProjectID: project, ConsumerID: s.id,
		EventID: ev.EventID, Sequence: ev.Sequence, Attempts: attempts, Actor: actor, Reason: reason})
}

package outbox

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"go.uber.org/zap"
)

// What the scan loop does with a failed attempt, a retried event that succeeded and a replay
// an operator asked for. The rows are the delivery store's (deliveries.go); every write goes
// through the lease keeper's fenced transaction, and the stream's state is the loop's. The
// stream waits for a failed event: order is the contract.

// recordFailure persists one failed attempt of ev, parking it when the attempts are spent; it
// reports whether it parked (and so moved the cursor past ev).
func (l *scanLoop) recordFailure(ctx context.Context, st *stream, ev Event, class FailureClass) (parked bool, err error) {
	l.stats.failures.Add(1)
	l.metrics.failure(st.project, string(l.id), class)
	var attempts int
	err = l.leases.fencedTx(ctx, st.project, st.epoch, func(tx pgx.Tx) error {
		var err error
		attempts, parked, err = l.store.recordFailureTx(ctx, tx, st.project, ev, class)
		return err
	})
	if err != nil {
		st.forgetOpen()
		return false, fmt.Errorf("record failed delivery: %w", err)
	}
	fields := []zap.Field{zap.String("project_id", st.project), zap.Int64("sequence", ev.Sequence),
		zap.String("event_id", ev.EventID), zap.String("class", string(class)), zap.Int("attempts", attempts)}
	if !parked {
		delay := l.cfg.retryDelay(attempts)
		// The row falls due at next_attempt_at, the database's now() at the write plus delay:
		// no later than this instance's clock now plus delay, which is when it retries.
		st.retryLater(delivery{sequence: ev.Sequence, eventID: ev.EventID, state: DeliveryRetrying, attempts: attempts,
			dueAt: shiftedNow(l.cfg.Clock).Add(delay)})
		l.log.Warn("delivery failed; the stream waits for the retry", append(fields, zap.Duration("retry_in", delay))...)
		return false, nil
	}
	st.parked(ev.Sequence)
	if class != FailureUndecodableEvent {
		l.dispatch.applyToCache(ctx, ev)
	}
	l.dispatch.handParked(ctx, ev)
	l.stats.parked.Add(1)
	l.metrics.parked(st.project, string(l.id))
	l.log.Error("event parked as a dead letter; the stream moves on", fields...)
	return true, nil
}

// parkUndecodable parks a row that cannot be delivered as a dead letter of its own class, with
// the consumer-poisoned audit row, and moves the cursor past it in the same fenced
// transaction. Its task is left in the cache: what the row names cannot be trusted.
func (l *scanLoop) parkUndecodable(ctx context.Context, st *stream, row storedEvent) (bool, error) {
	l.log.Error("event cannot be decoded; parking it as a dead letter", zap.String("project_id", st.project),
		zap.Int64("sequence", row.Sequence), zap.String("event_id", row.EventID), zap.Error(row.bad))
	l.metrics.observeDispatch(st.project, string(l.id), Failed, 0)
	return l.recordFailure(ctx, st, row.Event, FailureUndecodableEvent)
}

// resolveRetried closes a retried event's delivery row and acknowledges it in one transaction.
func (l *scanLoop) resolveRetried(ctx context.Context, st *stream, ev Event) error {
	err := l.leases.fencedTx(ctx, st.project, st.epoch, func(tx pgx.Tx) error {
		return l.store.resolveRetriedTx(ctx, tx, st.project, ev.Sequence)
	})
	if err != nil {
		st.forgetOpen()
		return fmt.Errorf("resolve retried delivery: %w", err)
	}
	st.resolved(ev.Sequence)
	l.log.Info("retried delivery succeeded", zap.String("project_id", st.project), zap.Int64("sequence", ev.Sequence), zap.String("event_id", ev.EventID))
	return nil
}

// replay re-dispatches a dead letter an operator asked to replay. Only the consumer that owns
// the delivery row sees it; success resolves it with a consumer-replayed audit row, failure
// puts it back to dead with its count.
func (l *scanLoop) replay(ctx context.Context, s *session, st *stream, d delivery) error {
	row, ok, err := readEventAt(ctx, l.pool, st.project, d.sequence)
	if err != nil {
		return fmt.Errorf("read replayed event: %w", err)
	}
	if !ok {
		// Retention keeps the events of unresolved dead letters, so this takes a manual delete;
		// put the request back to dead rather than trying on every scan.
		l.log.Error("replay requested for an event that is no longer stored; left as a dead letter", zap.String("project_id", st.project),
			zap.Int64("sequence", d.sequence), zap.String("event_id", d.eventID))
		return l.closedReplay(st, d, l.leases.fencedTx(ctx, st.project, st.epoch, func(tx pgx.Tx) error {
			return l.store.replayMissingTx(ctx, tx, st.project, d.sequence)
		}))
	}
	ev := row.Event
	outcome, class := Failed, FailureUndecodableEvent
	if row.bad == nil {
		outcome, class = s.attempt(ctx, ObservedEvent{Event: ev, ConsumerID: l.id, Attempt: d.attempts + 1, Replay: true})
	} else {
		l.metrics.observeDispatch(st.project, string(l.id), outcome, 0)
	}
	if outcome == Interrupted {
		return nil
	}
	fields := []zap.Field{zap.String("project_id", st.project), zap.Int64("sequence", ev.Sequence), zap.String("event_id", ev.EventID)}
	if outcome == Failed {
		l.stats.failures.Add(1)
		l.metrics.failure(st.project, string(l.id), class)
		err := l.closedReplay(st, d, l.leases.fencedTx(ctx, st.project, st.epoch, func(tx pgx.Tx) error {
			return l.store.replayFailedTx(ctx, tx, st.project, ev.Sequence, class)
		}))
		if err != nil {
			return fmt.Errorf("record failed replay: %w", err)
		}
		l.log.Error("replay failed; the event is a dead letter again", append(fields, zap.String("class", string(class)))...)
		return nil
	}
	var warnActor bool
	err = l.closedReplay(st, d, l.leases.fencedTx(ctx, st.project, st.epoch, func(tx pgx.Tx) error {
		var err error
		warnActor, err = l.store.replayResolvedTx(ctx, tx, st.project, ev)
		return err
	}))
	if warnActor {
		l.log.Warn("replay request names no valid actor and reason; the audit row leaves them out",
			zap.String("project_id", st.project), zap.Int64("sequence", ev.Sequence))
	}
	if err != nil {
		return fmt.Errorf("resolve replay: %w", err)
	}
	l.stats.replayed.Add(1)
	l.metrics.replayed(st.project, string(l.id))
	l.log.Info("dead letter replayed and resolved", fields...)
	return nil
}

// closedReplay records the outcome of the write that closed the replay request d (resolved it,
// or put it back to dead): it is no longer open, or, when the write failed, the stream's open
// deliveries are read again. It returns err.
func (l *scanLoop) closedReplay(st *stream, d delivery, err error) error {
	if err != nil {
		st.forgetOpen()
		return err
	}
	st.closeOpen(d.sequence)
	return nil
}

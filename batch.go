package outbox

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"
)

// QueuedEvent is the writer hook's insert queued on the host's pgx.Batch by QueueTaskDeleted.
type QueuedEvent struct {
	ev       Event
	queued   bool // false: the writer is disabled and nothing was queued
	read     bool // the batch's result for the insert was read
	inserted bool
	err      error
	span     trace.Span
}

// QueueTaskDeleted is RecordTaskDeletedTx for a host that sends the statements of its delete
// transaction in one pgx.Batch: it queues the hook's insert on b, so the event costs the
// delete no round trip of its own. Queue it after the statement that sets deleted_at has
// returned the stored value (the event's identity), for example with the audit row that
// follows, and send b in the delete transaction. Once the batch's results are read
// (BatchResults.Close), QueuedEvent.Result says what was recorded.
//
// Called from an observed context it refuses with a *FenceError and queues nothing.
func (w *Writer) QueueTaskDeleted(ctx context.Context, b *pgx.Batch, d TaskDeletion) (*QueuedEvent, error) {
	if b == nil {
		return nil, errors.New("queue task:deleted: nil batch")
	}
	ev, prior, err := w.prepare(ctx, d)
	if err != nil {
		return nil, err
	}
	q := &QueuedEvent{ev: ev}
	if w.disabled {
		return q, nil
	}
	q.queued = true
	sql, args := insertEventSQL, w.insertArgs(ev, prior)
	if w.trace.tracer != nil {
		var tc *string
		_, q.span, tc = w.startCreate(ctx, ev)
		sql = insertTracedEventSQL
		args["trace_context"] = tc
		if tc != nil {
			q.ev.traceContext = *tc
		}
	}
	b.Queue(sql, args).QueryRow(func(row pgx.Row) error {
		q.read = true
		err := row.Scan(&q.ev.OccurredAt)
		switch {
		case err == nil:
			q.inserted = true
		case errors.Is(err, pgx.ErrNoRows): // recorded before: the stored event is read in Result
		default:
			q.err = fmt.Errorf("record task:deleted: %w", err)
		}
		if q.span != nil {
			if q.err != nil {
				endSpan(q.span, q.err)
			} else {
				endSpan(q.span, nil, attrInserted.Bool(q.inserted))
			}
		}
		return q.err
	})
	return q, nil
}

// Result returns the event and whether this insert recorded it, as RecordTaskDeletedTx does.
// Call it after the batch's results were read, with the transaction the batch ran in: for a
// deletion recorded before, it reads the stored event there.
func (q *QueuedEvent) Result(ctx context.Context, tx pgx.Tx) (Event, bool, error) {
	switch {
	case !q.queued:
		return q.ev, false, nil
	case !q.read:
		return Event{}, false, errors.New("task:deleted result: the batch's results were not read (close its BatchResults first)")
	case q.err != nil:
		return Event{}, false, q.err
	case q.inserted:
		return q.ev, true, nil
	}
	if tx == nil {
		return Event{}, false, errors.New("task:deleted result: nil transaction")
	}
	return readRecorded(ctx, tx, q.ev)
}

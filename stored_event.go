package outbox

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// Reading outbox rows back as events, for the scan loop and for replays.

// eventColumns is what scanEvents decodes, in its order.
const eventColumns = `project_id, sequence, event_type, task_id, deleted_at, coalesce(prior_column, ''), archived,
       writer_process_id, occurred_at, payload_version, coalesce(trace_context, '')`

const readEventsSQL = `SELECT ` + eventColumns + `
FROM lifecycle_outbox
WHERE project_id = $1 AND sequence > $2
ORDER BY sequence
LIMIT $3`

const readEventSQL = `SELECT ` + eventColumns + `
FROM lifecycle_outbox
WHERE project_id = $1 AND sequence = $2`

// readEvents reads up to limit events of project numbered after after, in order.
func readEvents(ctx context.Context, db DBTX, project string, after int64, limit int) ([]storedEvent, error) {
	rows, err := db.Query(ctx, readEventsSQL, project, after, limit)
	if err != nil {
		return nil, fmt.Errorf("read events: %w", err)
	}
	return scanEvents(rows, limit)
}

// readEventAt reads the event of project numbered sequence; ok is false when none is stored.
func readEventAt(ctx context.Context, db DBTX, project string, sequence int64) (ev storedEvent, ok bool, err error) {
	rows, err := db.Query(ctx, readEventSQL, project, sequence)
	if err != nil {
		return storedEvent{}, false, err
	}
	evs, err := scanEvents(rows, 1)
	if err != nil || len(evs) == 0 {
		return storedEvent{}, false, err
	}
	return evs[0], true, nil
}

// storedEvent is an outbox row as read: the event, or why it cannot be delivered.
type storedEvent struct {
	Event
	// bad is why the row cannot be delivered as it is (a timestamp that is not finite, an
	// identifier the writer would have refused); Event then holds what could be read, its
	// Sequence always.
	bad error
}

// scanEvents decodes outbox rows without reflection (the drain path reads many of them) and
// formats each event's ID from its identity columns. A row that cannot be decoded, or that
// holds what the writer never writes, is returned with its reason instead of failing the batch:
// the consumer parks it as a dead letter and the stream goes on.
func scanEvents(rows pgx.Rows, capacity int) ([]storedEvent, error) {
	defer rows.Close()
	out := make([]storedEvent, 0, capacity)
	var checked rowChecks
	for rows.Next() {
		var e storedEvent
		var version int16
		var deletedAt, occurredAt pgtype.Timestamptz
		if err := rows.Scan(&e.ProjectID, &e.Sequence, &e.EventType, &e.TaskID, &deletedAt,
			&e.PriorColumn, &e.Archived, &e.WriterProcessID, &occurredAt, &version, &e.traceContext); err != nil {
			bad, ok := undecodableRow(rows, err)
			if !ok {
				return nil, fmt.Errorf("decode event: %w", err)
			}
			out = append(out, bad)
			continue
		}
		e.PayloadVersion = int(version)
		e.DeletedAt, e.OccurredAt = deletedAt.Time, occurredAt.Time
		e.bad = checked.check(&e.Event, deletedAt, occurredAt)
		if e.bad == nil {
			e.EventID = TaskDeletedEventID(e.TaskID, e.DeletedAt)
		} else {
			e.EventID = undecodableEventID(e.TaskID, deletedAt)
		}
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read events: %w", err)
	}
	return out, nil
}

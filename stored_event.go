package outbox

import (
	"cmp"
	"context"
	"fmt"
	"slices"

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

// readFirstEventsSQL is readEventsSQL for many projects in one statement: for each project in
// $1, up to $3 events numbered after its position in $2 (the arrays in step). It plans as one
// index range scan of lifecycle_outbox_project_sequence per project, like readEventsSQL. The
// built-ins are qualified: an unnest planted in a schema on the search path is not called (see
// migration 0005).
const readFirstEventsSQL = `SELECT ` + eventColumns + `
FROM ROWS FROM (pg_catalog.unnest($1::text[]), pg_catalog.unnest($2::bigint[])) AS c(asked_project, asked_after)
CROSS JOIN LATERAL (
    SELECT project_id, sequence, event_type, task_id, deleted_at, prior_column, archived,
           writer_process_id, occurred_at, payload_version, trace_context
    FROM lifecycle_outbox
    WHERE project_id = c.asked_project AND sequence > c.asked_after
    ORDER BY sequence
    LIMIT $3
) AS o`

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

// firstBatch is a project's first batch of a scan, read with the other projects': the events
// numbered after after, at most the batch size.
type firstBatch struct {
	after  int64
	events []storedEvent
}

// readFirstEvents reads in one statement up to limit events of each project numbered after its
// position (projects and after in step) and returns them by project: every project asked for
// has a batch, empty when nothing is stored past its position. capacity is how many rows are
// expected in all. A row that cannot be decoded is its project's, like the others.
func readFirstEvents(ctx context.Context, db DBTX, projects []string, after []int64, limit, capacity int) (map[string]firstBatch, error) {
	rows, err := db.Query(ctx, readFirstEventsSQL, projects, after, limit)
	if err != nil {
		return nil, fmt.Errorf("read events of %d projects: %w", len(projects), err)
	}
	evs, err := scanEvents(rows, capacity)
	if err != nil {
		return nil, fmt.Errorf("read events of %d projects: %w", len(projects), err)
	}
	out := make(map[string]firstBatch, len(projects))
	for i, p := range projects {
		out[p] = firstBatch{after: after[i]}
	}
	// The rows come project by project in sequence order as the plan reads them, but the
	// statement does not promise it; each project's batch is a run of the sorted rows.
	byStream := func(a, b storedEvent) int {
		return cmp.Or(cmp.Compare(a.ProjectID, b.ProjectID), cmp.Compare(a.Sequence, b.Sequence))
	}
	if !slices.IsSortedFunc(evs, byStream) {
		slices.SortFunc(evs, byStream)
	}
	for i := 0; i < len(evs); {
		p := evs[i].ProjectID
		j := i + 1
		for j < len(evs) && evs[j].ProjectID == p {
			j++
		}
		b, ok := out[p]
		if !ok {
			return nil, fmt.Errorf("read events of %d projects: a row of project %q, which was not asked for", len(projects), p)
		}
		b.events = evs[i:j:j]
		out[p] = b
		i = j
	}
	return out, nil
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

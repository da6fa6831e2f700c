package outbox

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// Reading outbox rows back as events, for the scan loop and for replays.

// The statements below read the columns scanEvents decodes, in its order (the prepare test
// checks they agree), from the rows of lifecycle_outbox_read (migration 0018): the stream
// numbered before schema 18, then the event log tick by tick. The last column is the event's
// key in the log, with which the next read continues inside a tick.

// readEventsSQL reads up to @limit events of @project numbered after @after, continuing after
// the key (@key_txid, @key_deleted_at, @key_task_id) of the event at @after when the caller has
// it. The casts make the call an exact match for the module's function.
const readEventsSQL = `
SELECT project_id, sequence, event_type, task_id, deleted_at, coalesce(prior_column, ''), archived,
       writer_process_id, occurred_at, payload_version, coalesce(trace_context, ''), txid::text
FROM lifecycle_outbox_read(@project::text, @after::bigint, @limit::integer,
                           @key_txid::text::xid8, @key_deleted_at::timestamptz, @key_task_id::text)`

// readFirstEventsSQL reads, for each project in $1 after its position in $2 (the arrays in step),
// its parts from the one holding its next event, whole, up to $3 events past the position,
// walking each tick's transactions once for all of them (migration 0022). It returns nothing for
// a project whose next event is in the frozen stream or in a part of more than $3 events, or
// whose parts do not all come back whole.
const readFirstEventsSQL = `
SELECT project_id, sequence, event_type, task_id, deleted_at, coalesce(prior_column, ''), archived,
       writer_process_id, occurred_at, payload_version, coalesce(trace_context, ''), txid::text
FROM lifecycle_outbox_read_parts($1::text[], $2::bigint[], $3::integer)`

// readTicksSQL reads up to $3 events of the projects in $1 in the ticks after $2, each with its
// tick and its part: the part's first sequence and its number of events (migration 0024). The
// events come unnumbered (the sequence column is 0): tickRead.served numbers them.
const readTicksSQL = `
SELECT project_id, 0::bigint AS sequence, event_type, task_id, deleted_at, coalesce(prior_column, ''), archived,
       writer_process_id, occurred_at, payload_version, coalesce(trace_context, ''), txid::text,
       tick_id, part_first_sequence, part_events
FROM lifecycle_outbox_read_ticks($1::text[], $2::bigint, $3::integer)`

// readTicksSinceSQL is readTicksSQL with the state of the ticks in the same snapshot: after each
// row's part come the newest tick, when it was taken, and when tick $4 was taken if it is still
// stored. With no event to return it returns one row of those three alone, the others NULL.
// It is a scan's whole start when its streams know their ticks (scanLoop.startByTick).
const readTicksSinceSQL = `
SELECT r.project_id, 0::bigint AS sequence, r.event_type, r.task_id, r.deleted_at, coalesce(r.prior_column, ''), r.archived,
       r.writer_process_id, r.occurred_at, r.payload_version, coalesce(r.trace_context, ''), r.txid::text,
       r.tick_id, r.part_first_sequence, r.part_events, n.tick_id, n.ticked_at, n.seen_at
FROM (SELECT t.tick_id, t.ticked_at, (SELECT s.ticked_at FROM lifecycle_tick s WHERE s.tick_id = $4::bigint) AS seen_at
      FROM lifecycle_tick t ORDER BY t.tick_id DESC LIMIT 1) n
LEFT JOIN lifecycle_outbox_read_ticks($1::text[], $2::bigint, $3::integer) r ON true`

// readEventSQL reads the one event numbered $2.
const readEventSQL = `
SELECT project_id, sequence, event_type, task_id, deleted_at, coalesce(prior_column, ''), archived,
       writer_process_id, occurred_at, payload_version, coalesce(trace_context, ''), txid::text
FROM lifecycle_outbox_read($1::text, $2::bigint - 1, 1, NULL, NULL, NULL)
WHERE sequence = $2`

// eventKey is where an event sits in the log: its transaction and identity. A read that has the
// key of the event at its position continues after it inside a tick without renumbering the
// tick from its start. The zero key (an event of the stream numbered before schema 18, or none
// known) makes the read number from the tick's start.
type eventKey struct {
	txid      string // the writing transaction's ID, as text; empty when unknown
	deletedAt time.Time
	taskID    string
}

// args are the key's three arguments of readEventsSQL.
func (k eventKey) args() (txid *string, deletedAt *time.Time, taskID *string) {
	if k.txid == "" {
		return nil, nil, nil
	}
	return &k.txid, &k.deletedAt, &k.taskID
}

// readEvents reads up to limit events of project numbered after after, in order; key is the
// key of the event at after, when known.
func readEvents(ctx context.Context, db DBTX, project string, after int64, limit int, key eventKey) ([]storedEvent, error) {
	kt, kd, kk := key.args()
	rows, err := db.Query(ctx, readEventsSQL, pgx.StrictNamedArgs{"project": project, "after": after, "limit": limit,
		"key_txid": kt, "key_deleted_at": kd, "key_task_id": kk})
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

// readFirstEvents reads in one statement the next events of each project (projects and after in
// step), up to limit, and returns them by project. A project it has nothing for (see
// readFirstEventsSQL, or nothing stored) is not in the map: it reads alone.
// capacity is how many rows are expected in all. A row that cannot be decoded is its
// project's, like the others.
func readFirstEvents(ctx context.Context, db DBTX, projects []string, after []int64, limit, capacity int) (map[string]firstBatch, error) {
	rows, err := db.Query(ctx, readFirstEventsSQL, projects, after, limit)
	if err != nil {
		return nil, fmt.Errorf("read events of %d projects: %w", len(projects), err)
	}
	evs, err := scanEvents(rows, capacity)
	if err != nil {
		return nil, fmt.Errorf("read events of %d projects: %w", len(projects), err)
	}
	asked := make(map[string]int64, len(projects))
	for i, p := range projects {
		asked[p] = after[i]
	}
	out := make(map[string]firstBatch, len(projects))
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
		a, ok := asked[p]
		if !ok {
			return nil, fmt.Errorf("read events of %d projects: a row of project %q, which was not asked for", len(projects), p)
		}
		out[p] = firstBatch{after: a, events: evs[i:j:j]}
		i = j
	}
	return out, nil
}

// eventPart is where a row of readTicksSQL comes from: its tick, and its project's part of that
// tick (the part's first sequence and number of events). The zero part marks a row that could
// not be decoded.
type eventPart struct {
	tick   int64
	first  int64
	events int32
}

// tickRead is what one read of ticks returned, as read (readTickEvents): the events and their
// parts, in step, and with readTicksSinceSQL the ticks' state. Consumers of one process share
// it (sharedTickEvents) and never change it.
type tickRead struct {
	events []storedEvent
	parts  []eventPart
	state  tickState
}

// tickState is the newest tick in a read's snapshot, when it was taken, and when the tick the
// reader saw last was taken (nil when that tick is no longer stored).
type tickState struct {
	newest   int64
	newestAt time.Time
	seenAt   *time.Time
}

// readTicksSince is readTickEvents with the ticks' state in the same snapshot
// (readTicksSinceSQL); seen is the tick whose time it also returns.
func readTicksSince(ctx context.Context, db DBTX, projects []string, tick int64, limit, capacity int, seen int64) (tickRead, error) {
	return queryTicks(ctx, db, readTicksSinceSQL, []any{projects, tick, limit, seen}, len(projects), tick, capacity, true)
}

// readTickEvents reads up to limit events of projects in the ticks after tick (readTicksSQL),
// unnumbered. capacity is how many rows are expected.
func readTickEvents(ctx context.Context, db DBTX, projects []string, tick int64, limit, capacity int) (tickRead, error) {
	return queryTicks(ctx, db, readTicksSQL, []any{projects, tick, limit}, len(projects), tick, capacity, false)
}

// queryTicks runs a read of ticks (sql with args, over projects after tick) and decodes its
// rows, with the ticks' state when withState is set.
func queryTicks(ctx context.Context, db DBTX, sql string, args []any, projects int, tick int64, capacity int, withState bool) (tickRead, error) {
	rows, err := db.Query(ctx, sql, args...)
	if err == nil {
		r := tickRead{parts: make([]eventPart, 0, capacity)}
		var state *tickState
		if withState {
			state = &r.state
		}
		if r.events, err = scanEventRows(rows, capacity, &r.parts, state); err == nil {
			return r, nil
		}
	}
	return tickRead{}, fmt.Errorf("read events of %d projects after tick %d: %w", projects, tick, err)
}

// served returns the first batch of each project of projects (after in step: its position)
// that the read can serve, up to limit events each. It numbers each part's events from the
// part's first sequence in the order every reader numbers them: by writing transaction, then
// deleted_at, then task ID in byte order (COLLATE "C"). A project is served from the part
// holding its next event on, while its parts came back whole (as many rows as the part counts)
// and each follows the one before: a part missing from the read (its tick not in it, rows the
// read's limit cut, a row deleted by hand, a tick gone) ends what the project is served, and a
// project whose next event is not in the read at all, or whose rows include one that could not
// be decoded, is not served (it reads alone, where a hole or a bad row is handled). The batches
// are the caller's own.
func (r tickRead) served(projects []string, after []int64, limit int) map[string]firstBatch {
	type part struct {
		eventPart
		rows []storedEvent
	}
	byProject := make(map[string][]part, len(projects))
	bad := make(map[string]bool)
	for i, e := range r.events {
		pt := r.parts[i]
		if pt.tick == 0 || e.key.txid == "" {
			bad[e.ProjectID] = true // undecodable, or no key to number it by
			continue
		}
		ps := byProject[e.ProjectID]
		j := slices.IndexFunc(ps, func(p part) bool { return p.tick == pt.tick })
		if j < 0 {
			ps, j = append(ps, part{eventPart: pt}), len(ps)
		}
		ps[j].rows = append(ps[j].rows, e)
		byProject[e.ProjectID] = ps
	}
	out := make(map[string]firstBatch, len(projects))
	for i, p := range projects {
		ps := byProject[p]
		if bad[p] || len(ps) == 0 {
			continue
		}
		slices.SortFunc(ps, func(a, b part) int { return cmp.Compare(a.first, b.first) })
		pos := after[i]
		var events []storedEvent
		next := pos + 1 // the sequence the next part must hold
		for _, pt := range ps {
			end := pt.first + int64(pt.events) - 1
			if end <= pos {
				continue // read before: the project's position is past it
			}
			if pt.first > next || (len(events) > 0 && pt.first != next) || len(pt.rows) != int(pt.events) {
				break // a part missing before it, or one that did not come back whole
			}
			if !numberPart(pt.rows, pt.first) {
				break
			}
			for _, e := range pt.rows {
				if e.Sequence > pos && len(events) < limit {
					events = append(events, e)
				}
			}
			next = end + 1
			if len(events) == limit {
				break
			}
		}
		if len(events) > 0 {
			out[p] = firstBatch{after: pos, events: events}
		}
	}
	return out
}

// numberPart sorts one part's events (all of them) into the readers' order and numbers them
// from first. It reports false when an event's transaction ID cannot be read as one.
func numberPart(rows []storedEvent, first int64) bool {
	txids := make(map[string]uint64, len(rows))
	for _, e := range rows {
		x, err := strconv.ParseUint(e.key.txid, 10, 64)
		if err != nil {
			return false
		}
		txids[e.key.txid] = x
	}
	slices.SortFunc(rows, func(a, b storedEvent) int {
		return cmp.Or(cmp.Compare(txids[a.key.txid], txids[b.key.txid]), a.key.deletedAt.Compare(b.key.deletedAt),
			strings.Compare(a.TaskID, b.TaskID))
	})
	for k := range rows {
		rows[k].Sequence = first + int64(k)
	}
	return true
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
	key eventKey // where the event sits in the log (zero for the stream numbered before it)
}

// scanEvents decodes outbox rows without reflection (the drain path reads many of them) and
// formats each event's ID from its identity columns. A row that cannot be decoded, or that
// holds what the writer never writes, is returned with its reason instead of failing the batch:
// the consumer parks it as a dead letter and the stream goes on.
func scanEvents(rows pgx.Rows, capacity int) ([]storedEvent, error) {
	return scanEventRows(rows, capacity, nil, nil)
}

// scanEventRows is scanEvents for the reads of ticks. When parts is not nil, each row ends with
// its tick and part (readTicksSQL), which go there, in step with the events; a row that cannot
// be decoded has the zero part. When state is not nil, the rows end with the ticks' state
// after their part (readTicksSinceSQL), which goes there; a row without an event (its project
// NULL) carries only that.
func scanEventRows(rows pgx.Rows, capacity int, parts *[]eventPart, state *tickState) ([]storedEvent, error) {
	defer rows.Close()
	out := make([]storedEvent, 0, capacity)
	var checked rowChecks
	// One set of destinations for every row, cleared before each.
	var (
		e                     storedEvent
		version               int16
		deletedAt, occurredAt pgtype.Timestamptz
		txid                  *string
		part                  eventPart
	)
	dest := []any{&e.ProjectID, &e.Sequence, &e.EventType, &e.TaskID, &deletedAt,
		&e.PriorColumn, &e.Archived, &e.WriterProcessID, &occurredAt, &version, &e.traceContext, &txid}
	if parts != nil {
		dest = append(dest, &part.tick, &part.first, &part.events)
	}
	var stateOnly []any // the destinations of a row with no event: its state alone
	if state != nil {
		dest = append(dest, &state.newest, &state.newestAt, &state.seenAt)
		stateOnly = make([]any, len(dest))
		copy(stateOnly[len(dest)-3:], dest[len(dest)-3:])
	}
	for rows.Next() {
		if state != nil && rows.RawValues()[0] == nil {
			if err := rows.Scan(stateOnly...); err != nil {
				return nil, fmt.Errorf("decode the ticks' state: %w", err)
			}
			continue
		}
		e, version, deletedAt, occurredAt, txid, part = storedEvent{}, 0, pgtype.Timestamptz{}, pgtype.Timestamptz{}, nil, eventPart{}
		if err := rows.Scan(dest...); err != nil {
			bad, ok := undecodableRow(rows, err)
			if !ok {
				return nil, fmt.Errorf("decode event: %w", err)
			}
			out = append(out, bad)
			if parts != nil {
				*parts = append(*parts, eventPart{})
			}
			continue
		}
		if parts != nil {
			*parts = append(*parts, part)
		}
		e.PayloadVersion = int(version)
		e.DeletedAt, e.OccurredAt = deletedAt.Time, occurredAt.Time
		e.bad = checked.check(&e.Event, deletedAt, occurredAt)
		if txid != nil && deletedAt.Valid && deletedAt.InfinityModifier == pgtype.Finite {
			e.key = eventKey{txid: *txid, deletedAt: deletedAt.Time, taskID: e.TaskID}
		}
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

package outbox

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strings"
	"time"
	"unicode"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// One project's trouble stays in that project. A step of the consumer's scan that serves
// several projects at once (the read of open deliveries, the combined read of events) and fails
// for some of them skips those this scan, or reads them alone, says so, and lets the others go
// on; a row that cannot be delivered is parked as a dead letter instead of wedging its stream;
// and a time read from the database is clamped before it becomes a wait.

// maxRetryWait is the longest a consumer waits for a delivery's next attempt before it looks
// again: the longest retry delay the configuration allows, and what the database's check on
// next_attempt_at enforces for every row written since.
const maxRetryWait = 24 * time.Hour

// clampWait turns the seconds until a delivery's next attempt into a wait within
// [0, maxRetryWait]: a next_attempt_at centuries ahead (written before the database checked it)
// would overflow a time.Duration into a negative wait and spin the consumer.
func clampWait(seconds float64) time.Duration {
	switch {
	case math.IsNaN(seconds) || seconds <= 0:
		return 0
	case seconds >= maxRetryWait.Seconds():
		return maxRetryWait
	}
	return time.Duration(seconds * float64(time.Second))
}

// readIsolatable reports whether a read over several projects that failed with err is worth
// repeating project by project: a row it could not decode or a statement the server refused
// may be one project's doing; a connection that could not be had, or a context that ended,
// would fail every project's read alike.
func readIsolatable(err error) bool {
	var ce *pgconn.ConnectError
	switch {
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded), errors.As(err, &ce), pgconn.SafeToRetry(err):
		return false
	}
	return true
}

// skipLogInterval is how often a project that keeps failing the same step is logged again; the
// metric counts every time.
const skipLogInterval = time.Minute

// logEvery says when a repeated failure is due to be logged again. Only the loop goroutine
// uses it.
type logEvery struct {
	last  map[string]time.Time
	count map[string]int
}

// due counts one failure under key and reports whether to log it now, with how many failures
// it stands for.
func (l *logEvery) due(key string, now time.Time) (int, bool) {
	if l.last == nil {
		l.last, l.count = map[string]time.Time{}, map[string]int{}
	}
	l.count[key]++
	if last, ok := l.last[key]; ok && now.Sub(last) < skipLogInterval {
		return 0, false
	}
	n := l.count[key]
	l.last[key], l.count[key] = now, 0
	return n, true
}

// rowChecks validates the identifiers of the rows of one read, remembering the last project
// and writer ID it accepted: they repeat from row to row, and the drain path reads many rows.
type rowChecks struct {
	project, writer string
}

// check reports why a decoded row cannot be delivered as it is, or nil. It is the writer's
// validation applied again on the way out, for rows that predate the database's checks.
func (r *rowChecks) check(e *Event, deletedAt, occurredAt pgtype.Timestamptz) error {
	if deletedAt.InfinityModifier != pgtype.Finite || !deletedAt.Valid {
		return invalid("Event.DeletedAt", "is not a finite time")
	}
	if occurredAt.InfinityModifier != pgtype.Finite || !occurredAt.Valid {
		return invalid("Event.OccurredAt", "is not a finite time")
	}
	if y := e.DeletedAt.UTC().Year(); y < 1 || y > 9999 {
		return invalid("Event.DeletedAt", "year %d is out of range", y)
	}
	if e.ProjectID != r.project {
		if err := ValidateProjectID(e.ProjectID); err != nil {
			return invalid("Event.ProjectID", "%v", err)
		}
		r.project = e.ProjectID
	}
	if e.WriterProcessID != r.writer {
		if err := checkID("writer process ID", e.WriterProcessID); err != nil {
			return invalid("Event.WriterProcessID", "%v", err)
		}
		r.writer = e.WriterProcessID
	}
	if err := validateTaskID("Event.TaskID", e.TaskID); err != nil {
		return err
	}
	if len(e.PriorColumn) > 128 || strings.IndexFunc(e.PriorColumn, unicode.IsControl) >= 0 {
		return invalid("Event.PriorColumn", "must be at most 128 bytes without control characters")
	}
	return nil
}

// CheckStoredEvent reports why an event read back from the outbox cannot be delivered as it
// is, or nil: the check the consumer applies to every row it reads, for rows written before
// the database checked them (a deleted_at or occurred_at that is not a finite time, or a year
// out of range; a project, writer process or task ID the writer would refuse; a prior column
// too long or holding control characters). ev holds what was read of the row, and deletedAt
// and occurredAt its two times as scanned. A reader of the outbox beside the consumer (the
// event stream's replay, package web) moves past a row it refuses, as the consumer does.
func CheckStoredEvent(ev Event, deletedAt, occurredAt pgtype.Timestamptz) error {
	var r rowChecks
	return r.check(&ev, deletedAt, occurredAt)
}

// undecodableRow salvages the sequence of a row that failed to scan at all, so that it can be
// parked; ok is false when even that is impossible.
func undecodableRow(rows pgx.Rows, scanErr error) (storedEvent, bool) {
	raw := rows.RawValues()
	fields := rows.FieldDescriptions()
	if len(raw) < 2 || len(fields) < 2 || raw[1] == nil {
		return storedEvent{}, false
	}
	var seq int64
	if err := rows.Conn().TypeMap().Scan(pgtype.Int8OID, fields[1].Format, raw[1], &seq); err != nil {
		return storedEvent{}, false
	}
	e := storedEvent{bad: fmt.Errorf("decode event: %w", scanErr)}
	e.Sequence = seq
	if raw[0] != nil {
		e.ProjectID = string(raw[0])
	}
	e.EventID = undecodableEventID("", pgtype.Timestamptz{})
	return e, true
}

// undecodableEventID names a row that cannot be delivered in its dead letter and audit row. It
// keeps the event ID's shape, with what could not be read replaced, so that it passes the
// database's check on event IDs and shows no control character to an operator.
func undecodableEventID(taskID string, deletedAt pgtype.Timestamptz) string {
	task := taskID
	if validateTaskID("Event.TaskID", task) != nil {
		task = "invalid-task-id"
	}
	var at string
	switch {
	case !deletedAt.Valid:
		at = "invalid-time"
	case deletedAt.InfinityModifier == pgtype.Infinity:
		at = "infinity"
	case deletedAt.InfinityModifier == pgtype.NegativeInfinity:
		at = "-infinity"
	default:
		at = deletedAt.Time.UTC().Format(eventIDTime)
	}
	return eventIDPrefix + task + ":" + at
}

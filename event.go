package outbox

import (
	"fmt"
	"strings"
	"time"
)

// EventTypeTaskDeleted is the only lifecycle event in the stream today. Adding another is a
// deliberate contract change: a migration widens the database's check and the payload grows a
// version.
const EventTypeTaskDeleted = "task:deleted"

// PayloadVersion is the version of the event payload this build writes and understands.
const PayloadVersion = 1

// eventIDTime is the canonical form of deletedAt inside an event ID: UTC, microseconds, the
// precision PostgreSQL stores.
const eventIDTime = "2006-01-02T15:04:05.000000Z"

const eventIDPrefix = "task-deleted:"

// Event is one task:deleted event as it is stored. It carries only what an observer needs:
// no mailbox prose, credentials or free-text audit metadata.
type Event struct {
	ProjectID       string    `json:"projectId"`
	Sequence        int64     `json:"sequence,omitempty"` // 0 until sequenced
	EventID         string    `json:"eventId"`
	EventType       string    `json:"type"`
	TaskID          string    `json:"taskId"`
	DeletedAt       time.Time `json:"deletedAt"`
	PriorColumn     string    `json:"priorColumn,omitempty"` // the task's column/status before the delete
	Archived        bool      `json:"archived"`              // whether the task was archived when deleted
	WriterProcessID string    `json:"writerProcessId"`
	OccurredAt      time.Time `json:"occurredAt"`
	PayloadVersion  int       `json:"payloadVersion"`

	traceContext string // the stored W3C trace context of its creation; "" when not traced
}

// TaskDeletedEventID is the identity of the first deletion of taskID at deletedAt:
// "task-deleted:<taskId>:<deletedAt>", deletedAt in canonical UTC with microseconds.
func TaskDeletedEventID(taskID string, deletedAt time.Time) string {
	b := make([]byte, 0, len(eventIDPrefix)+len(taskID)+1+len(eventIDTime))
	b = append(append(append(b, eventIDPrefix...), taskID...), ':')
	return string(deletedAt.UTC().AppendFormat(b, eventIDTime))
}

// ParseEventID splits a task:deleted event ID into its task ID and deletedAt.
func ParseEventID(id string) (taskID string, deletedAt time.Time, err error) {
	rest, ok := strings.CutPrefix(id, eventIDPrefix)
	if !ok {
		return "", time.Time{}, fmt.Errorf("event ID %q does not start with %q", id, eventIDPrefix)
	}
	n := len(eventIDTime)
	if len(rest) < n+2 || rest[len(rest)-n-1] != ':' {
		return "", time.Time{}, fmt.Errorf("event ID %q does not end with \":<deletedAt>\"", id)
	}
	taskID, stamp := rest[:len(rest)-n-1], rest[len(rest)-n:]
	deletedAt, err = time.Parse(eventIDTime, stamp)
	if err != nil || deletedAt.Format(eventIDTime) != stamp {
		return "", time.Time{}, fmt.Errorf("event ID %q has a deletedAt that is not canonical UTC with microseconds", id)
	}
	if err := validateTaskID("TaskID", taskID); err != nil {
		return "", time.Time{}, fmt.Errorf("event ID %q: %w", id, err)
	}
	return taskID, deletedAt, nil
}

// supported checks what can vary in a row decoded from the outbox (its identifiers were
// checked when it was written, and its ID is formatted from them): an event type or payload
// version this build does not know is reported, not guessed at.
func (e Event) supported() error {
	if e.EventType != EventTypeTaskDeleted {
		return invalid("Event.EventType", "%q is not a type this build understands", e.EventType)
	}
	if e.PayloadVersion < 1 || e.PayloadVersion > PayloadVersion {
		return invalid("Event.PayloadVersion", "%d is not a version this build understands (up to %d)", e.PayloadVersion, PayloadVersion)
	}
	return nil
}

// Validate checks an event in full: a type and payload version this build understands, every
// identifier, a positive sequence, deletedAt at microsecond precision, and the ID's agreement
// with the task and deletedAt it names. A reader of events that did not come from this
// process's own consumer (a web.StreamClient decoding its stream's frames) checks each with it.
func (e Event) Validate() error {
	if err := e.supported(); err != nil {
		return err
	}
	if err := ValidateProjectID(e.ProjectID); err != nil {
		return invalid("Event.ProjectID", "%v", err)
	}
	if e.Sequence < 1 {
		return invalid("Event.Sequence", "must be positive (got %d)", e.Sequence)
	}
	if err := validateTaskID("Event.TaskID", e.TaskID); err != nil {
		return invalid("Event.TaskID", "%v", err)
	}
	if e.DeletedAt.Nanosecond()%1000 != 0 {
		return invalid("Event.DeletedAt", "%s has sub-microsecond precision", e.DeletedAt.Format(time.RFC3339Nano))
	}
	if e.EventID != TaskDeletedEventID(e.TaskID, e.DeletedAt) {
		return invalid("Event.EventID", "%q does not match task %q deleted at %s", e.EventID, e.TaskID, e.DeletedAt.UTC().Format(eventIDTime))
	}
	if e.WriterProcessID == "" {
		return invalid("Event.WriterProcessID", "is empty")
	}
	return nil
}

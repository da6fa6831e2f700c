package outbox

import (
	"errors"
	"fmt"

	"fusion/outbox/internal/migrate"
)

var (
	// ErrObservedContext is returned, wrapped in a *FenceError, when a writer-owned side effect
	// (recording a deletion event, the delete itself, its audit row, its mailbox notice) is
	// attempted from an observed context. Observers must never repeat the writer's work.
	ErrObservedContext = errors.New("writer-owned side effect refused in an observed context")

	// ErrLeaseLost means a fenced write found that another process holds the consumer's lease
	// now (or that the lease expired). The write did nothing.
	ErrLeaseLost = errors.New("consumer lease lost")

	// ErrConsumerRetired means the consumer identity was retired by an operator. A retired
	// identity cannot take a lease; un-retiring is a deliberate operator action.
	ErrConsumerRetired = errors.New("consumer identity is retired")

	// ErrConsumerStopped is returned by Consumer.Start after Stop was called (before Start, or
	// while Start was still running): a stopped consumer cannot be started again, since
	// nothing would stop it. Build a new one.
	ErrConsumerStopped = errors.New("consumer stopped: a stopped consumer cannot be started again")

	// ErrUnknownConsumer means no cursor exists for the (project, consumer) asked about.
	ErrUnknownConsumer = errors.New("unknown consumer")

	// ErrNotDeadLetter means a replay was requested for a delivery that is not parked as dead.
	ErrNotDeadLetter = errors.New("delivery is not a dead letter")

	// ErrSchemaBehind, ErrSchemaAhead and ErrSchemaChecksum are returned by VerifySchema.
	ErrSchemaBehind   = migrate.ErrBehind
	ErrSchemaAhead    = migrate.ErrAhead
	ErrSchemaChecksum = migrate.ErrChecksum

	// ErrSchemaDrift is returned by VerifySchema when the version and checksums match but an
	// object the isolation rests on was changed by hand: row-level security disabled or not
	// forced, a policy dropped, a function's search_path no longer pinned, or one of the owner's
	// functions (ticking, adoption, pruning) made executable by PUBLIC.
	ErrSchemaDrift = errors.New("database objects differ from what the module's migrations made")
)

// FenceError says which writer-owned operation an observed context attempted.
type FenceError struct {
	Operation string // e.g. "record task:deleted", "mailbox notice"
}

func (e *FenceError) Error() string {
	return fmt.Sprintf("%s: %v", e.Operation, ErrObservedContext)
}

// Unwrap makes errors.Is(err, ErrObservedContext) true.
func (e *FenceError) Unwrap() error { return ErrObservedContext }

// ValidationError is bad input: a field (of the config, an identity, an event) and what is
// wrong with it. Nothing was written when it is returned.
type ValidationError struct {
	Field  string
	Reason string
}

func (e *ValidationError) Error() string { return e.Field + ": " + e.Reason }

func invalid(field, format string, args ...any) error {
	return &ValidationError{Field: field, Reason: fmt.Sprintf(format, args...)}
}

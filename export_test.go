package outbox

import "context"

// Test hooks, compiled only into this package's tests.

// PauseHeartbeat freezes or thaws a consumer's heartbeat, standing in for a process stopped
// past its lease.
func PauseHeartbeat(c *Consumer, paused bool) { c.heartbeatPaused.Store(paused) }

// HeartbeatNow runs one heartbeat round synchronously.
func HeartbeatNow(ctx context.Context, c *Consumer) { c.heartbeat(ctx) }

// The retention batch's statements, so a test can hold one batch open and show that a delete
// transaction does not wait for it.
const (
	PruneBatchSQL  = pruneBatchSQL
	RecordFloorSQL = recordFloorSQL
)

// ValidateEvent exposes the check the consumer applies to every row it decodes.
func ValidateEvent(e Event) error { return e.validate() }

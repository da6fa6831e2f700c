package outbox

import "context"

// Test hooks, compiled only into this package's tests.

// PauseHeartbeat freezes or thaws a consumer's heartbeat, standing in for a process stopped
// past its lease.
func PauseHeartbeat(c *Consumer, paused bool) { c.heartbeatPaused.Store(paused) }

// HeartbeatNow runs one heartbeat round synchronously.
func HeartbeatNow(ctx context.Context, c *Consumer) { c.heartbeat(ctx) }

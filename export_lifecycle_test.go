package outbox

import "context"

// Test hooks of the consumer's lifecycle and scan loop, compiled only into this package's tests.

// HoldRunnerStart has r's Start call hold, with Start's context, just before it starts the
// consumer.
func HoldRunnerStart(r *Runner, hold func(ctx context.Context)) { r.beforeConsumerStart = hold }

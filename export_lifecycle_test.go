package outbox

import "context"

// Test hooks of the consumer's lifecycle and scan loop, compiled only into this package's tests.

// The lifecycle work's statements join Statements here, in a file of their own.
func init() { Statements["cursorSQL"] = cursorSQL }

// HoldConsumerStart has o's Start call hold, with Start's context, just before it starts the
// consumer.
func HoldConsumerStart(o *Outbox, hold func(ctx context.Context)) { o.beforeConsumerStart = hold }

// OnLoopRest has c's scan loop call fn each time it waits with nothing armed but the poll
// interval. Set it before Start.
func OnLoopRest(c *Consumer, fn func()) { c.loop.rest = fn }

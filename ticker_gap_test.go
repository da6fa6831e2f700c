package outbox

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestTickGap: the elected ticker's gap between ticks, without a database (ticker.go). It
// doubles, up to TickBusyWait, each time its consumer is still busy when a tick falls due;
// halves, down to TickFloor, each time the consumer had rested for half the gap or more; and
// stays otherwise.
func TestTickGap(t *testing.T) {
	t.Parallel()
	const ms = time.Millisecond
	g := tickGap{floor: 2 * ms, ceiling: 25 * ms, cur: 2 * ms}
	var seen []time.Duration
	step := func(busy bool, idle time.Duration) {
		if busy {
			g.busy()
		} else {
			g.rested(idle)
		}
		seen = append(seen, g.cur)
	}
	for range 5 {
		step(true, 0) // a consumer behind: 4, 8, 16, then the ceiling
	}
	step(false, 10*ms) // rested, but for less than half the gap: it stays
	step(false, 13*ms) // half the gap or more: it halves
	step(false, 0)     // just rested: it stays
	step(true, 0)
	for range 6 {
		step(false, time.Hour) // the consumers keep up: back to the floor, not below
	}
	require.Equal(t, []time.Duration{4 * ms, 8 * ms, 16 * ms, 25 * ms, 25 * ms,
		25 * ms, 12500 * time.Microsecond, 12500 * time.Microsecond, 25 * ms,
		12500 * time.Microsecond, 6250 * time.Microsecond, 3125 * time.Microsecond, 2 * ms, 2 * ms, 2 * ms}, seen)

	off := tickGap{floor: 2 * ms, ceiling: 2 * ms, cur: 2 * ms} // TickBusyWait = TickFloor
	off.busy()
	require.Equal(t, 2*ms, off.cur, "no pacing: the gap never leaves TickFloor")
}

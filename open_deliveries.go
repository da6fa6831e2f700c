package outbox

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"
)

// What the scan loop knows of its open deliveries (stream.open), and when it reads them
// again. A consumer's open deliveries in a project (its head-of-line retry, the replays an
// operator asked for) change only when:
//   - this instance writes one (a failure recorded, a retry resolved, a dead letter parked, a
//     replay resolved): it records what it wrote in the same step, or, when the write's outcome
//     is unknown, reads them again on its next scan (stream.forgetOpen);
//   - it gains the project's lease: another process of the identity may have written some
//     while it held the lease (streams.sync);
//   - an operator asks for a replay: Admin.RequestReplay sends a hint on Config.TickChannel
//     once its request committed, and the consumer it names reads the project's open
//     deliveries on its next scan of it (listen.go). A hint only causes that read; a forged
//     one costs one. A lost hint (the consumer was not listening, the operator's Admin was
//     given another channel, a pooler without ListenDSN) costs at most TickFallbackInterval:
//     a full scan reads every leased project's open deliveries again once that has passed since
//     the last such read, on the consumer's clock. A reconnected LISTEN connection has them
//     read at once.
//
// So a scan reads them only for the projects that need it, in one statement, and most scans
// read none: with K consumers, a tick costs the primary K reads of heads and events (or none,
// reading from a standby) rather than K more reads of deliveries. A retry's due time is in
// what was read (delivery.dueAt); the loop arms its timer from it.

// openToRead lists the projects of leased whose open deliveries the scan must read: every one
// on a full scan once TickFallbackInterval has passed since they were last all read, else those
// not known.
func (l *scanLoop) openToRead(leased []string, full bool) []string {
	if now := shiftedNow(l.cfg.Clock); full && !now.Before(l.openReadAt.Add(l.cfg.TickFallbackInterval)) {
		l.openReadAt = now
		return leased
	}
	return l.streams.openUnknown(leased)
}

// skipFailedOf is skipFailed for a step that ran over only some of the projects (of): an error
// that is not a *ProjectErrors drops those, and the others go on.
func (l *scanLoop) skipFailedOf(step string, projects, of []string, err error) (kept []string, failed bool) {
	if err == nil {
		return projects, false
	}
	var pe *ProjectErrors
	if !errors.As(err, &pe) {
		failed := make(map[string]error, len(of))
		for _, p := range of {
			failed[p] = err
		}
		err = &ProjectErrors{Op: step, Failed: failed}
	}
	return l.skipFailed(step, projects, err)
}

// hintTicker tells this consumer's ticker, the elected one, that events committed which no
// tick has numbered: its poll's read of heads found them (loopHeadsUntickedSQL), which happens
// when a writer's hint was lost (the writer died between its commit and its hint, or its
// notification failed). The elected ticker otherwise ticks once per TickFallbackInterval when
// it hears no hint, so this bounds the delivery of such an event by the elected consumer's
// poll interval, plus a tick and a scan.
func (l *scanLoop) hintTicker() {
	l.unticked = false
	if l.tickNow == nil {
		return
	}
	l.stats.tickHints.Add(1)
	l.tickNow()
}

// checkUnticked asks whether events committed that no tick numbered, with a statement of its
// own: for the elected ticker's consumer when it holds no lease, so reads no heads.
func (l *scanLoop) checkUnticked(ctx context.Context) {
	err := l.pool.QueryRow(ctx, untickedSQL).Scan(&l.unticked)
	if err != nil {
		if n, ok := l.skipLog.due("check for events not ticked", time.Now()); ok && ctx.Err() == nil {
			l.log.Warn("could not check for events committed without a tick; the ticker ticks within TickFallbackInterval anyway",
				zap.Int("times_since_last_logged", n), zap.Error(err))
		}
		return
	}
	if l.unticked {
		l.hintTicker()
	}
}

// names reports whether e names project p as failed; a nil e names none.
func (e *ProjectErrors) names(p string) bool {
	if e == nil {
		return false
	}
	_, ok := e.Failed[p]
	return ok
}

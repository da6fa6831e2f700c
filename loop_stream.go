package outbox

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"time"
)

// A project stream as the scan loop sees it, and what follows from it alone: where the next read
// starts, whether the head-of-line event waits for its retry, whether the stream is reconciled
// before it is read, which cursor write it owes and when. Nothing here reads or writes the
// database: the loop (loop.go, retry.go, reconcile.go) does, asks a stream what to do, and tells
// it what happened. Only the loop goroutine uses them.

// stream is the loop's view of one project stream.
type stream struct {
	project  string
	lease    uint64 // the lease (leaseTable's grant number) this stream belongs to
	epoch    int64  // lease epoch this stream belongs to; 0 before the first lease
	acked    int64  // durable cursor; -1 when the cursor is NULL (never positioned)
	position int64  // dispatched through; position > acked means acknowledgements are pending
	// delivered is the highest sequence this instance delivered: re-deliveries below it are
	// suppressed. deliveredID is the event delivered there. When a new lease moves the position
	// back below delivered, the event stored there now must still be this one, or the history
	// was rewritten (a restored database) and nothing is suppressed: checkDelivered says that
	// is still to be checked.
	delivered      int64
	deliveredID    string
	checkDelivered bool
	// rewound: a head read after the stream reached its position stood below it, which only a
	// restored database does. The position and acked are then stale: the stream restarts
	// from its durable cursor before it is read again.
	rewound bool
	// retryDue is when the blocked head-of-line event falls due, on the consumer's shifted
	// clock (see shiftedNow); zero when the stream waits for no retry. An absolute time, so a
	// timer armed later waits only what is left.
	retryDue time.Time
	found    bool // the last scan had events or deliveries to look at
	// progressed: the last scan moved the stream forward. A project waiting on a retry makes
	// no progress, so it gets no follow-up scans.
	progressed bool
	// key is the log key of the event at position, when this instance read it: the next read
	// continues after it inside a tick. Valid only while keyAt == position.
	key   eventKey
	keyAt int64
	// unackedSince is when the stream first dispatched beyond its durable cursor (zero when
	// nothing waits): its cursor is written AckInterval later at the latest.
	unackedSince time.Time
	// open are the stream's open deliveries (head-of-line retries, replay requests) as this
	// instance last read or wrote them, in sequence order; openKnown says they are current.
	// Under the lease nothing but this instance writes them, except an operator asking for a
	// replay (whose hint, or the periodic read, makes them stale): so they are read only when a
	// lease is gained, after a hint, every TickFallbackInterval, and after a write whose outcome
	// is unknown. open is never changed in place: a scan may hold the slice it started with.
	open      []delivery
	openKnown bool
	// readAlone: the project failed when read alone after a combined read failed. It reads
	// alone, so that the others' combined read succeeds, until it reads alone without failing.
	readAlone bool
	// tickSeen is the newest tick of the read of heads after whose scan the stream stood at its
	// head: its next event is in a later tick, where the scan's first read looks for it (see
	// scanLoop.readCombined). 0 when not known.
	tickSeen int64
}

// takeLease moves the stream to lease ls when it is a new one: it starts from the durable
// cursor the lease came with. What this instance delivered beyond it is suppressed, once
// checked to be still what is stored. Another process of the identity may have held the lease
// meanwhile and written retries or dead letters: what this instance knew of them is read again.
func (st *stream) takeLease(ls lease) {
	if st.lease == ls.grant {
		return
	}
	st.lease, st.epoch, st.acked, st.position, st.keyAt = ls.grant, ls.epoch, ls.acked, max(ls.acked, 0), -1
	st.checkDelivered = st.delivered > st.position
	st.open, st.openKnown = nil, false
	st.tickSeen = 0
}

// blocked reports whether the head-of-line event waits for its retry.
func (st *stream) blocked() bool { return !st.retryDue.IsZero() }

// unblock forgets that the stream waits for a retry: its lease is gone, or a step failed for
// it and the scan skipped it. Its due time would otherwise keep firing the loop's retry timer at
// once, a full scan each time; the next scan of the stream finds the retry again.
func (st *stream) unblock() { st.retryDue = time.Time{} }

// beginScan starts a scan of the stream at head, with the open deliveries the scan read or
// knew, and returns where the stream starts (for endScan).
func (st *stream) beginScan(head Head, open []delivery) (start int64) {
	st.unblock()
	// Whether this scan had anything to do: the wake limiter defers notifications only for
	// projects whose last notified scan found nothing.
	st.found = head.LastSequence > st.position || len(open) > 0
	return st.position
}

// endScan records whether the scan that started at start moved the stream.
func (st *stream) endScan(start int64) { st.progressed = st.position > start }

// sawHead takes a head read of the stream. A head below the position moves the stream back
// to its cursor (rewound), as does a restore of the ticks (restored) once it has moved.
func (st *stream) sawHead(h Head, restored bool) {
	if h.LastSequence < st.position || (restored && st.position > 0) {
		st.rewound = true
	}
}

// restartAt restarts a rewound stream from its durable cursor, as a new lease does.
func (st *stream) restartAt(cursor int64) {
	st.rewound = false
	st.unblock()
	st.acked, st.position, st.keyAt = cursor, max(cursor, 0), -1
	st.checkDelivered = st.delivered > st.position
	st.tickSeen = 0
}

// scanned notes where a scan that did not fail left the stream: at head (read with the newest
// tick tick), its next event is in a later tick.
func (st *stream) scanned(head Head, tick int64) {
	if st.position >= head.LastSequence && !st.rewound {
		st.tickSeen = tick
	}
}

// reconcileReason says why the stream must be reconciled before it is read, if it must.
// newCursor is Config.NewCursor.
func (st *stream) reconcileReason(head Head, newCursor NewCursorPolicy) (ReconcileReason, bool) {
	switch {
	case st.acked < 0 && newCursor == NewCursorOldest && head.PrunedThrough == 0:
		return "", false // a new cursor starts before the first event
	case st.acked < 0:
		return ReasonMissingCursor, true
	case st.acked > head.LastSequence:
		return ReasonCursorAheadOfHead, true
	case st.acked < head.PrunedThrough:
		return ReasonCursorBelowPrunedFloor, true
	}
	return "", false
}

// reconciled restarts every in-memory position at head, where the reconciliation moved the
// cursor: sequences above it are new events even if this instance delivered events under
// those numbers before (a database restored to an older head reuses them). The retries at or
// below head were resolved with the cursor.
func (st *stream) reconciled(head int64) {
	st.supersedeOpen(head)
	st.acked, st.position, st.delivered, st.deliveredID, st.checkDelivered = head, head, head, "", false
	st.keyAt = -1
	st.unblock()
}

// checkedDelivered takes what is stored now at delivered, after a new lease moved the
// position back below it: the event's ID, or stored false when nothing is. Unless it is the
// event this instance delivered there, the history was rewritten (a restored database numbers
// new events with sequences it delivered before): nothing is suppressed as a re-delivery, and
// rewritten is set.
func (st *stream) checkedDelivered(storedID string, stored bool) (rewritten bool) {
	st.checkDelivered = false
	if stored && storedID == st.deliveredID {
		return false
	}
	st.delivered, st.deliveredID = st.position, ""
	return true
}

// readKey is the key the next read of the stream continues after, or the zero key.
func (st *stream) readKey() eventKey {
	if st.keyAt != st.position || st.position == 0 {
		return eventKey{}
	}
	return st.key
}

// readAhead says whether the stream takes part in the scan's combined first read (see
// scanLoop.readFirst), and how many events it may bring: not when it is at its head, reads
// alone, is reconciled first (nothing below the head is read), or its next event waits for a
// retry not yet due at now (shifted clock). open are the deliveries the scan knows.
func (st *stream) readAhead(head Head, open []delivery, now time.Time, newCursor NewCursorPolicy, batchSize int) (events int, ok bool) {
	if st.position >= head.LastSequence || st.readAlone {
		return 0, false
	}
	if _, ok := st.reconcileReason(head, newCursor); ok {
		return 0, false
	}
	if headOfLineRetry(open, st.position).blocks(st.position, now) {
		return 0, false
	}
	return int(min(head.LastSequence-st.position, int64(batchSize))), true
}

// takesFirst reports whether the batch read ahead for the stream (nil when none) starts where
// the stream is now: a reconciliation may have moved it since.
func (st *stream) takesFirst(first *firstBatch) bool {
	return first != nil && first.after == st.position && len(first.events) > 0 && first.events[0].Sequence == st.position+1
}

// readAloneAfter notes how a read of the stream alone fared: a failure other than a lost lease
// or a stop keeps it out of the combined read, a success lets it back in.
func (st *stream) readAloneAfter(err error) {
	switch {
	case err == nil:
		st.readAlone = false
	case errors.Is(err, ErrLeaseLost), errors.Is(err, context.Canceled):
	default:
		st.readAlone = true
	}
}

// headOfLineRetry is the retrying delivery among open that a stream positioned at position
// has still to get past, or nil. Only the first retrying delivery counts: a stream has one head
// of line.
func headOfLineRetry(open []delivery, position int64) *delivery {
	for i := range open {
		if open[i].state == DeliveryRetrying {
			if open[i].sequence <= position {
				return nil // superseded, for example by a reconciliation
			}
			return &open[i]
		}
	}
	return nil
}

// blocks reports whether the retry d (nil for none) keeps a stream positioned at position from
// going on at now (shifted clock): it is the stream's next event and not yet due.
func (d *delivery) blocks(position int64, now time.Time) bool {
	return d != nil && d.sequence == position+1 && !d.dueBy(now)
}

// blockOn has the stream wait for the retry r when r blocks it at now (see delivery.blocks),
// and reports whether it does.
func (st *stream) blockOn(r *delivery, now time.Time) bool {
	if !r.blocks(st.position, now) {
		return false
	}
	st.retryDue = r.dueAt
	return true
}

// errHole is a read that skipped sequences: the event at next is counted but not stored.
type errHole struct{ next, found int64 }

func (e errHole) Error() string {
	return fmt.Sprintf("sequence %d is missing (read %d next)", e.next, e.found)
}

// admit takes the next event read for the stream: it must be the one after the position. A
// later one is a hole (errHole); an earlier one a read out of order. The stream then knows the
// event's key, for the read after it.
func (st *stream) admit(row storedEvent) error {
	seq := row.Sequence
	if seq > st.position+1 {
		return errHole{next: st.position + 1, found: seq}
	}
	if seq != st.position+1 {
		return fmt.Errorf("project %s: read sequence %d after %d", st.project, seq, st.position)
	}
	st.key, st.keyAt = row.key, seq // the key of the event at position, once it moves there
	return nil
}

// redelivered reports whether the event at sequence is one this instance delivered before a
// lease change: a re-delivery, which the stream passes without handing it over.
func (st *stream) redelivered(sequence int64) bool {
	if sequence > st.delivered {
		return false
	}
	st.position = sequence
	return true
}

// attemptOf is the attempt that delivering the event at sequence makes: the retry's next one
// when retrying (nil for none) is that event, else the first.
func attemptOf(retrying *delivery, sequence int64) int {
	if retrying != nil && retrying.sequence == sequence {
		return retrying.attempts + 1
	}
	return 1
}

// dispatched records ev handed over: the stream is past it.
func (st *stream) dispatched(ev Event) {
	st.position, st.delivered, st.deliveredID = ev.Sequence, ev.Sequence, ev.EventID
}

// retryLater records the retry d this instance wrote for the head-of-line event: the stream
// waits for it.
func (st *stream) retryLater(d delivery) {
	st.retryDue = d.dueAt
	st.putOpen(d)
}

// parked records the event at sequence parked as a dead letter, with the cursor moved past it.
func (st *stream) parked(sequence int64) {
	st.acked, st.position = sequence, sequence
	st.closeOpen(sequence)
}

// resolved records the retried event at sequence delivered at last, its delivery closed and
// its cursor written with it.
func (st *stream) resolved(sequence int64) {
	st.acked = sequence
	st.closeOpen(sequence)
}

// putOpen records the open delivery d (replacing the one at its sequence) after this instance
// wrote it.
func (st *stream) putOpen(d delivery) {
	out := make([]delivery, 0, len(st.open)+1)
	for _, o := range st.open {
		if o.sequence != d.sequence {
			out = append(out, o)
		}
	}
	out = append(out, d)
	sort.Slice(out, func(i, j int) bool { return out[i].sequence < out[j].sequence })
	st.open = out
}

// closeOpen forgets the open delivery at sequence after this instance closed it (resolved it,
// or parked it as a dead letter).
func (st *stream) closeOpen(sequence int64) {
	out := make([]delivery, 0, len(st.open))
	for _, o := range st.open {
		if o.sequence != sequence {
			out = append(out, o)
		}
	}
	st.open = out
}

// supersedeOpen forgets the retries at or below head, which a reconciliation resolved.
func (st *stream) supersedeOpen(head int64) {
	out := make([]delivery, 0, len(st.open))
	for _, d := range st.open {
		if d.state != DeliveryRetrying || d.sequence > head {
			out = append(out, d)
		}
	}
	st.open = out
}

// forgetOpen has the next scan read the stream's open deliveries: a write of them failed, and
// may or may not have committed, or a hint said they changed.
func (st *stream) forgetOpen() { st.openKnown = false }

// owes reports whether the stream dispatched beyond its durable cursor under a lease.
func (st *stream) owes() bool { return st.position > st.acked && st.epoch > 0 }

func (st *stream) ack() ack { return ack{st.project, st.epoch, st.position} }

// startUnacked notes that the stream dispatches beyond its cursor from now, unless it already
// did.
func (st *stream) startUnacked(now time.Time) {
	if st.unackedSince.IsZero() {
		st.unackedSince = now
	}
}

// batchAck is the cursor write due in the middle of a scan: BatchSize events dispatched beyond
// the cursor.
func (st *stream) batchAck(batchSize int) (ack, bool) {
	if st.position-st.acked < int64(batchSize) {
		return ack{}, false
	}
	st.unackedSince = time.Time{}
	return st.ack(), true
}

// dueAck is the cursor write due at now: BatchSize events dispatched beyond the cursor, or
// events waiting since interval (AckInterval) ago. A stream that moved without a dispatch (a
// reconciliation, a replay) starts waiting now.
func (st *stream) dueAck(now time.Time, batchSize int, interval time.Duration) (ack, bool) {
	if !st.owes() {
		return ack{}, false
	}
	st.startUnacked(now)
	if st.position-st.acked >= int64(batchSize) || now.Sub(st.unackedSince) >= interval {
		st.unackedSince = time.Time{}
		return st.ack(), true
	}
	return ack{}, false
}

// ackDeadline is when the stream's cursor write falls due (interval after it started waiting);
// ok is false when none waits.
func (st *stream) ackDeadline(interval time.Duration) (at time.Time, ok bool) {
	if !st.owes() || st.unackedSince.IsZero() {
		return time.Time{}, false
	}
	return st.unackedSince.Add(interval), true
}

// releaseAck is the cursor write owed before the dropped lease ls is released, if it is this
// stream's lease and the stream went beyond its cursor.
func (st *stream) releaseAck(ls lease) (ack, bool) {
	if st.lease != ls.grant || st.position <= st.acked {
		return ack{}, false
	}
	st.unackedSince = time.Time{}
	return ack{st.project, ls.epoch, st.position}, true
}

// ackWritten records the cursor write a as committed.
func (st *stream) ackWritten(a ack) {
	if st.epoch == a.epoch && st.acked < a.sequence {
		st.acked = a.sequence
	}
}

// streams are the loop's streams by project. A stream stays when its lease goes: what it
// delivered is remembered for the next lease (checkDelivered).
type streams map[string]*stream

// sync aligns the streams with the leases held now and returns their projects, sorted. A
// stream whose lease is gone waits for no retry.
func (s streams) sync(leases map[string]lease) []string {
	out := make([]string, 0, len(leases))
	for p, ls := range leases {
		st := s[p]
		if st == nil {
			st = &stream{project: p}
			s[p] = st
		}
		st.takeLease(ls)
		out = append(out, p)
	}
	for p, st := range s {
		if _, ok := leases[p]; !ok {
			st.unblock()
		}
	}
	sort.Strings(out)
	return out
}

// unblock is stream.unblock for project, if it has a stream.
func (s streams) unblock(project string) {
	if st := s[project]; st != nil {
		st.unblock()
	}
}

// earliestRetry is when the first blocked stream's retry falls due (shifted clock); ok is
// false when no stream waits for one.
func (s streams) earliestRetry() (at time.Time, ok bool) {
	for _, st := range s {
		if st.blocked() && (!ok || st.retryDue.Before(at)) {
			at, ok = st.retryDue, true
		}
	}
	return at, ok
}

// pendingAcks lists the cursor writes the streams owe, by project: for the consumer's stop.
func (s streams) pendingAcks() []ack {
	var out []ack
	for _, st := range s {
		if st.owes() {
			out = append(out, st.ack())
		}
	}
	sortAcks(out)
	return out
}

// dueAcks lists the cursor writes due at now (see stream.dueAck), by project. The rest wait,
// so a busy consumer writes its cursors by time or count, not once per scan.
func (s streams) dueAcks(now time.Time, batchSize int, interval time.Duration) []ack {
	var out []ack
	for _, st := range s {
		if a, ok := st.dueAck(now, batchSize, interval); ok {
			out = append(out, a)
		}
	}
	sortAcks(out)
	return out
}

// ackDeadline is when the earliest cursor write not yet written falls due; ok is false when
// none waits.
func (s streams) ackDeadline(interval time.Duration) (at time.Time, ok bool) {
	for _, st := range s {
		if due, owes := st.ackDeadline(interval); owes && (!ok || due.Before(at)) {
			at, ok = due, true
		}
	}
	return at, ok
}

func sortAcks(acks []ack) {
	sort.Slice(acks, func(i, j int) bool { return acks[i].project < acks[j].project })
}

// forgetOpen has the streams of stale (every stream for "") read their open deliveries again
// when next scanned.
func (s streams) forgetOpen(stale map[string]struct{}) {
	if _, all := stale[""]; all {
		for _, st := range s {
			st.forgetOpen()
		}
		return
	}
	for p := range stale {
		if st := s[p]; st != nil {
			st.forgetOpen()
		}
	}
}

// openUnknown lists the projects of leased whose open deliveries are not known.
func (s streams) openUnknown(leased []string) []string {
	var out []string
	for _, p := range leased {
		if !s[p].openKnown {
			out = append(out, p)
		}
	}
	return out
}

// takeOpen records what a read of the open deliveries of projects returned: each project it
// read is known from now on. A project that failed (named by a *ProjectErrors, or all of them
// on any other error) is unknown until a read of it succeeds.
func (s streams) takeOpen(projects []string, read map[string][]delivery, err error) {
	var pe *ProjectErrors
	all := err != nil && !errors.As(err, &pe)
	for _, p := range projects {
		st := s[p]
		if st == nil {
			continue
		}
		if all || pe.names(p) {
			st.forgetOpen()
			continue
		}
		st.open, st.openKnown = read[p], true
	}
}

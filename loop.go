package outbox

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
)

// The scan loop: the consumer's one dispatching goroutine. It owns every stream's state and
// asks the other parts for what it needs: the lease keeper whether a lease is still valid (and
// for the fenced transaction), the acknowledger to write cursors, the delivery store for the
// retry, dead-letter and replay rows, the reconciler when history is gone, and the dispatcher's
// session to hand events over.

// scanLoop is the consumer's loop and the stream states it owns.
type scanLoop struct {
	id       ConsumerID
	pool     *pgxpool.Pool
	cfg      consumerConfig
	log      *zap.Logger
	metrics  *Metrics
	trace    tracing
	dispatch *Dispatcher
	leases   *leaseKeeper
	acks     *acknowledger
	store    *deliveryStore
	recon    *reconciler
	reads    *readSource // where scans read: the standby (Config.ReadDSN) or the pool (standby.go)
	scans    *scanRequests
	stats    *stats

	state map[string]*streamState // owned by the loop goroutine
	// readSuspects are the projects that failed when read alone after a combined read failed:
	// they read alone, so that the others' combined read succeeds, until they read alone
	// without failing. Owned by the loop goroutine.
	readSuspects map[string]bool
	skipLog      logEvery // owned by the loop goroutine
	// seenTick is the newest tick the last read of heads saw, and when it was taken: a restore
	// that takes ticks away shows as that tick gone or taken again at another time. Owned by the
	// loop goroutine.
	seenTick   int64
	seenTickAt time.Time
	// checkedTick is the newest tick a read on the primary showed (its heads, or its newest
	// tick read with open deliveries or to check an announcement): an announced tick up to it
	// needs no check (standby.go). Owned by the loop goroutine.
	checkedTick int64
	// openReadAt is when the open deliveries of every held project were last read, on the
	// shifted clock: a full scan reads them all again once TickFallbackInterval has passed,
	// which bounds what a lost replay hint costs. Owned by the loop goroutine.
	openReadAt time.Time
	// unticked: the last read of heads of a poll found events committed that no tick has
	// numbered (a writer's hint lost); the loop then tells its ticker (hintTicker). Owned by
	// the loop goroutine.
	unticked bool
	// elected reports whether this consumer's ticker is the elected one, whose polls ask
	// whether events committed without a tick; tickNow asks it for a tick. Both nil when there
	// is no election (NotifyDisabled, or a transaction pooler without ListenDSN), where every
	// consumer ticks once per PollInterval anyway.
	elected func() bool
	tickNow func()
	// rest, when set (by tests), is called each time the loop waits with nothing armed but the
	// poll interval: what one poll costs is the scans between two rests.
	rest func()
}

// streamState is the loop's view of one project stream.
type streamState struct {
	project   string
	epoch     int64  // lease epoch this state belongs to; 0 before the first lease
	acked     int64  // durable cursor; -1 when the cursor is NULL (never positioned)
	position  int64  // dispatched through; position > acked means acknowledgements are pending
	lease     uint64 // the lease (leaseTable's grant number) this state belongs to
	delivered int64  // highest sequence this instance delivered: re-deliveries below are suppressed
	// deliveredID is the event delivered at sequence delivered. When a new lease moves the
	// position back below delivered, the event stored there now must still be this one, or
	// the history was rewritten (a restored database) and nothing is suppressed.
	deliveredID    string
	checkDelivered bool
	// rewound: a head read after the stream reached its position stood below it, which only a
	// restored database does. The position and acked are then stale: the stream restarts
	// from its durable cursor before it is read again.
	rewound bool
	// retryAt is when the blocked head-of-line event falls due, on the consumer's shifted
	// clock (see shiftedNow). An absolute time, so a timer re-armed later waits only what is
	// left.
	retryAt time.Time
	blocked bool // the head-of-line event waits for its next attempt
	found   bool // the last scan had events or deliveries to look at
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
}

// putOpen records the open delivery d (replacing the one at its sequence) after this instance
// wrote it.
func (st *streamState) putOpen(d delivery) {
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
func (st *streamState) closeOpen(sequence int64) {
	out := make([]delivery, 0, len(st.open))
	for _, o := range st.open {
		if o.sequence != sequence {
			out = append(out, o)
		}
	}
	st.open = out
}

// forgetOpen has the next scan read the stream's open deliveries: a write of them failed, and
// may or may not have committed.
func (st *streamState) forgetOpen() { st.openKnown = false }

// readKey is the key the next read of st continues after, or the zero key.
func (st *streamState) readKey() eventKey {
	if st.keyAt != st.position || st.position == 0 {
		return eventKey{}
	}
	return st.key
}

// run scans on a notification (the notified projects), on the poll interval (every project),
// when a blocked retry falls due (on the injected clock), and soon after a step failed. It
// hands events over through one dispatcher session it owns; abandon is closed when the
// consumer's stop cannot wait for a listener in flight.
func (l *scanLoop) run(ctx context.Context, abandon <-chan struct{}) {
	s := l.dispatch.session(ctx, l.cfg.ListenerTimeout, abandon)
	defer s.close()
	s.trace, s.metrics = l.trace, l.metrics
	poll := time.NewTimer(0)
	defer poll.Stop()
	resetPoll := func(d time.Duration) {
		if !poll.Stop() {
			select {
			case <-poll.C:
			default:
			}
		}
		poll.Reset(d)
	}
	full := true
	wakes := newWakeLimiter(l.cfg.WakeInterval)
	busy := followUps{interval: l.cfg.FollowUpInterval, window: l.cfg.FollowUpWindow, last: map[string]time.Time{}}
	followUp := false
	for {
		l.releaseDropped(ctx)
		dirty, all, stale := l.scans.take()
		full = full || all
		l.markStale(stale)
		var failed bool
		if full {
			wakes.covered()
			failed = l.iterate(ctx, s, nil, true)
			busy.record(l.state, nil, time.Now())
		} else {
			scan := wakes.admit(dirty, time.Now())
			if followUp {
				busy.add(scan)
			}
			if len(scan) > 0 {
				for p := range scan {
					if st := l.state[p]; st != nil {
						st.found = false // a project the scan skips found nothing
					}
				}
				failed = l.iterate(ctx, s, scan, false)
				now := time.Now()
				for p := range scan {
					st := l.state[p]
					wakes.scanned(p, st != nil && st.found, now)
				}
				busy.record(l.state, scan, now)
			}
		}
		followUp = false
		if ctx.Err() != nil {
			return
		}
		switch {
		case failed:
			resetPoll(min(l.cfg.PollInterval, time.Second))
		case full:
			resetPoll(l.cfg.PollInterval)
		}
		full = false

		var retry Timer
		var retryC <-chan time.Time
		if wait, ok := l.nextRetry(); ok {
			retry = l.cfg.Clock.NewTimer(wait) // fires at once when the retry is already due
			retryC = retry.C()
		}
		var held *time.Timer
		var heldC <-chan time.Time
		if at, ok := wakes.next(); ok {
			held = time.NewTimer(time.Until(at)) // notifications held back by the wake interval
			heldC = held.C
		}
		var next *time.Timer
		var nextC <-chan time.Time
		if busy.pending(time.Now()) {
			next = time.NewTimer(busy.interval) // a busy project's follow-up scan
			nextC = next.C
		}
		var ackT *time.Timer
		var ackC <-chan time.Time
		if at, ok := l.nextAck(); ok {
			ackT = time.NewTimer(time.Until(at)) // a cursor write falls due
			ackC = ackT.C
		}
		if l.rest != nil && retry == nil && held == nil && next == nil && ackT == nil {
			l.rest()
		}
		select {
		case <-ctx.Done():
		case <-poll.C:
			full = true
		case <-l.scans.wake:
		case <-heldC:
		case <-nextC:
			followUp = true
		case <-retryC:
			full = true
		case <-ackC:
			l.acks.await()
			l.acks.start(ctx, l.dueAcks(time.Now())...)
		}
		if ackT != nil {
			ackT.Stop()
		}
		if retry != nil {
			retry.Stop()
		}
		if held != nil {
			held.Stop()
		}
		if next != nil {
			next.Stop()
		}
		if ctx.Err() != nil {
			return
		}
	}
}

// followUps are the projects being scanned again every interval because a scan of theirs
// made progress within window: under load the writers stay quiet (NotifyGap), and their events
// are found by these scans. Only the loop goroutine uses it.
type followUps struct {
	interval, window time.Duration
	last             map[string]time.Time // when a scan of each busy project last made progress
}

// record notes which of the scanned projects (every project when scanned is nil) made progress.
func (f *followUps) record(states map[string]*streamState, scanned map[string]struct{}, now time.Time) {
	if f.window <= 0 {
		return
	}
	for p, st := range states {
		if _, ok := scanned[p]; (scanned == nil || ok) && st.progressed {
			f.last[p] = now
		}
	}
}

// pending reports whether a follow-up scan is due, forgetting projects quiet for a window.
func (f *followUps) pending(now time.Time) bool {
	for p, at := range f.last {
		if now.Sub(at) > f.window {
			delete(f.last, p)
		}
	}
	return len(f.last) > 0
}

// add puts every busy project into scan.
func (f *followUps) add(scan map[string]struct{}) {
	for p := range f.last {
		scan[p] = struct{}{}
	}
}

// iterate runs one scan over the held leases of the dirty projects (all of them on a full
// scan). It reports whether a step failed, in which case the loop scans again soon.
func (l *scanLoop) iterate(ctx context.Context, s *session, dirty map[string]struct{}, full bool) (failed bool) {
	l.acks.await() // the last scan's acknowledgement: a stream whose write matched nothing lost its lease
	held := l.syncStates()
	check := full && l.elected != nil && l.elected()
	if !full {
		scoped := held[:0:0]
		for _, p := range held {
			if _, ok := dirty[p]; ok {
				scoped = append(scoped, p)
			}
		}
		held = scoped
	}
	if len(held) == 0 {
		if check {
			l.checkUnticked(ctx)
		}
		return false
	}
	for _, p := range held {
		l.state[p].progressed = false // until its scan says otherwise; a skipped step makes none
	}
	l.stats.scans.Add(1)
	// One project's broken rows cost only that project: a step that failed for some projects
	// skips them this scan and the others go on.
	// The heads and the open deliveries that must be read are read at once, on two
	// connections: a woken scan waits for one round trip before it reads events, not two. Most
	// scans read no open deliveries: the streams know them (streamState.open).
	reading := l.openToRead(held, full)
	heads, read, err, openErr := l.scanStart(ctx, held, reading, check)
	l.takeOpen(reading, read, openErr)
	if held, failed = l.skipFailed("read heads", held, err); len(held) == 0 {
		return failed
	}
	held, stepFailed := l.skipFailedOf("read open deliveries", held, reading, openErr)
	failed = failed || stepFailed
	open := make(map[string][]delivery, len(held))
	for _, p := range held {
		open[p] = l.state[p].open
	}
	if l.unticked {
		l.hintTicker()
	}
	first, alone, err := l.readFirst(ctx, held, heads, open)
	held, stepFailed = l.skipFailed("read events", held, err)
	failed = failed || stepFailed
	for _, p := range held {
		if ctx.Err() != nil {
			break
		}
		st := l.state[p]
		var fb *firstBatch
		if b, ok := first[p]; ok {
			fb = &b
		}
		err := l.scanProject(ctx, s, st, heads[p], open[p], fb)
		if alone || l.readSuspects[p] {
			l.suspectRead(p, err)
		}
		if err != nil {
			failed = failed || !errors.Is(err, ErrLeaseLost)
			l.handleStreamError(st, err)
		}
	}
	// The acknowledgements due commit while the loop waits for its next scan; the next scan
	// (or the consumer's shutdown) applies what they wrote before anything else.
	l.acks.start(ctx, l.dueAcks(time.Now())...)
	return failed
}

// readFirst reads, in one statement, the first batch of every project of held that has events
// to read: one read per scan rather than one per project, which walks each tick once for all of
// them. A project it cannot serve (its next event in the frozen stream or in a part larger than
// a batch, or a part that did not come back whole) gets no batch and reads in scanProject, from
// its key when it has one. It leaves out the projects at their
// head, those whose lease is gone, those about to be reconciled (by default, every project of a
// new consumer), those whose next event waits for a retry not yet due and the read suspects;
// with one project left, that project reads in scanProject, in a statement as cheap. When the
// statement fails in a way that may be one project's doing (see readIsolatable), no batch is
// returned and alone is set: each project reads alone, so one project's trouble stays its own,
// and those that fail become read suspects. Any other failure would fail every project's read
// alike, and is returned.
func (l *scanLoop) readFirst(ctx context.Context, held []string, heads map[string]Head, open map[string][]delivery) (first map[string]firstBatch, alone bool, err error) {
	var projects []string
	var after []int64
	capacity := 0
	for _, p := range held {
		st, head := l.state[p], heads[p]
		if st.position >= head.LastSequence || !l.leases.valid(p, st.epoch) || l.readSuspects[p] {
			continue
		}
		if _, ok := l.reconcileReason(st, head); ok {
			continue // the stream restarts at the head: nothing below it is read
		}
		if r := headOfLineRetry(open[p], st.position); r != nil && r.sequence == st.position+1 && !r.dueBy(shiftedNow(l.cfg.Clock)) {
			continue
		}
		projects, after = append(projects, p), append(after, st.position)
		capacity += int(min(head.LastSequence-st.position, int64(l.cfg.BatchSize)))
	}
	if len(projects) < 2 {
		return nil, false, nil
	}
	err = l.read(ctx, func(db *pgxpool.Pool) (err error) {
		first, err = readFirstEvents(ctx, db, projects, after, l.cfg.BatchSize, capacity)
		return err
	})
	if err == nil {
		return first, false, nil
	}
	if ctx.Err() != nil || !readIsolatable(err) {
		return nil, false, err
	}
	if n, ok := l.skipLog.due("read events", time.Now()); ok {
		l.log.Warn("the read of several projects' events failed; each project is read alone",
			zap.Int("projects", len(projects)), zap.Int("times_since_last_logged", n), zap.Error(err))
	}
	return nil, true, nil
}

// suspectRead notes how a project that read alone fared (see readSuspects): a failure other
// than a lost lease or a stop keeps it out of the combined read, a success lets it back in.
func (l *scanLoop) suspectRead(project string, err error) {
	switch {
	case err == nil:
		delete(l.readSuspects, project)
	case errors.Is(err, ErrLeaseLost), errors.Is(err, context.Canceled):
	default:
		if l.readSuspects == nil {
			l.readSuspects = map[string]bool{}
		}
		l.readSuspects[project] = true
	}
}

// headOfLineRetry is the retrying delivery among open that the stream positioned at position
// has still to get past, or nil.
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

// loopHeadsSQL reads the heads of projects ($1) with the newest tick and the time tick $2 was
// taken, if it is still stored, in one statement. The tick table always holds a tick.
const loopHeadsSQL = `
SELECT h.project_id, h.last_sequence, h.pruned_through, t.tick_id, t.ticked_at,
       (SELECT s.ticked_at FROM lifecycle_tick s WHERE s.tick_id = $2)
FROM (SELECT n.tick_id, n.ticked_at FROM lifecycle_tick n ORDER BY n.tick_id DESC LIMIT 1) t
LEFT JOIN lifecycle_outbox_head h ON h.project_id = ANY ($1::text[])`

// loopHeadsUntickedSQL is loopHeadsSQL that also says, once per statement whatever the number
// of projects, whether events committed that no tick numbered (lifecycle_outbox_unticked,
// migration 0023): what the poll of the consumer whose ticker is elected reads (see
// scanLoop.hintTicker). Every other scan reads loopHeadsSQL, which plans as it always did.
const loopHeadsUntickedSQL = `
SELECT h.project_id, h.last_sequence, h.pruned_through, t.tick_id, t.ticked_at,
       (SELECT s.ticked_at FROM lifecycle_tick s WHERE s.tick_id = $2), t.unticked
FROM (SELECT n.tick_id, n.ticked_at, lifecycle_outbox_unticked() AS unticked
      FROM lifecycle_tick n ORDER BY n.tick_id DESC LIMIT 1) t
LEFT JOIN lifecycle_outbox_head h ON h.project_id = ANY ($1::text[])`

// untickedSQL asks whether events committed that no tick numbered, for the elected ticker's
// consumer when it holds no lease and so reads no heads.
const untickedSQL = `SELECT lifecycle_outbox_unticked()`

// readHeads returns the heads of projects, as the ticker left them. A head below what the
// stream reached marks the stream rewound: only a restored database moves a head back. So does
// a tick this loop saw that is gone while no newer one is stored, or that was taken again: a
// restore took ticks back, and the ticks taken since may have brought the head back to where
// the stream was with other events. Every stream then restarts from its durable cursor, as a
// new lease does; what it delivered and is still stored stays suppressed (verifyDelivered).
func (l *scanLoop) readHeads(ctx context.Context, projects []string, unticked bool) (map[string]Head, error) {
	announced := l.scans.announced.Load()
	hr, err := queryHeads(ctx, l.pool, projects, l.seenTick, unticked)
	if err != nil {
		return nil, err
	}
	l.checked(announced, hr.newest)
	return l.applyHeads(hr), nil
}

// applyHeads takes a read of heads (see readHeads) into the loop's view.
func (l *scanLoop) applyHeads(hr headsRead) map[string]Head {
	heads, newest, newestAt, seenAt := hr.heads, hr.newest, hr.newestAt, hr.seenAt
	restored := l.seenTick > 0 && ((seenAt == nil && newest < l.seenTick) || (seenAt != nil && !seenAt.Equal(l.seenTickAt)))
	if restored {
		l.log.Warn("ticks this consumer saw were taken back (a restored database?): every stream restarts from its durable cursor",
			zap.Int64("tick_seen", l.seenTick), zap.Int64("newest_tick", newest))
	}
	l.seenTick, l.seenTickAt = newest, newestAt
	l.unticked = hr.unticked
	for p, h := range heads {
		if st := l.state[p]; st != nil && (h.LastSequence < st.position || (restored && st.position > 0)) {
			st.rewound = true
		}
	}
	return heads
}

// skipFailed takes the outcome of a step over projects: a *ProjectErrors drops the projects it
// names from this scan (each logged and counted) and keeps the rest; any other error drops
// them all. failed reports whether anything was dropped, so the loop scans again soon.
func (l *scanLoop) skipFailed(step string, projects []string, err error) (kept []string, failed bool) {
	if err == nil {
		return projects, false
	}
	var pe *ProjectErrors
	if !errors.As(err, &pe) {
		logTransient(l.log, step, err)
		for _, p := range projects {
			l.unblock(p)
		}
		return nil, true
	}
	kept = projects[:0:0]
	for _, p := range projects {
		perr, bad := pe.Failed[p]
		if !bad {
			kept = append(kept, p)
			continue
		}
		l.unblock(p)
		if errors.Is(perr, context.Canceled) {
			continue // the consumer is stopping: not the project's failure
		}
		l.metrics.projectError(p, string(l.id), step)
		if n, ok := l.skipLog.due(step+"\x00"+p, time.Now()); ok {
			l.log.Warn("consumer step failed for one project; it is skipped while the others go on",
				zap.String("step", step), zap.String("project_id", p), zap.Int("times_since_last_logged", n), zap.Error(perr))
		}
	}
	return kept, true
}

// unblock forgets that a skipped project waits for a retry: its due time would otherwise keep
// firing the loop's retry timer at once, a full scan each time, while the step keeps failing.
// The failed step already brings the next scan within a second, which finds the retry again.
func (l *scanLoop) unblock(project string) {
	if st := l.state[project]; st != nil {
		st.blocked = false
	}
}

// scanProject brings one project's stream up to its head, or to its first blocked event. first,
// when not nil, is the project's first batch, read with the other projects' (readFirst): it
// stands for the first read if it starts where the stream is by then.
func (l *scanLoop) scanProject(ctx context.Context, s *session, st *streamState, head Head, open []delivery, first *firstBatch) error {
	st.blocked = false
	start := st.position
	defer func() { st.progressed = st.position > start }()
	// Whether this scan had anything to do: the wake limiter holds back notifications only for
	// projects whose last notified scan found nothing.
	st.found = head.LastSequence > st.position || len(open) > 0
	if st.rewound {
		if err := l.restartFromCursor(ctx, st, head); err != nil {
			return err
		}
	}
	for _, d := range open {
		if d.state == DeliveryReplayRequested {
			if err := l.replay(ctx, s, st, d); err != nil {
				return err
			}
		}
	}
	if err := l.checkPosition(ctx, st, head); err != nil {
		return err
	}
	if st.checkDelivered {
		if err := l.verifyDelivered(ctx, st); err != nil {
			return err
		}
	}
	retrying := headOfLineRetry(open, st.position)
	for st.position < head.LastSequence {
		if ctx.Err() != nil || !l.leases.valid(st.project, st.epoch) {
			return nil
		}
		if retrying != nil && retrying.sequence == st.position+1 && !retrying.dueBy(shiftedNow(l.cfg.Clock)) {
			st.blocked, st.retryAt = true, retrying.dueAt
			return nil
		}
		var batch []storedEvent
		if first != nil && first.after == st.position && len(first.events) > 0 && first.events[0].Sequence == st.position+1 {
			batch = first.events
		} else {
			// Later batches, and a first one read before a reconciliation moved the stream.
			err := l.read(ctx, func(db *pgxpool.Pool) (err error) {
				batch, err = readEvents(ctx, db, st.project, st.position, l.cfg.BatchSize, st.readKey())
				return err
			})
			if err != nil {
				return err
			}
		}
		first = nil
		if len(batch) == 0 {
			if l.readFromPrimary() {
				continue // a hole on the standby is read again on the primary first
			}
			// The head counts events above the position and none is stored: a hole.
			return l.hole(ctx, st, head, st.position+1)
		}
		stop, err := l.dispatchBatch(ctx, s, st, batch, retrying)
		if h := (errHole{}); errors.As(err, &h) {
			if l.readFromPrimary() {
				continue
			}
			return l.hole(ctx, st, head, h.next)
		}
		if err != nil || stop {
			return err
		}
		retrying = nil
		if st.position-st.acked >= int64(l.cfg.BatchSize) {
			l.acks.start(ctx, ack{st.project, st.epoch, st.position})
			st.unackedSince = time.Time{}
		}
	}
	return nil
}

// dispatchBatch delivers events in order. It stops at the first failure (which it records) or
// when the lease is gone; stop reports that the stream cannot go further this scan.
func (l *scanLoop) dispatchBatch(ctx context.Context, s *session, st *streamState, batch []storedEvent, retrying *delivery) (stop bool, err error) {
	if st.unackedSince.IsZero() {
		st.unackedSince = time.Now()
	}
	for _, row := range batch {
		ev := row.Event
		if ev.Sequence > st.position+1 {
			return true, errHole{next: st.position + 1, found: ev.Sequence}
		}
		if ev.Sequence != st.position+1 {
			return true, fmt.Errorf("project %s: read sequence %d after %d", st.project, ev.Sequence, st.position)
		}
		st.key, st.keyAt = row.key, ev.Sequence // the key of the event at position, once it moves there
		if ctx.Err() != nil || !l.leases.valid(st.project, st.epoch) {
			return true, nil // stopping, or the lease is gone: nothing more is handed over
		}
		if row.bad != nil {
			// No attempt can decode it: park it now rather than wedge the stream.
			l.acks.flush(ctx, []ack{{st.project, st.epoch, st.position}})
			if _, err := l.parkUndecodable(ctx, st, row); err != nil {
				return true, err
			}
			retrying = nil
			continue
		}
		if ev.Sequence <= st.delivered {
			// Delivered by this instance before a lease change: a re-delivery, not new work.
			st.position = ev.Sequence
			l.stats.suppressed.Add(1)
			continue
		}
		attempt := 1
		if retrying != nil && retrying.sequence == ev.Sequence {
			attempt = retrying.attempts + 1
		}
		outcome, class := s.attempt(ctx, ObservedEvent{Event: ev, ConsumerID: l.id, Attempt: attempt})
		switch outcome {
		case Interrupted:
			return true, nil
		case Failed:
			if !l.leases.valid(st.project, st.epoch) {
				// The lease went while the event was out (its project was dropped from the
				// observed set, say, and the listener no longer takes it): the failure is not
				// this holder's to record. Nothing moves; the event is delivered again from the
				// cursor under the project's next lease, with no attempt spent.
				return true, nil
			}
			l.acks.flush(ctx, []ack{{st.project, st.epoch, st.position}})
			parked, err := l.recordFailure(ctx, st, ev, class)
			if err != nil || !parked {
				return true, err
			}
			retrying = nil
			continue // parked: the cursor moved past it, the stream goes on
		case Own:
			l.stats.own.Add(1)
		default:
			l.stats.delivered.Add(1)
		}
		st.position, st.delivered, st.deliveredID = ev.Sequence, ev.Sequence, ev.EventID
		if attempt > 1 {
			// The event that was retrying succeeded: close its delivery with the cursor move.
			if err := l.resolveRetried(ctx, st, ev); err != nil {
				return true, err
			}
		}
	}
	return false, nil
}

// releaseDropped writes the cursors of the streams whose projects are no longer observed
// (leaseKeeper.dropUnobserved) and then releases their leases, so that a project observed again
// later, here or by another instance of the identity, resumes after the last event delivered.
// It runs on every wake of the loop, between scans: no event of theirs is out by then.
func (l *scanLoop) releaseDropped(ctx context.Context) {
	dropped, done := l.leases.table.takeDropped()
	if len(dropped) == 0 {
		return
	}
	defer done()
	var acks []ack
	for p, ls := range dropped {
		if st := l.state[p]; st != nil && st.lease == ls.grant && st.position > st.acked {
			acks = append(acks, ack{p, ls.epoch, st.position})
			st.unackedSince = time.Time{}
		}
	}
	// A write that failed is tried again on the next wake (or by the shutdown), before the
	// release; one that matched nothing found the lease gone already.
	err := l.acks.flush(ctx, acks)
	if err == nil {
		err = l.leases.releaseLeases(ctx, dropped)
	}
	if err != nil {
		l.leases.table.undrop(dropped) // they expire meanwhile
		logTransient(l.log, "release unobserved", err)
	}
}

// errHole is a read that skipped sequences: the event at next is counted but not stored.
type errHole struct{ next, found int64 }

func (e errHole) Error() string {
	return fmt.Sprintf("sequence %d is missing (read %d next)", e.next, e.found)
}

// hole handles a stream that cannot be read past next: an event its tick counted is no longer
// stored (only the schema's owner can delete one). It is logged and counted, and the project is
// reconciled (reason stream_hole, recorded on the cursor), so the stream goes on from the head
// and the live set still reflects the lost event's deletion.
func (l *scanLoop) hole(ctx context.Context, st *streamState, head Head, next int64) error {
	// Retention may have pruned what the scan was about to read since it read the head: that
	// is not a hole, and the cursor below the floor reconciles for that reason.
	heads, err := readHeads(ctx, l.pool, []string{st.project})
	if err != nil {
		return err
	}
	if now := heads[st.project]; now.PrunedThrough >= next {
		return l.reconcile(ctx, st, ReasonCursorBelowPrunedFloor)
	}
	l.stats.holes.Add(1)
	l.metrics.streamHole(st.project, string(l.id))
	l.log.Error("an event of the stream is missing (deleted by hand?): the project is reconciled",
		zap.String("project_id", st.project), zap.Int64("missing_sequence", next), zap.Int64("head", head.LastSequence))
	return l.reconcile(ctx, st, ReasonStreamHole)
}

// restartFromCursor drops the stream's in-memory position after its head went back below it
// (rewound) and restarts from the durable cursor, as a new lease does: the cursor is what the
// restored history says this consumer acknowledged. A cursor still above the head is
// reconciled next (checkPosition); events this instance delivered under sequences the restore
// reuses are suppressed only if they are still the ones stored (verifyDelivered).
func (l *scanLoop) restartFromCursor(ctx context.Context, st *streamState, head Head) error {
	cursor, err := l.leases.cursor(ctx, st.project, st.epoch)
	if err != nil {
		return fmt.Errorf("re-read cursor: %w", err)
	}
	l.log.Warn("the project's head went back below this instance's position (a restored database?): the stream restarts from its durable cursor",
		zap.String("project_id", st.project), zap.Int64("position", st.position), zap.Int64("head", head.LastSequence),
		zap.Int64("cursor", cursor))
	st.rewound, st.blocked = false, false
	st.acked, st.position, st.keyAt = cursor, max(cursor, 0), -1
	st.checkDelivered = st.delivered > st.position
	return nil
}

// checkPosition positions a never-read cursor and reconciles one whose history is gone.
func (l *scanLoop) checkPosition(ctx context.Context, st *streamState, head Head) error {
	if reason, ok := l.reconcileReason(st, head); ok {
		return l.reconcile(ctx, st, reason)
	}
	if st.acked < 0 && st.position == 0 {
		// Start before the first event; the position is written with the next acknowledgement
		// batch, so many new cursors cost one statement.
		l.log.Debug("new cursor starts at the oldest retained event", zap.String("project_id", st.project))
	}
	return nil
}

// reconcileReason says why the stream must be reconciled before it is read, if it must.
func (l *scanLoop) reconcileReason(st *streamState, head Head) (ReconcileReason, bool) {
	switch {
	case st.acked < 0 && l.cfg.NewCursor == NewCursorOldest && head.PrunedThrough == 0:
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

const eventAtSQL = `SELECT task_id, deleted_at FROM lifecycle_outbox_read($1::text, $2::bigint - 1, 1, NULL, NULL, NULL) WHERE sequence = $2`

// verifyDelivered checks, after a new lease moved the position back, that the event stored at
// the sequence this instance last delivered is still the one it delivered. If it is not (a
// restored database numbers new events with sequences it had delivered before), nothing is
// suppressed as a re-delivery: those events are new.
func (l *scanLoop) verifyDelivered(ctx context.Context, st *streamState) error {
	var taskID string
	var deletedAt time.Time
	found := false
	err := l.read(ctx, func(db *pgxpool.Pool) error {
		err := db.QueryRow(ctx, eventAtSQL, st.project, st.delivered).Scan(&taskID, &deletedAt)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil // a no on the standby is an answer too: it has replayed what the scan needs
		}
		found = err == nil
		return err
	})
	if err == nil && !found {
		err = pgx.ErrNoRows
	}
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("check delivered event: %w", err)
	}
	st.checkDelivered = false
	if err == nil && TaskDeletedEventID(taskID, deletedAt) == st.deliveredID {
		return nil
	}
	l.log.Warn("the history this instance delivered was rewritten (a restored database?): events are not suppressed as re-deliveries",
		zap.String("project_id", st.project), zap.Int64("delivered", st.delivered), zap.Int64("cursor", st.position))
	st.delivered, st.deliveredID = st.position, ""
	return nil
}

func (l *scanLoop) handleStreamError(st *streamState, err error) {
	if errors.Is(err, ErrLeaseLost) {
		if l.leases.lost(st.project, st.epoch) {
			l.log.Warn("lease lost; dispatch stopped for the project until it is re-acquired",
				zap.String("project_id", st.project), zap.Int64("epoch", st.epoch))
		}
		return
	}
	logTransient(l.log, "project "+st.project, err)
}

// syncStates aligns the loop's stream states with the lease table and returns the projects
// whose lease is held now, sorted.
func (l *scanLoop) syncStates() []string {
	held := l.leases.held()
	out := make([]string, 0, len(held))
	for p, ls := range held {
		st := l.state[p]
		if st == nil {
			st = &streamState{project: p}
			l.state[p] = st
		}
		if st.lease != ls.grant {
			// A new lease: start from the durable cursor it came with. What this instance
			// delivered beyond it is suppressed, once checked to be still what is stored.
			st.lease, st.epoch, st.acked, st.position, st.keyAt = ls.grant, ls.epoch, ls.acked, max(ls.acked, 0), -1
			st.checkDelivered = st.delivered > st.position
			// Another process of the identity may have held the lease meanwhile and written
			// retries or dead letters: what this instance knew of them is read again.
			st.open, st.openKnown = nil, false
		}
		out = append(out, p)
	}
	for p := range l.state {
		if _, ok := held[p]; !ok {
			l.state[p].blocked = false
		}
	}
	sort.Strings(out)
	return out
}

// nextRetry is the wait until the earliest blocked stream falls due; ok is false when no
// stream is blocked. The wait may be zero or negative: the retry is due now.
func (l *scanLoop) nextRetry() (wait time.Duration, ok bool) {
	var earliest time.Time
	for _, st := range l.state {
		if st.blocked && (earliest.IsZero() || st.retryAt.Before(earliest)) {
			earliest = st.retryAt
		}
	}
	if earliest.IsZero() {
		return 0, false
	}
	return earliest.Sub(shiftedNow(l.cfg.Clock)), true
}

// pendingAcks lists the cursor writes the streams owe: dispatched beyond their durable cursor.
func (l *scanLoop) pendingAcks() []ack {
	var out []ack
	for _, st := range l.state {
		if st.position > st.acked && st.epoch > 0 {
			out = append(out, ack{st.project, st.epoch, st.position})
		}
	}
	return out
}

// dueAcks lists the cursor writes due now: a stream with BatchSize events dispatched beyond its
// cursor, or with events waiting since AckInterval ago. The rest wait, so a busy consumer
// writes its cursors by time or count, not once per scan.
func (l *scanLoop) dueAcks(now time.Time) []ack {
	var out []ack
	for _, st := range l.state {
		if st.position <= st.acked || st.epoch <= 0 {
			continue
		}
		if st.unackedSince.IsZero() {
			st.unackedSince = now // moved without a dispatch (a reconciliation, a replay): due in AckInterval
		}
		if st.position-st.acked >= int64(l.cfg.BatchSize) || now.Sub(st.unackedSince) >= l.cfg.AckInterval {
			out = append(out, ack{st.project, st.epoch, st.position})
			st.unackedSince = time.Time{}
		}
	}
	return out
}

// nextAck is when the earliest acknowledgement not yet written falls due; ok is false when
// none waits.
func (l *scanLoop) nextAck() (at time.Time, ok bool) {
	for _, st := range l.state {
		if st.position > st.acked && st.epoch > 0 && !st.unackedSince.IsZero() {
			if due := st.unackedSince.Add(l.cfg.AckInterval); !ok || due.Before(at) {
				at, ok = due, true
			}
		}
	}
	return at, ok
}

// applyAcks records on the stream states what the acknowledger wrote. A project whose row did
// not match lost its lease: nothing was written for it.
func (l *scanLoop) applyAcks(acks []ack, ok []string, err error) {
	if err != nil {
		logTransient(l.log, "acknowledge", err)
		return
	}
	written := make(map[string]bool, len(ok))
	for _, p := range ok {
		written[p] = true
	}
	for _, a := range acks {
		st := l.state[a.project]
		if written[a.project] {
			if st != nil && st.epoch == a.epoch && st.acked < a.sequence {
				st.acked = a.sequence
			}
			continue
		}
		if st != nil {
			l.handleStreamError(st, ErrLeaseLost)
		}
	}
}

package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
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

	streams streams  // owned by the loop goroutine (loop_stream.go)
	skipLog logEvery // owned by the loop goroutine
	// seenTick is the newest tick the last read of heads saw, and when it was taken: a restore
	// that takes ticks away shows as that tick gone or taken again at another time. Owned by the
	// loop goroutine.
	seenTick   int64
	seenTickAt time.Time
	// checkedTick is the newest tick a read on the primary showed (its heads, or its newest
	// tick read with open deliveries or to check an announcement): an announced tick up to it
	// needs no check (standby.go). Owned by the loop goroutine.
	checkedTick int64
	// openReadAt is when the open deliveries of every leased project were last read, on the
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
	// rest, when set (by tests), is called each time the loop waits with nothing due but the
	// poll (schedule.resting): what one poll costs is the scans between two rests.
	rest func()
}

// run scans on a notification (the notified projects), on the poll interval (every project),
// when a blocked retry falls due (on the injected clock), and soon after a step failed. It
// hands events over through one dispatcher session it owns; abandon is closed when the
// consumer's stop cannot wait for a listener in flight. Between scans it waits for what its
// schedule says is due next, a notification, or the stop.
func (l *scanLoop) run(ctx context.Context, abandon <-chan struct{}) {
	s := l.dispatch.session(ctx, l.cfg.ListenerTimeout, abandon)
	defer s.close()
	s.trace, s.metrics = l.trace, l.metrics
	sched := schedule{pollInterval: l.cfg.PollInterval, followUpInterval: l.cfg.FollowUpInterval}
	full := true
	wakes := newWakeLimiter(l.cfg.WakeInterval)
	busy := followUps{interval: l.cfg.FollowUpInterval, window: l.cfg.FollowUpWindow, last: map[string]time.Time{}}
	followUp := false
	for {
		l.scans.working()
		l.releaseDropped(ctx)
		dirty, all, stale := l.scans.take()
		full = full || all
		l.streams.forgetOpen(stale)
		var failed bool
		if full {
			wakes.covered()
			failed = l.iterate(ctx, s, nil, true)
			busy.record(l.streams, nil, time.Now())
		} else {
			scan := wakes.admit(dirty, time.Now())
			if followUp {
				busy.add(scan)
			}
			if len(scan) > 0 {
				for p := range scan {
					if st := l.streams[p]; st != nil {
						st.found = false // a project the scan skips found nothing
					}
				}
				failed = l.iterate(ctx, s, scan, false)
				now := time.Now()
				for p := range scan {
					st := l.streams[p]
					wakes.scanned(p, st != nil && st.found, now)
				}
				busy.record(l.streams, scan, now)
			}
		}
		followUp = false
		if ctx.Err() != nil {
			return
		}
		now := time.Now()
		sched.scanned(now, full, failed)
		full = false

		sched.retryAt, _ = l.streams.earliestRetry()
		sched.deferredAt, _ = wakes.next()
		sched.followUps = busy.pending(now)
		sched.ackAt, _ = l.streams.ackDeadline(l.cfg.AckInterval)
		at, why := sched.next(now)
		wake := time.NewTimer(at.Sub(now))
		var retry Timer
		var retryC <-chan time.Time
		if wait, ok := sched.retryIn(shiftedNow(l.cfg.Clock)); ok {
			retry = l.cfg.Clock.NewTimer(wait) // fires at once when the retry is already due
			retryC = retry.C()
		}
		if l.rest != nil && sched.resting() {
			l.rest()
		}
		l.scans.rest()
		select {
		case <-ctx.Done():
		case <-l.scans.wake:
		case <-wake.C:
			switch why {
			case wakePoll:
				full = true
			case wakeFollowUp:
				followUp = true
			case wakeAck:
				l.acks.await()
				l.acks.start(ctx, l.streams.dueAcks(time.Now(), l.cfg.BatchSize, l.cfg.AckInterval)...)
			case wakeDeferred: // the next admit lets them through
			}
		case <-retryC:
			full = true
		}
		wake.Stop()
		if retry != nil {
			retry.Stop()
		}
		if ctx.Err() != nil {
			return
		}
	}
}

// iterate runs one scan over the leased projects that are dirty (all of them on a full scan).
// It reports whether a step failed, in which case the loop scans again soon.
func (l *scanLoop) iterate(ctx context.Context, s *session, dirty map[string]struct{}, full bool) (failed bool) {
	l.acks.await() // the last scan's acknowledgement: a stream whose write matched nothing lost its lease
	leased := l.streams.sync(l.leases.held())
	check := full && l.elected != nil && l.elected()
	if !full {
		scoped := leased[:0:0]
		for _, p := range leased {
			if _, ok := dirty[p]; ok {
				scoped = append(scoped, p)
			}
		}
		leased = scoped
	}
	if len(leased) == 0 {
		if check {
			l.checkUnticked(ctx)
		}
		return false
	}
	for _, p := range leased {
		l.streams[p].progressed = false // until its scan says otherwise; a skipped step makes none
	}
	l.stats.scans.Add(1)
	// One project's broken rows cost only that project: a step that failed for some projects
	// skips them this scan and the others go on.
	// The heads and the open deliveries that must be read are read at once, on two
	// connections: a woken scan waits for one round trip before it reads events, not two. Most
	// scans read no open deliveries: the streams know them (stream.open).
	reading := l.openToRead(leased, full)
	var heads map[string]Head
	var first map[string]firstBatch
	var alone, byTick bool
	if !full && len(reading) == 0 {
		heads, first, byTick = l.startByTick(ctx, leased)
	}
	if !byTick {
		if leased, heads, first, alone, failed = l.startByHeads(ctx, leased, reading, check); len(leased) == 0 {
			return failed
		}
	}
	for _, p := range leased {
		if ctx.Err() != nil {
			break
		}
		st := l.streams[p]
		var fb *firstBatch
		if b, ok := first[p]; ok {
			fb = &b
		}
		err := l.scanProject(ctx, s, st, heads[p], st.open, fb)
		if alone || st.readAlone {
			st.readAloneAfter(err)
		}
		if err == nil {
			st.scanned(heads[p], l.seenTick)
		} else {
			failed = failed || !errors.Is(err, ErrLeaseLost)
			l.handleStreamError(st, err)
		}
	}
	// The acknowledgements due commit while the loop waits for its next scan; the next scan
	// (or the consumer's shutdown) applies what they wrote before anything else.
	l.acks.start(ctx, l.streams.dueAcks(time.Now(), l.cfg.BatchSize, l.cfg.AckInterval)...)
	return failed
}

// startByHeads starts a scan of leased by reading their heads, and the open deliveries of
// reading, at once, then the first batch of each project that has events to read (readFirst).
// It returns the projects whose steps did not fail, and whether a step failed for some.
func (l *scanLoop) startByHeads(ctx context.Context, leased, reading []string, check bool) (kept []string, heads map[string]Head, first map[string]firstBatch, alone, failed bool) {
	heads, read, err, openErr := l.scanStart(ctx, leased, reading, check)
	if len(reading) > 0 {
		l.stats.openReads.Add(1)
		l.streams.takeOpen(reading, read, openErr)
	}
	if leased, failed = l.skipFailed("read heads", leased, err); len(leased) == 0 {
		return nil, nil, nil, false, failed
	}
	leased, stepFailed := l.skipFailedOf("read open deliveries", leased, reading, openErr)
	failed = failed || stepFailed
	if l.unticked {
		l.hintTicker()
	}
	first, alone, err = l.readFirst(ctx, leased, heads)
	leased, stepFailed = l.skipFailed("read events", leased, err)
	return leased, heads, first, alone, failed || stepFailed
}

// readFirst reads, in one statement, the first batch of every project of leased that has events
// to read: one read per scan rather than one per project, which walks each tick once for all of
// them (readCombined). A project it cannot serve (its next event in the frozen stream or in a
// part larger than a batch, or a part that did not come back whole) gets no batch and reads in
// scanProject, from its key when it has one. It leaves out the projects at their head, those
// whose lease is gone, those about to be reconciled (by default, every project of a new
// consumer), those whose next event waits for a retry not yet due and the read suspects;
// with one project left, that project is read by tick when its stream knows its tick (a
// statement a little cheaper than the per-project reader's), and reads in scanProject
// otherwise. When the statement fails in a way that may be one project's doing (see
// readIsolatable), no batch is returned and alone is set: each project reads alone, so one
// project's trouble stays its own, and those that fail become read suspects. Any other failure
// would fail every project's read alike, and is returned.
func (l *scanLoop) readFirst(ctx context.Context, leased []string, heads map[string]Head) (first map[string]firstBatch, alone bool, err error) {
	var projects []string
	var after, seen []int64
	capacity := 0
	for _, p := range leased {
		st := l.streams[p]
		n, ok := st.readAhead(heads[p], st.open, shiftedNow(l.cfg.Clock), l.cfg.NewCursor, l.cfg.BatchSize)
		if !ok || !l.leases.valid(p, st.epoch) {
			continue
		}
		projects, after, seen = append(projects, p), append(after, st.position), append(seen, st.tickSeen)
		capacity += n
	}
	if len(projects) == 0 || (len(projects) == 1 && seen[0] == 0) {
		return nil, false, nil
	}
	err = l.read(ctx, func(db *pgxpool.Pool) (err error) {
		first, err = l.readCombined(ctx, db, projects, after, seen, capacity)
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

// readCombined is readFirst's read on db of projects (after: their positions; seen: their
// streams' tickSeen). The projects whose stream knows the tick after which its next event is
// are read by tick (readTickEvents), after the oldest of those ticks: one walk of the tick key
// for them all, and no search of each project's parts. Those it cannot serve (a part the read's
// limit cut, or one that did not come back whole), and those whose stream knows no such tick
// (after a start, a new lease or a restore), are read with lifecycle_outbox_read_parts, in a
// second statement when two or more are left.
func (l *scanLoop) readCombined(ctx context.Context, db *pgxpool.Pool, projects []string, after, seen []int64, capacity int) (map[string]firstBatch, error) {
	first := make(map[string]firstBatch, len(projects))
	var byTick []string
	var byTickAfter []int64
	var since int64
	for i, p := range projects {
		if seen[i] > 0 {
			byTick, byTickAfter = append(byTick, p), append(byTickAfter, after[i])
			since = min(cmp.Or(since, seen[i]), seen[i])
		}
	}
	if len(byTick) > 0 {
		limit := min(max(capacity, l.cfg.BatchSize), maxTickReadEvents)
		tr, shared, err := sharedTickEvents(ctx, db, byTick, since, limit, capacity)
		l.countShared(shared)
		if err != nil {
			return nil, err
		}
		first = tr.served(byTick, byTickAfter, l.cfg.BatchSize)
		l.stats.tickReads.Add(1)
		l.stats.tickReadMisses.Add(int64(len(byTick) - len(first)))
	}
	var left []string
	var leftAfter []int64
	for i, p := range projects {
		if _, ok := first[p]; !ok {
			left, leftAfter = append(left, p), append(leftAfter, after[i])
		}
	}
	if len(left) < 2 {
		return first, nil
	}
	rest, shared, err := sharedFirstEvents(ctx, db, left, leftAfter, l.cfg.BatchSize, capacity)
	l.countShared(shared)
	if err != nil {
		return nil, err
	}
	maps.Copy(first, rest)
	return first, nil
}

// maxTickReadEvents is the most events a read of ticks asks for (lifecycle_outbox_read_ticks
// refuses more).
const maxTickReadEvents = 100000

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
	hr, err := l.headsOn(ctx, l.pool, projects, max(announced, l.seenTick), unticked)
	if err != nil {
		return nil, err
	}
	l.checked(announced, hr.newest)
	return l.applyHeads(hr), nil
}

// headsOn reads the heads of projects on db (queryHeads). A read another consumer of the
// process has in flight with the same arguments, whose newest tick is want or later, is shared
// (sharedHeads); the elected ticker's poll, which also asks whether events went unticked,
// reads alone.
func (l *scanLoop) headsOn(ctx context.Context, db *pgxpool.Pool, projects []string, want int64, unticked bool) (headsRead, error) {
	if unticked {
		return queryHeads(ctx, db, projects, l.seenTick, unticked)
	}
	hr, shared, err := sharedHeads(ctx, db, projects, l.seenTick, want)
	l.countShared(shared)
	return hr, err
}

// countShared counts a read this consumer took from another consumer's statement.
func (l *scanLoop) countShared(shared bool) {
	if shared {
		l.stats.sharedReads.Add(1)
	}
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
		if st := l.streams[p]; st != nil {
			st.sawHead(h, restored)
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
			l.streams.unblock(p)
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
		l.streams.unblock(p)
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

// scanProject brings one project's stream up to its head, or to its first blocked event. first,
// when not nil, is the project's first batch, read with the other projects' (readFirst): it
// stands for the first read if it starts where the stream is by then.
func (l *scanLoop) scanProject(ctx context.Context, s *session, st *stream, head Head, open []delivery, first *firstBatch) error {
	start := st.beginScan(head, open)
	defer st.endScan(start)
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
	if reason, ok := st.reconcileReason(head, l.cfg.NewCursor); ok {
		if err := l.reconcile(ctx, st, reason); err != nil {
			return err
		}
	}
	if st.checkDelivered {
		if err := l.verifyDelivered(ctx, st); err != nil {
			return err
		}
	}
	retrying := headOfLineRetry(open, st.position)
	var ahead *nextBatch // the next batch, read while this one is dispatched
	defer func() { ahead.wait() }()
	for st.position < head.LastSequence {
		if ctx.Err() != nil || !l.leases.valid(st.project, st.epoch) {
			return nil
		}
		if st.blockOn(retrying, shiftedNow(l.cfg.Clock)) {
			return nil
		}
		var batch []storedEvent
		next, prefetched := ahead.take(st)
		ahead = nil
		switch {
		case st.takesFirst(first):
			batch = first.events
		case prefetched:
			batch = next
			l.stats.prefetched.Add(1)
		default:
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
		ahead = l.prefetch(ctx, st, head, batch, retrying)
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
		if a, ok := st.batchAck(l.cfg.BatchSize); ok {
			l.acks.start(ctx, a)
		}
	}
	return nil
}

// dispatchBatch delivers events in order. It stops at the first failure (which it records) or
// when the lease is gone; stop reports that the stream cannot go further this scan.
func (l *scanLoop) dispatchBatch(ctx context.Context, s *session, st *stream, batch []storedEvent, retrying *delivery) (stop bool, err error) {
	st.startUnacked(time.Now())
	for _, row := range batch {
		ev := row.Event
		if err := st.admit(row); err != nil {
			return true, err
		}
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
		if st.redelivered(ev.Sequence) {
			// Delivered by this instance before a lease change: a re-delivery, not new work.
			l.stats.suppressed.Add(1)
			continue
		}
		attempt := attemptOf(retrying, ev.Sequence)
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
		st.dispatched(ev)
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
		if st := l.streams[p]; st != nil {
			if a, ok := st.releaseAck(ls); ok {
				acks = append(acks, a)
			}
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

// hole handles a stream that cannot be read past next: an event its tick counted is no longer
// stored (only the schema's owner can delete one). It is logged and counted, and the project is
// reconciled (reason stream_hole, recorded on the cursor), so the stream goes on from the head
// and the live set still reflects the lost event's deletion.
func (l *scanLoop) hole(ctx context.Context, st *stream, head Head, next int64) error {
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
// reconciled next (scanProject); events this instance delivered under sequences the restore
// reuses are suppressed only if they are still the ones stored (verifyDelivered).
func (l *scanLoop) restartFromCursor(ctx context.Context, st *stream, head Head) error {
	cursor, err := l.leases.cursor(ctx, st.project, st.epoch)
	if err != nil {
		return fmt.Errorf("re-read cursor: %w", err)
	}
	l.log.Warn("the project's head went back below this instance's position (a restored database?): the stream restarts from its durable cursor",
		zap.String("project_id", st.project), zap.Int64("position", st.position), zap.Int64("head", head.LastSequence),
		zap.Int64("cursor", cursor))
	st.restartAt(cursor)
	return nil
}

const eventAtSQL = `SELECT task_id, deleted_at FROM lifecycle_outbox_read($1::text, $2::bigint - 1, 1, NULL, NULL, NULL) WHERE sequence = $2`

// verifyDelivered checks, after a new lease moved the position back, that the event stored at
// the sequence this instance last delivered is still the one it delivered. If it is not (a
// restored database numbers new events with sequences it had delivered before), nothing is
// suppressed as a re-delivery: those events are new.
func (l *scanLoop) verifyDelivered(ctx context.Context, st *stream) error {
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
	delivered := st.delivered
	if !st.checkedDelivered(TaskDeletedEventID(taskID, deletedAt), err == nil) {
		return nil
	}
	l.log.Warn("the history this instance delivered was rewritten (a restored database?): events are not suppressed as re-deliveries",
		zap.String("project_id", st.project), zap.Int64("delivered", delivered), zap.Int64("cursor", st.position))
	return nil
}

func (l *scanLoop) handleStreamError(st *stream, err error) {
	if errors.Is(err, ErrLeaseLost) {
		if l.leases.lost(st.project, st.epoch) {
			l.log.Warn("lease lost; dispatch stopped for the project until it is re-acquired",
				zap.String("project_id", st.project), zap.Int64("epoch", st.epoch))
		}
		return
	}
	logTransient(l.log, "project "+st.project, err)
}

// applyAcks records on the streams what the acknowledger wrote. A project whose row did
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
		st := l.streams[a.project]
		switch {
		case st == nil:
		case written[a.project]:
			st.ackWritten(a)
		default:
			l.handleStreamError(st, ErrLeaseLost)
		}
	}
}

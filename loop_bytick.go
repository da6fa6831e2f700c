package outbox

import (
	"cmp"
	"context"
	"time"
)

// startByTick starts a scan of leased without a read of heads, when every stream knows the
// tick after which its next event is (stream.tickSeen) and has nothing else to look at: one
// statement (readTicksSinceSQL) reads their events in the ticks after the oldest of those
// ticks, with the newest tick of the same snapshot. The read then stands for the heads:
//   - a project with rows in it has its head at the end of its last part there; one with none
//     has had nothing numbered since its tick, and stays at its head;
//   - the newest tick becomes what the scan saw, as a read of heads would make it.
//
// With a standby (Config.ReadDSN) the statement is sent to the standby, and the scan goes on
// there (readSource.scanStandby) once the standby has replayed every tick seen or announced,
// the tick scanStart would wait for: the heads and the events then come from one server, as
// they do when scanStart picks the standby. When a newer tick than the scan saw was announced,
// the standby (which usually replays it after its notification came) is probed first and
// waited for as scanStart waits (awaitStandby: probes of its newest tick, the announcement
// checked on the primary after standbyGrace, the primary from then on after ReadMaxLag), and
// read once it has replayed the tick.
//
// It gives way (ok false, and the scan reads heads as before) whenever the read cannot stand
// for them: the consumer reads from the primary while the standby is behind or unreachable
// (readSource.fallen); a stream has open deliveries, waits for a retry, reads alone, was
// rewound or must check what it delivered; the read came back cut by its limit; the tick this
// loop saw is gone or was taken again, or the newest is older than one seen or announced (a
// restore, or a forged announcement: the read of heads handles each); or a project has rows
// the read cannot serve it from (a part missing, a row that cannot be decoded). So what it
// delivers is what the scan through heads would have delivered; it only costs one statement
// where that costs two. Consumers of one pool share the read as they share reads of ticks.
func (l *scanLoop) startByTick(ctx context.Context, leased []string) (heads map[string]Head, first map[string]firstBatch, ok bool) {
	r := l.reads
	db := l.pool
	if r.configured() {
		if r.fallen {
			return nil, nil, false
		}
		db = r.standby
	}
	if l.seenTick == 0 {
		return nil, nil, false
	}
	after := make([]int64, len(leased))
	var since int64
	for i, p := range leased {
		st := l.streams[p]
		if st.tickSeen == 0 || !st.openKnown || len(st.open) > 0 || st.blocked() || st.readAlone || st.rewound || st.checkDelivered ||
			!l.leases.valid(p, st.epoch) {
			return nil, nil, false
		}
		after[i] = st.position
		since = min(cmp.Or(since, st.tickSeen), st.tickSeen)
	}
	limit := min(len(leased)*l.cfg.BatchSize, maxTickReadEvents)
	announced := l.scans.announced.Load()
	want, checked := l.standbyWant(announced)
	read := func() (tickRead, error) {
		tr, shared, err := sharedTicksSince(ctx, db, leased, since, limit, l.seenTick, want)
		l.countShared(shared)
		return tr, err
	}
	var err error
	if r.configured() && want > l.seenTick {
		// A tick newer than the scan saw was announced, and its notification usually comes
		// before the standby replays it: probe the standby's newest tick (one lookup, shared by
		// the consumers of the process) and wait for it as scanStart would, before the read.
		var newest int64
		var newestAt time.Time
		if newest, newestAt, err = l.standbyNewest(ctx); err == nil && newest < want {
			var replayed bool
			if want, replayed, err = l.awaitStandby(ctx, newest, newestAt, want, time.Time{}, checked); err == nil && !replayed {
				return nil, nil, false // the wait ran out: the consumer reads from the primary now
			}
		}
	}
	var tr tickRead
	if err == nil {
		tr, err = read()
	}
	if err != nil {
		switch {
		case !r.configured() || ctx.Err() != nil:
		case recoveryConflict(err):
			r.conflict(err) // counted; the read of heads tries the standby again
		case standbyDown(err):
			r.fallBack(fallbackUnreachable, 0, 0, err) // the read of heads goes to the primary at once
		}
		return nil, nil, false // the read of heads meets the failure, and handles it as it does
	}
	s := tr.state
	if s.seenAt == nil || !s.seenAt.Equal(l.seenTickAt) || s.newest < want ||
		len(tr.events) >= limit || s.newest > since+int64(limit) {
		return nil, nil, false
	}
	ends := make(map[string]int64, len(leased)) // the end of each project's last part in the read
	for k, e := range tr.events {
		pt := tr.parts[k]
		if pt.tick == 0 {
			return nil, nil, false // a row that could not be decoded: read as before, where it is parked
		}
		ends[e.ProjectID] = max(ends[e.ProjectID], pt.first+int64(pt.events)-1)
	}
	first = tr.served(leased, after, l.cfg.BatchSize)
	heads = make(map[string]Head, len(leased))
	for i, p := range leased {
		h := Head{ProjectID: p, LastSequence: max(after[i], ends[p])}
		if _, served := first[p]; h.LastSequence > after[i] && !served {
			return nil, nil, false
		}
		heads[p] = h
	}
	if r.configured() {
		r.scanStandby = true
		r.setLag(0, 0)
	}
	l.checked(announced, s.newest) // a tick the standby replayed is one the primary has
	l.seenTick, l.seenTickAt = s.newest, s.newestAt
	l.unticked = false // asked on polls only, as a read of heads of a woken scan leaves it
	l.stats.tickReads.Add(1)
	l.stats.tickStarts.Add(1)
	return heads, first, true
}

package outbox

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The stream's decisions, without a database (loop_stream.go).

var t0 = time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)

func retryingAt(seq int64, attempts int, due time.Time) delivery {
	return delivery{sequence: seq, eventID: fmt.Sprintf("e%d", seq), state: DeliveryRetrying, attempts: attempts, dueAt: due}
}

func replayOf(seq int64) delivery {
	return delivery{sequence: seq, eventID: fmt.Sprintf("e%d", seq), state: DeliveryReplayRequested}
}

// TestLoopStreamReadKey: a read continues after the key of the event at the position, and only
// while the key is that event's.
func TestLoopStreamReadKey(t *testing.T) {
	t.Parallel()
	k := eventKey{txid: "42", deletedAt: t0, taskID: "t-1"}
	for _, tc := range []struct {
		name  string
		st    stream
		wants eventKey
	}{
		{"key of the event at the position", stream{position: 7, key: k, keyAt: 7}, k},
		{"key of an older event: the stream moved without reading", stream{position: 8, key: k, keyAt: 7}, eventKey{}},
		{"a new lease forgets the key", stream{position: 7, key: k, keyAt: -1}, eventKey{}},
		{"before the first event", stream{position: 0, key: k, keyAt: 0}, eventKey{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			require.Equal(t, tc.wants, tc.st.readKey())
		})
	}
}

// TestLoopStreamReconcileReason: when a stream is reconciled before it is read, and why.
func TestLoopStreamReconcileReason(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		acked     int64
		head      Head
		newCursor NewCursorPolicy
		want      ReconcileReason // "" for none
	}{
		{"new cursor, reconcile policy", -1, Head{LastSequence: 10}, NewCursorReconcile, ReasonMissingCursor},
		{"new cursor, oldest policy, nothing pruned: starts before the first event", -1, Head{LastSequence: 10}, NewCursorOldest, ""},
		{"new cursor, oldest policy, events pruned", -1, Head{LastSequence: 10, PrunedThrough: 3}, NewCursorOldest, ReasonMissingCursor},
		{"cursor ahead of the head (a restored database)", 11, Head{LastSequence: 10}, NewCursorReconcile, ReasonCursorAheadOfHead},
		{"cursor below the pruned floor", 2, Head{LastSequence: 10, PrunedThrough: 3}, NewCursorReconcile, ReasonCursorBelowPrunedFloor},
		{"cursor at the pruned floor: its next event is stored", 3, Head{LastSequence: 10, PrunedThrough: 3}, NewCursorReconcile, ""},
		{"cursor at the head", 10, Head{LastSequence: 10}, NewCursorReconcile, ""},
		{"cursor at zero, empty project", 0, Head{}, NewCursorReconcile, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			st := stream{acked: tc.acked}
			got, ok := st.reconcileReason(tc.head, tc.newCursor)
			require.Equal(t, tc.want, got)
			require.Equal(t, tc.want != "", ok)
		})
	}
}

// TestLoopHeadOfLineRetry: the stream's head of line is its first retrying delivery above its
// position; replay requests are not in line, and a retry at or below the position is
// superseded.
func TestLoopHeadOfLineRetry(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		open     []delivery
		position int64
		want     int64 // sequence; 0 for none
	}{
		{"nothing open", nil, 4, 0},
		{"only a replay request", []delivery{replayOf(2)}, 4, 0},
		{"the retry at the next event", []delivery{retryingAt(5, 1, t0)}, 4, 5},
		{"a replay request before the retry", []delivery{replayOf(2), retryingAt(5, 1, t0)}, 4, 5},
		{"a replay request after the retry", []delivery{retryingAt(5, 1, t0), replayOf(9)}, 4, 5},
		{"the first retry counts", []delivery{retryingAt(5, 1, t0), retryingAt(8, 2, t0)}, 4, 5},
		{"a superseded retry stops the search", []delivery{retryingAt(3, 1, t0), retryingAt(8, 2, t0)}, 4, 0},
		{"a retry at the position is superseded", []delivery{retryingAt(4, 1, t0)}, 4, 0},
		{"a retry further on is still ahead", []delivery{retryingAt(9, 1, t0)}, 4, 9},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			got := headOfLineRetry(tc.open, tc.position)
			if tc.want == 0 {
				require.Nil(t, got)
				return
			}
			require.NotNil(t, got)
			require.Equal(t, tc.want, got.sequence)
		})
	}
}

// TestLoopStreamBlocksOnItsRetry: the stream waits for its head-of-line retry when that is its
// next event and not yet due, and remembers when it falls due.
func TestLoopStreamBlocksOnItsRetry(t *testing.T) {
	t.Parallel()
	later := t0.Add(time.Minute)
	for _, tc := range []struct {
		name    string
		retry   *delivery
		blocked bool
	}{
		{"no retry", nil, false},
		{"its next event, due later", &delivery{sequence: 5, state: DeliveryRetrying, dueAt: later}, true},
		{"its next event, due now", &delivery{sequence: 5, state: DeliveryRetrying, dueAt: t0}, false},
		{"its next event, due when read (zero due time)", &delivery{sequence: 5, state: DeliveryRetrying}, false},
		{"a later event, due later: the stream reads up to it", &delivery{sequence: 6, state: DeliveryRetrying, dueAt: later}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			st := stream{position: 4}
			require.Equal(t, tc.blocked, st.blockOn(tc.retry, t0))
			require.Equal(t, tc.blocked, st.blocked())
			if tc.blocked {
				require.Equal(t, later, st.retryDue)
			}
			require.Equal(t, 1, attemptOf(nil, 5))
			if tc.retry != nil {
				tc.retry.attempts = 3
				require.Equal(t, 4, attemptOf(tc.retry, tc.retry.sequence), "the retry's next attempt")
				require.Equal(t, 1, attemptOf(tc.retry, tc.retry.sequence+1), "another event's first")
			}
		})
	}
}

// TestLoopStreamReadAhead: which streams join the scan's combined first read, and how many events
// each may bring.
func TestLoopStreamReadAhead(t *testing.T) {
	t.Parallel()
	notDue := []delivery{retryingAt(5, 1, t0.Add(time.Hour))}
	due := []delivery{retryingAt(5, 1, t0.Add(-time.Second))}
	for _, tc := range []struct {
		name   string
		st     stream
		head   Head
		open   []delivery
		events int // 0: not read ahead
	}{
		{"at its head", stream{acked: 4, position: 4}, Head{LastSequence: 4}, nil, 0},
		{"behind by less than a batch", stream{acked: 4, position: 4}, Head{LastSequence: 7}, nil, 3},
		{"behind by more than a batch", stream{acked: 4, position: 4}, Head{LastSequence: 400}, nil, 100},
		{"reads alone", stream{acked: 4, position: 4, readAlone: true}, Head{LastSequence: 7}, nil, 0},
		{"reconciled first: nothing below the head is read", stream{acked: -1}, Head{LastSequence: 7}, nil, 0},
		{"cursor below the pruned floor", stream{acked: 1, position: 1}, Head{LastSequence: 7, PrunedThrough: 3}, nil, 0},
		{"its next event waits for a retry", stream{acked: 4, position: 4}, Head{LastSequence: 7}, notDue, 0},
		{"its next event's retry is due", stream{acked: 4, position: 4}, Head{LastSequence: 7}, due, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			n, ok := tc.st.readAhead(tc.head, tc.open, t0, NewCursorReconcile, 100)
			require.Equal(t, tc.events, n)
			require.Equal(t, tc.events > 0, ok)
		})
	}
}

// TestLoopStreamTakesFirst: a batch read ahead stands for the first read only if it starts where
// the stream is by then.
func TestLoopStreamTakesFirst(t *testing.T) {
	t.Parallel()
	batch := func(after int64, seqs ...int64) *firstBatch {
		b := &firstBatch{after: after}
		for _, s := range seqs {
			b.events = append(b.events, storedEvent{Event: Event{Sequence: s}})
		}
		return b
	}
	for _, tc := range []struct {
		name  string
		first *firstBatch
		want  bool
	}{
		{"none", nil, false},
		{"starts at the position", batch(4, 5, 6), true},
		{"read before a reconciliation moved the stream", batch(2, 3, 4), false},
		{"empty", batch(4), false},
		{"starts past a hole", batch(4, 6), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			st := stream{position: 4}
			require.Equal(t, tc.want, st.takesFirst(tc.first))
		})
	}
}

// TestLoopStreamAdmit: the event read next must be the one after the position; a later one is a
// hole (errHole), an earlier one a read out of order.
func TestLoopStreamAdmit(t *testing.T) {
	t.Parallel()
	k := eventKey{txid: "9", taskID: "t-5"}
	for _, tc := range []struct {
		name string
		seq  int64
		hole *errHole
		err  string
	}{
		{"the next event", 5, nil, ""},
		{"one missing", 6, &errHole{next: 5, found: 6}, "sequence 5 is missing (read 6 next)"},
		{"several missing", 9, &errHole{next: 5, found: 9}, "sequence 5 is missing (read 9 next)"},
		{"the event at the position again", 4, nil, "project p: read sequence 4 after 4"},
		{"an older event", 2, nil, "project p: read sequence 2 after 4"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			st := stream{project: "p", position: 4, keyAt: -1}
			err := st.admit(storedEvent{Event: Event{Sequence: tc.seq}, key: k})
			if tc.err == "" {
				require.NoError(t, err)
				require.Equal(t, int64(5), st.keyAt)
				require.Equal(t, int64(4), st.position, "admitted, not yet dispatched")
				st.dispatched(Event{Sequence: 5, EventID: "e5"})
				require.Equal(t, k, st.readKey(), "the next read continues after it")
				require.Equal(t, int64(5), st.delivered)
				return
			}
			require.EqualError(t, err, tc.err)
			var h errHole
			require.Equal(t, tc.hole != nil, errors.As(err, &h))
			if tc.hole != nil {
				require.Equal(t, *tc.hole, h)
			}
			require.Equal(t, int64(-1), st.keyAt, "the key is not taken")
		})
	}
}

// TestLoopStreamRedelivered: events this instance delivered before a lease change are passed, not
// handed over again.
func TestLoopStreamRedelivered(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		seq        int64
		passed     bool
		positionTo int64
	}{
		{"below what it delivered", 6, true, 6},
		{"what it delivered last", 8, true, 8},
		{"new", 9, false, 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			st := stream{position: 5, delivered: 8}
			require.Equal(t, tc.passed, st.redelivered(tc.seq))
			require.Equal(t, tc.positionTo, st.position)
		})
	}
}

// TestLoopStreamTakeLease: a new lease restarts the stream at the cursor it came with and forgets
// its open deliveries; the same lease again changes nothing.
func TestLoopStreamTakeLease(t *testing.T) {
	t.Parallel()
	open := []delivery{retryingAt(9, 1, t0)}
	for _, tc := range []struct {
		name           string
		ls             lease
		position       int64
		checkDelivered bool
		openKnown      bool
	}{
		{"the same lease", lease{grant: 1, epoch: 3, acked: 2}, 8, false, true},
		{"a new lease behind what it delivered", lease{grant: 2, epoch: 4, acked: 5}, 5, true, false},
		{"a new lease at what it delivered", lease{grant: 2, epoch: 4, acked: 8}, 8, false, false},
		{"a new lease on a cursor never positioned", lease{grant: 2, epoch: 4, acked: -1}, 0, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			st := stream{lease: 1, epoch: 3, acked: 6, position: 8, delivered: 8, key: eventKey{taskID: "x"}, keyAt: 8, open: open, openKnown: true}
			st.takeLease(tc.ls)
			require.Equal(t, tc.position, st.position)
			require.Equal(t, tc.checkDelivered, st.checkDelivered)
			require.Equal(t, tc.openKnown, st.openKnown)
			if tc.ls.grant != 1 {
				require.Equal(t, tc.ls.epoch, st.epoch)
				require.Equal(t, tc.ls.acked, st.acked)
				require.Equal(t, eventKey{}, st.readKey())
			}
		})
	}
}

// TestLoopStreamCheckedDelivered: after a new lease moved the position back, suppression goes on
// only if the event stored where this instance delivered last is still that event.
func TestLoopStreamCheckedDelivered(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name      string
		storedID  string
		stored    bool
		rewritten bool
	}{
		{"the same event", "e8", true, false},
		{"another event under that sequence", "e8-restored", true, true},
		{"nothing stored there", "", false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			st := stream{position: 5, delivered: 8, deliveredID: "e8", checkDelivered: true}
			require.Equal(t, tc.rewritten, st.checkedDelivered(tc.storedID, tc.stored))
			require.False(t, st.checkDelivered)
			if tc.rewritten {
				require.Equal(t, int64(5), st.delivered, "nothing above the position is suppressed")
				require.False(t, st.redelivered(6))
			} else {
				require.True(t, st.redelivered(6))
			}
		})
	}
}

// TestLoopStreamReconciled: a reconciliation restarts every position at the head and supersedes the
// retries at or below it; replay requests stay.
func TestLoopStreamReconciled(t *testing.T) {
	t.Parallel()
	st := stream{acked: 2, position: 4, delivered: 9, deliveredID: "e9", checkDelivered: true, keyAt: 4, retryDue: t0,
		open: []delivery{replayOf(1), retryingAt(5, 2, t0), retryingAt(12, 1, t0)}}
	st.reconciled(10)
	require.Equal(t, stream{acked: 10, position: 10, delivered: 10, keyAt: -1, open: []delivery{replayOf(1), retryingAt(12, 1, t0)}}, st)
}

// TestLoopStreamSawHead: a head below the position, or restored ticks, rewind the stream, which
// then restarts from its durable cursor.
func TestLoopStreamSawHead(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name     string
		position int64
		head     int64
		restored bool
		rewound  bool
	}{
		{"head ahead", 5, 7, false, false},
		{"head at the position", 5, 5, false, false},
		{"head behind the position", 5, 3, false, true},
		{"ticks restored", 5, 7, true, true},
		{"ticks restored before the stream moved", 0, 7, true, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			st := stream{acked: 2, position: tc.position, delivered: tc.position, retryDue: t0}
			st.sawHead(Head{LastSequence: tc.head}, tc.restored)
			require.Equal(t, tc.rewound, st.rewound)
			if st.rewound {
				st.restartAt(2)
				require.False(t, st.rewound)
				require.False(t, st.blocked())
				require.Equal(t, int64(2), st.position)
				require.True(t, st.checkDelivered)
			}
		})
	}
}

// TestLoopStreamAcks: which cursor write a stream owes, and when it is due: by count (BatchSize) or
// by time (AckInterval after the stream first went beyond its cursor).
func TestLoopStreamAcks(t *testing.T) {
	t.Parallel()
	const batch = 10
	interval := time.Second
	for _, tc := range []struct {
		name         string
		st           stream
		now          time.Time
		due          bool
		deadline     time.Time // zero: none after the call
		unackedSince time.Time // after the call
	}{
		{"nothing beyond the cursor", stream{epoch: 1, acked: 5, position: 5}, t0, false, time.Time{}, time.Time{}},
		{"no lease yet", stream{acked: -1, position: 3}, t0, false, time.Time{}, time.Time{}},
		{"waiting less than the interval", stream{epoch: 1, acked: 5, position: 7, unackedSince: t0}, t0.Add(999 * time.Millisecond), false, t0.Add(interval), t0},
		{"waiting the interval", stream{epoch: 1, acked: 5, position: 7, unackedSince: t0}, t0.Add(interval), true, time.Time{}, time.Time{}},
		{"a batch beyond the cursor", stream{epoch: 1, acked: 5, position: 15, unackedSince: t0}, t0, true, time.Time{}, time.Time{}},
		{"moved without a dispatch: waits from now", stream{epoch: 1, acked: 5, position: 6}, t0, false, t0.Add(interval), t0},
		{"a new cursor, not positioned yet: its first write waits from now", stream{epoch: 1, acked: -1, position: 0}, t0, false, t0.Add(interval), t0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			st := tc.st
			a, due := st.dueAck(tc.now, batch, interval)
			require.Equal(t, tc.due, due)
			if due {
				require.Equal(t, ack{st.project, st.epoch, st.position}, a)
			}
			require.Equal(t, tc.unackedSince, st.unackedSince)
			at, ok := st.ackDeadline(interval)
			require.Equal(t, !tc.deadline.IsZero(), ok)
			require.Equal(t, tc.deadline, at)
		})
	}
}

// TestLoopStreamBatchAckAndRelease: the write due in the middle of a scan, and the one owed before
// a dropped lease is released.
func TestLoopStreamBatchAckAndRelease(t *testing.T) {
	t.Parallel()
	st := stream{project: "p", lease: 3, epoch: 7, acked: 5, position: 14, unackedSince: t0}
	_, ok := st.batchAck(10)
	require.False(t, ok, "nine beyond the cursor")
	st.position = 15
	a, ok := st.batchAck(10)
	require.True(t, ok)
	require.Equal(t, ack{"p", 7, 15}, a)
	require.True(t, st.unackedSince.IsZero())

	_, ok = st.releaseAck(lease{grant: 2, epoch: 6})
	require.False(t, ok, "another lease of the project")
	st.unackedSince = t0
	a, ok = st.releaseAck(lease{grant: 3, epoch: 7})
	require.True(t, ok)
	require.Equal(t, ack{"p", 7, 15}, a)
	require.True(t, st.unackedSince.IsZero())
	st.ackWritten(a)
	require.Equal(t, int64(15), st.acked)
	_, ok = st.releaseAck(lease{grant: 3, epoch: 7})
	require.False(t, ok, "written")
	st.ackWritten(ack{"p", 6, 20})
	require.Equal(t, int64(15), st.acked, "a write under another epoch")
	st.ackWritten(ack{"p", 7, 12})
	require.Equal(t, int64(15), st.acked, "an older write")
}

// TestLoopStreamRetryParkResolve: what a recorded failure, a parked dead letter and a resolved
// retry leave in the stream.
func TestLoopStreamRetryParkResolve(t *testing.T) {
	t.Parallel()
	st := stream{acked: 4, position: 4, open: []delivery{replayOf(2)}, openKnown: true}
	st.retryLater(retryingAt(5, 1, t0))
	require.True(t, st.blocked())
	require.Equal(t, t0, st.retryDue)
	require.Equal(t, []delivery{replayOf(2), retryingAt(5, 1, t0)}, st.open)
	st.retryLater(retryingAt(5, 2, t0.Add(time.Minute)))
	require.Equal(t, []delivery{replayOf(2), retryingAt(5, 2, t0.Add(time.Minute))}, st.open, "replaced, in sequence order")

	parked := st
	parked.parked(5)
	require.Equal(t, int64(5), parked.acked)
	require.Equal(t, int64(5), parked.position)
	require.Equal(t, []delivery{replayOf(2)}, parked.open)

	resolved := st
	resolved.position = 5
	resolved.resolved(5)
	require.Equal(t, int64(5), resolved.acked)
	require.Equal(t, []delivery{replayOf(2)}, resolved.open)
	require.Len(t, st.open, 2, "never changed in place: a scan may hold the slice")
}

// TestLoopStreamReadAloneAfter: a project that failed alone keeps reading alone until it succeeds;
// a lost lease or a stop says nothing of its rows.
func TestLoopStreamReadAloneAfter(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		before     bool
		err        error
		readsAlone bool
	}{
		{"a failure", false, errors.New("invalid input syntax"), true},
		{"a success", true, nil, false},
		{"a lost lease", true, fmt.Errorf("write: %w", ErrLeaseLost), true},
		{"a lost lease, not a suspect", false, ErrLeaseLost, false},
		{"a stop", true, context.Canceled, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			st := stream{readAlone: tc.before}
			st.readAloneAfter(tc.err)
			require.Equal(t, tc.readsAlone, st.readAlone)
		})
	}
}

// TestLoopStreamsSync: the streams follow the lease table; a stream whose lease is gone stays
// (what it delivered is remembered) but waits for no retry.
func TestLoopStreamsSync(t *testing.T) {
	t.Parallel()
	s := streams{"gone": {project: "gone", lease: 1, epoch: 1, retryDue: t0}, "kept": {project: "kept", lease: 2, epoch: 1, position: 9, acked: 9, retryDue: t0}}
	leased := s.sync(map[string]lease{"new": {grant: 5, epoch: 1, acked: -1}, "kept": {grant: 2, epoch: 1, acked: 3}})
	require.Equal(t, []string{"kept", "new"}, leased)
	require.Len(t, s, 3)
	require.False(t, s["gone"].blocked())
	require.True(t, s["kept"].blocked(), "still leased: its retry still counts")
	require.Equal(t, int64(9), s["kept"].position, "the same lease")
	require.Equal(t, stream{project: "new", lease: 5, epoch: 1, acked: -1, keyAt: -1}, *s["new"])
	at, ok := s.earliestRetry()
	require.True(t, ok)
	require.Equal(t, t0, at)
}

// TestLoopStreamsRetriesAndAcks: the earliest retry and cursor write over all streams, and the
// writes due, in project order.
func TestLoopStreamsRetriesAndAcks(t *testing.T) {
	t.Parallel()
	interval := time.Second
	s := streams{
		"a": {project: "a", epoch: 1, acked: 1, position: 3, unackedSince: t0.Add(-2 * time.Second)},
		"b": {project: "b", epoch: 2, acked: 1, position: 2, unackedSince: t0.Add(-time.Second / 2), retryDue: t0.Add(time.Minute)},
		"c": {project: "c", epoch: 3, acked: 1, position: 1, retryDue: t0.Add(time.Second)},
		"d": {project: "d", epoch: 4, acked: 0, position: 20, unackedSince: t0},
		"e": {project: "e", epoch: 5, acked: 4, position: 5},
	}
	at, ok := s.earliestRetry()
	require.True(t, ok)
	require.Equal(t, t0.Add(time.Second), at, "c's retry is due first")
	at, ok = s.ackDeadline(interval)
	require.True(t, ok)
	require.Equal(t, t0.Add(-time.Second), at, "a's write is overdue")
	require.Equal(t, []ack{{"a", 1, 3}, {"b", 2, 2}, {"d", 4, 20}, {"e", 5, 5}}, s.pendingAcks())

	require.Equal(t, []ack{{"a", 1, 3}, {"d", 4, 20}}, s.dueAcks(t0, 10, interval), "a by time, d by count")
	at, ok = s.ackDeadline(interval)
	require.True(t, ok)
	require.Equal(t, t0.Add(interval/2), at, "b's write next; e waits from now")
	require.Equal(t, t0, s["e"].unackedSince)

	_, ok = streams{"x": {epoch: 1, acked: 1, position: 1}}.earliestRetry()
	require.False(t, ok)
}

// TestLoopStreamsOpenDeliveries: which streams read their open deliveries, and what a read (or its
// failure) leaves them knowing.
func TestLoopStreamsOpenDeliveries(t *testing.T) {
	t.Parallel()
	fresh := func() streams {
		return streams{"a": {project: "a", openKnown: true}, "b": {project: "b", openKnown: true}, "c": {project: "c"}}
	}
	for _, tc := range []struct {
		name    string
		stale   map[string]struct{}
		read    map[string][]delivery
		err     error
		unknown []string // after the read of every stream's open deliveries
	}{
		{"nothing stale, all read", nil, map[string][]delivery{"a": {replayOf(1)}}, nil, nil},
		{"one project failed", map[string]struct{}{"a": {}}, nil, &ProjectErrors{Op: "read open deliveries", Failed: map[string]error{"b": errors.New("bad row")}}, []string{"b"}},
		{"the read failed", map[string]struct{}{"": {}}, nil, errors.New("connection reset"), []string{"a", "b", "c"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := fresh()
			s.forgetOpen(tc.stale)
			var want []string
			for _, p := range []string{"a", "b", "c"} {
				_, one := tc.stale[p]
				_, all := tc.stale[""]
				if one || all || p == "c" {
					want = append(want, p)
				}
			}
			require.Equal(t, want, s.openUnknown([]string{"a", "b", "c"}))
			s.takeOpen([]string{"a", "b", "c"}, tc.read, tc.err)
			require.Equal(t, tc.unknown, s.openUnknown([]string{"a", "b", "c"}))
			if tc.err == nil {
				require.Equal(t, tc.read["a"], s["a"].open)
			}
		})
	}
}

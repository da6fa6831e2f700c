package outbox

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"
)

// nextBatch is a project's next batch, read while the loop dispatches the batch before it
// (scanLoop.prefetch): a stream with a backlog waits for the server's read and the listeners
// one after the other no longer, but for the slower of the two.
type nextBatch struct {
	after  int64    // the sequence of the last event of the batch being dispatched
	key    eventKey // that event's key
	done   chan struct{}
	events []storedEvent
	err    error
}

// prefetch starts reading the batch after batch, on another connection, when the stream is
// sure to need it if batch is dispatched whole: batch is full, the head is beyond it, and no
// delivery waits to be retried (a retry that fails again stops the stream). It returns nil
// otherwise. The read continues from the key of batch's last event, as the loop's own read
// would once that event is dispatched; take hands it over only if the stream stands there.
func (l *scanLoop) prefetch(ctx context.Context, st *stream, head Head, batch []storedEvent, retrying *delivery) *nextBatch {
	if len(batch) < l.cfg.BatchSize || retrying != nil {
		return nil
	}
	last := batch[len(batch)-1]
	if last.bad != nil || last.Sequence >= head.LastSequence {
		return nil
	}
	nb := &nextBatch{after: last.Sequence, key: last.key, done: make(chan struct{})}
	db, project, limit := l.readPool(), st.project, l.cfg.BatchSize
	go func() {
		defer close(nb.done)
		nb.events, nb.err = readEvents(ctx, db, project, nb.after, limit, nb.key)
	}()
	return nb
}

// take waits for the read and returns its events when the stream stands where the read
// continued from and it brought something; otherwise it reports false, and the loop reads as
// it would have without it (a failed read is read again, and its error handled, there).
func (nb *nextBatch) take(st *stream) ([]storedEvent, bool) {
	if nb == nil {
		return nil, false
	}
	<-nb.done
	if nb.err != nil || len(nb.events) == 0 || st.position != nb.after || st.readKey() != nb.key {
		return nil, false
	}
	return nb.events, true
}

// wait lets a read that will not be taken finish, so that nothing of the scan outlives it.
func (nb *nextBatch) wait() {
	if nb != nil {
		<-nb.done
	}
}

// readPool is where the scan reads events now: the standby while the scan reads there (see
// scanLoop.read), the primary otherwise. A read made on it outside scanLoop.read changes
// nothing of the loop's view when it fails.
func (l *scanLoop) readPool() *pgxpool.Pool {
	if r := l.reads; r != nil && r.scanStandby {
		return r.standby
	}
	return l.pool
}

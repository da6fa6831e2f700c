package outbox

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The acknowledger writes cursors. A cursor write names the lease epoch it was granted, so a
// process that lost its lease writes nothing. Writes are batched (one statement for every
// stream that owes one), and one may be in flight in the background while the loop reads and
// dispatches the next batch, so that the commit's WAL flush overlaps useful work. Only the scan
// loop's goroutine uses it (and the consumer's shutdown, after the loop returned).

// ack is an acknowledgement to write: the cursor of project under lease epoch.
type ack struct {
	project  string
	epoch    int64
	sequence int64
}

// ackSQL writes the cursors of consumer @consumer's instance @owner: for each of @projects
// the sequence in @sequences, under the epoch in @epochs (the arrays in step), while the lease
// is unexpired on the clock shifted by @clock_offset. ROWS FROM spells out the multi-argument
// unnest, whose shorthand exists only unqualified. The rows are locked first, in project
// order, as the lease heartbeat locks them (see renewSQL): the two run at once on two
// connections.
const ackSQL = `
WITH locked AS (
    SELECT k.project_id FROM lifecycle_consumer_cursors k
    WHERE k.consumer_id = @consumer AND k.lease_owner = @owner AND k.project_id = ANY (@projects::text[])
    ORDER BY k.project_id
    FOR NO KEY UPDATE
)
UPDATE lifecycle_consumer_cursors c
SET last_acked_sequence = a.sequence, acked_at = pg_catalog.now()
FROM ROWS FROM (pg_catalog.unnest(@projects::text[]), pg_catalog.unnest(@epochs::bigint[]), pg_catalog.unnest(@sequences::bigint[]))
    AS a(project_id, epoch, sequence)
JOIN locked l ON l.project_id = a.project_id
WHERE c.consumer_id = @consumer AND c.lease_owner = @owner
  AND c.project_id = a.project_id AND c.lease_epoch = a.epoch
  AND c.lease_expires_at > pg_catalog.now() + @clock_offset::interval AND c.retired_at IS NULL
  AND (c.last_acked_sequence IS NULL OR c.last_acked_sequence <= a.sequence)
RETURNING c.project_id`

type acknowledger struct {
	id    ConsumerID
	owner string
	pool  *pgxpool.Pool
	clock Clock
	// apply tells the loop what a write did: which projects it wrote, or the error. A project
	// of acks missing from written lost its lease.
	apply    func(acks []ack, written []string, err error)
	inflight *inflightAck
}

// inflightAck is an acknowledgement being written in the background.
type inflightAck struct {
	acks    []ack
	written []string
	err     error
	done    chan struct{}
}

// start writes acks in the background, after applying the write still in flight: at most one
// is in flight, on a second pool connection. The loop applies its outcome when it next awaits.
func (a *acknowledger) start(ctx context.Context, acks ...ack) {
	a.await()
	if len(acks) == 0 {
		return
	}
	p := &inflightAck{acks: acks, done: make(chan struct{})}
	a.inflight = p
	go func() {
		defer close(p.done)
		p.written, p.err = a.write(ctx, p.acks)
	}()
}

// await waits for the acknowledgement in flight, if any, and applies its outcome.
func (a *acknowledger) await() {
	p := a.inflight
	if p == nil {
		return
	}
	a.inflight = nil
	<-p.done
	a.apply(p.acks, p.written, p.err)
}

// flush writes acks in one fenced statement, after the one in flight, and returns the
// statement's error (which apply has been told too).
func (a *acknowledger) flush(ctx context.Context, acks []ack) error {
	a.await()
	if len(acks) == 0 {
		return nil
	}
	written, err := a.write(ctx, acks)
	a.apply(acks, written, err)
	return err
}

// write runs the fenced acknowledgement statement and returns the projects it wrote.
func (a *acknowledger) write(ctx context.Context, acks []ack) ([]string, error) {
	projects := make([]string, len(acks))
	epochs := make([]int64, len(acks))
	seqs := make([]int64, len(acks))
	for i, k := range acks {
		projects[i], epochs[i], seqs[i] = k.project, k.epoch, k.sequence
	}
	rows, err := a.pool.Query(ctx, ackSQL, pgx.StrictNamedArgs{"consumer": a.id, "owner": a.owner, "projects": projects,
		"epochs": epochs, "sequences": seqs, "clock_offset": a.clock.Offset()})
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

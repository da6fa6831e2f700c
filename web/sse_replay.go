package web

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgtype"
	"golang.org/x/sync/singleflight"

	"fusion/outbox"
)

// The event stream replays what a reconnecting client missed from its in-memory ring and,
// further back, from the retained outbox. Outbox reads are shared: the range a client needs is
// read in fixed, aligned pages of replayPageSize sequences, each read by one statement however
// many clients want it at once (singleflight) and then kept in a small cache. A herd of
// reconnecting clients, wherever their positions, costs one read per page and project, not one
// per client.

const (
	// replayPageSize is the width of one outbox read, in sequences. Pages are aligned
	// (1-500, 501-1000, ...) so that clients at different positions share them.
	replayPageSize = 500
	// replayCachePages is how many pages the cache keeps, about 200 KB each.
	replayCachePages = 64
)

// errBelowFloor means the events a client needs were pruned.
var errBelowFloor = errors.New("below the pruned floor")

// sseHeadSQL is a project's last assigned sequence: where a new client of a project the
// handler has not seen yet starts.
const sseHeadSQL = `
SELECT coalesce(pg_catalog.max(last_sequence), 0) FROM lifecycle_outbox_head WHERE project_id = $1`

// ssePageSQL reads one page of a project's events together with its head and pruned floor,
// in one statement, so that the page and the bounds it is judged by come from one snapshot.
// The read starts at the floor when the page starts below it: the reader stops at the first
// event it cannot find, and the pruned ones are gone. LEAST and GREATEST are SQL syntax, not
// functions: pg_catalog holds no function of that name to qualify, and the search path cannot
// redirect them.
const ssePageSQL = `
SELECT h.last_sequence, h.pruned_through,
       e.sequence, e.event_type, e.task_id, e.deleted_at, e.prior_column, e.archived,
       e.writer_process_id, e.occurred_at, e.payload_version
FROM lifecycle_outbox_head h
CROSS JOIN LATERAL (SELECT GREATEST($2::bigint, h.pruned_through) AS after) s
LEFT JOIN LATERAL (
    SELECT o.sequence, o.event_type::text AS event_type, o.task_id, o.deleted_at,
           coalesce(o.prior_column, '') AS prior_column, o.archived, o.writer_process_id,
           o.occurred_at, o.payload_version
    FROM lifecycle_outbox_read(h.project_id, s.after, LEAST(GREATEST($3::bigint - s.after, 1), 100000)::integer,
                               NULL, NULL, NULL) o
    WHERE o.sequence <= $3 AND s.after < h.last_sequence
) e ON true
WHERE h.project_id = $1
ORDER BY e.sequence`

// replayPage is one aligned page of a project's stream as it was read.
type replayPage struct {
	// through is the last sequence the page is complete to: the page's end, or the head when
	// it was read. Events in (start, through] are all here except those at or below floor.
	through int64
	floor   int64 // the pruned floor when it was read
	frames  []sseFrame
}

type pageKey struct {
	project string
	index   int64 // the page holds sequences (index*replayPageSize, (index+1)*replayPageSize]
}

// outboxReplay reads the retained outbox for the event stream.
type outboxReplay struct {
	db outbox.DBTX
	// timeout bounds one shared read (SSEOptions.ReplayReadTimeout): it runs on a context of
	// its own, since the client that started it may leave while others wait for it.
	timeout time.Duration
	group   singleflight.Group

	mu    sync.Mutex
	pages map[pageKey]*replayPage
	order []pageKey // oldest first, for eviction

	pageReads atomic.Int64
	headReads atomic.Int64
}

func newOutboxReplay(db outbox.DBTX, timeout time.Duration) *outboxReplay {
	return &outboxReplay{db: db, timeout: timeout, pages: map[pageKey]*replayPage{}}
}

// head reads a project's last assigned sequence; concurrent callers share one read.
func (o *outboxReplay) head(ctx context.Context, project string) (int64, error) {
	v, err := o.shared(ctx, "head\x00"+project, func(ctx context.Context) (any, error) {
		o.headReads.Add(1)
		var head int64
		if err := o.db.QueryRow(ctx, sseHeadSQL, project).Scan(&head); err != nil {
			return nil, fmt.Errorf("read head of %s: %w", project, err)
		}
		return head, nil
	})
	if err != nil {
		return 0, err
	}
	return v.(int64), nil
}

// events returns the frames of project after sequence after, through at most upTo, in order
// and without a gap; fewer than asked when a page ends first. It returns errBelowFloor when
// any of them was pruned.
func (o *outboxReplay) events(ctx context.Context, project string, after, upTo int64) ([]sseFrame, error) {
	key := pageKey{project, after / replayPageSize}
	need := min(upTo, (key.index+1)*replayPageSize)
	p, err := o.page(ctx, key, need)
	if err != nil {
		return nil, err
	}
	if after < p.floor {
		return nil, errBelowFloor
	}
	out := make([]sseFrame, 0, need-after)
	for _, f := range p.frames {
		if f.seq > after && f.seq <= need {
			out = append(out, f)
		}
	}
	// The page is complete through need, so every event in (after, need] is there unless
	// something removed it after the floor was read: that is a gap, and a gap is a reset.
	if int64(len(out)) != need-after || (len(out) > 0 && out[0].seq != after+1) {
		return nil, errBelowFloor
	}
	return out, nil
}

// page returns the cached page when it covers need, and reads it otherwise.
func (o *outboxReplay) page(ctx context.Context, key pageKey, need int64) (*replayPage, error) {
	for range 3 {
		if p := o.cached(key, need); p != nil {
			return p, nil
		}
		flight := "page\x00" + key.project + "\x00" + strconv.FormatInt(key.index, 10)
		v, err := o.shared(ctx, flight, func(ctx context.Context) (any, error) {
			// A flight that ended between the look above and this one may have cached the
			// page already: look again rather than read it twice.
			if p := o.cached(key, need); p != nil {
				return p, nil
			}
			return o.readPage(ctx, key)
		})
		if err != nil {
			return nil, err
		}
		if p := v.(*replayPage); p.through >= need {
			return p, nil
		}
		// That read started before the head reached need: read again.
	}
	return nil, fmt.Errorf("read %s events through %d: the head stays behind", key.project, need)
}

// cached is the cached page of key when it covers need, else nil.
func (o *outboxReplay) cached(key pageKey, need int64) *replayPage {
	o.mu.Lock()
	defer o.mu.Unlock()
	if p := o.pages[key]; p != nil && p.through >= need {
		return p
	}
	return nil
}

func (o *outboxReplay) readPage(ctx context.Context, key pageKey) (*replayPage, error) {
	o.pageReads.Add(1)
	start, end := key.index*replayPageSize, (key.index+1)*replayPageSize
	rows, err := o.db.Query(ctx, ssePageSQL, key.project, start, end)
	if err != nil {
		return nil, fmt.Errorf("read %s events: %w", key.project, err)
	}
	defer rows.Close()
	p := &replayPage{}
	var head int64
	for rows.Next() {
		var (
			seq, version          *int64
			typ, task, writer     *string
			prior                 *string
			archived              *bool
			deletedAt, occurredAt pgtype.Timestamptz
		)
		if err := rows.Scan(&head, &p.floor, &seq, &typ, &task, &deletedAt, &prior, &archived, &writer, &occurredAt, &version); err != nil {
			return nil, fmt.Errorf("decode %s event: %w", key.project, err)
		}
		if seq == nil {
			continue // the project has a head but no event in this page
		}
		ev := outbox.Event{ProjectID: key.project, Sequence: *seq, EventType: *typ, TaskID: *task, DeletedAt: deletedAt.Time,
			PriorColumn: *prior, Archived: *archived, WriterProcessID: *writer, OccurredAt: occurredAt.Time, PayloadVersion: int(*version)}
		if outbox.CheckStoredEvent(ev, deletedAt, occurredAt) != nil {
			// A row the consumer parks as undecodable (written before the database checked
			// rows): the stream moves past it without sending it, as the consumer does.
			p.frames = append(p.frames, sseFrame{seq: ev.Sequence})
			continue
		}
		ev.EventID = outbox.TaskDeletedEventID(ev.TaskID, ev.DeletedAt)
		f, err := newFrame(ev)
		if err != nil {
			return nil, err
		}
		p.frames = append(p.frames, f)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read %s events: %w", key.project, err)
	}
	p.through = min(end, head)
	o.mu.Lock()
	defer o.mu.Unlock()
	if old, ok := o.pages[key]; !ok {
		o.order = append(o.order, key)
		if len(o.order) > replayCachePages {
			delete(o.pages, o.order[0])
			o.order = o.order[1:]
		}
	} else if old.through > p.through {
		return old, nil // a later read finished first
	}
	o.pages[key] = p
	return p, nil
}

// shared runs fn once for every concurrent caller with the same key, on a context that
// outlives any one of them.
func (o *outboxReplay) shared(ctx context.Context, key string, fn func(context.Context) (any, error)) (any, error) {
	ch := o.group.DoChan(key, func() (any, error) {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), o.timeout)
		defer cancel()
		return fn(rctx)
	})
	select {
	case res := <-ch:
		return res.Val, res.Err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// sseFrame is one event as the stream sends it: the sequence and the JSON payload that every
// client shares (each client's frame differs only in its ID line).
type sseFrame struct {
	seq  int64
	data []byte
}

// ssePayload is the stream's event payload: the stored event, marked observed. It is the
// same whether the event came live from the consumer or was replayed from the outbox, so a
// page can compare frames byte for byte.
type ssePayload struct {
	outbox.Event
	Observed bool `json:"observed"`
}

func newFrame(ev outbox.Event) (sseFrame, error) {
	ev.DeletedAt, ev.OccurredAt = ev.DeletedAt.UTC(), ev.OccurredAt.UTC()
	data, err := json.Marshal(ssePayload{Event: ev, Observed: true})
	if err != nil {
		return sseFrame{}, fmt.Errorf("encode event: %w", err)
	}
	return sseFrame{seq: ev.Sequence, data: data}, nil
}

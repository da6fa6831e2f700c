package outbox

import (
	"context"
	"errors"
	"maps"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"weak"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Consumers of one process that read through the same pool share their reads of heads and
// of first batches: a consumer that asks for what another one is reading at that moment (the
// same statement with the same arguments) waits for that statement's rows instead of sending
// its own. After a tick, every consumer that is caught up asks exactly that, so K consumers
// of a process cost the database about one read per tick instead of K.
//
// Only an answer that is as good as the consumer's own would be is taken:
//   - heads must come from a snapshot that holds every tick the consumer saw and every tick
//     announced to it when its scan began, or the consumer could miss a woken tick or take an
//     old head for a restored database (sharedHeads);
//   - a first batch may be older than the consumer's heads: a project that it shows short or
//     not at all is read again alone, as the loop does for any short batch (scanProject).
//
// The pool is the unit of sharing because its role is what row-level security judges: two
// pools of the same role share nothing. A read that fails because the consumer that sent it
// stopped is read again by each waiting consumer.
type readShare struct {
	mu    sync.Mutex
	calls map[string]*sharedCall
}

// sharedCall is one statement in flight and those waiting for its result.
type sharedCall struct {
	done    chan struct{}
	val     any
	err     error
	waiters int
}

// readShares holds the share of each pool while the pool lives.
var readShares sync.Map // weak.Pointer[pgxpool.Pool] -> *readShare

// shareOf returns the share of the consumers reading through pool.
func shareOf(pool *pgxpool.Pool) *readShare {
	key := weak.Make(pool)
	if v, ok := readShares.Load(key); ok {
		return v.(*readShare)
	}
	v, loaded := readShares.LoadOrStore(key, &readShare{calls: map[string]*sharedCall{}})
	if !loaded {
		runtime.AddCleanup(pool, func(k weak.Pointer[pgxpool.Pool]) { readShares.Delete(k) }, key)
	}
	return v.(*readShare)
}

// do runs read for key, or waits for the run of another consumer in flight with the same key
// and returns its value when good says it will do (shared is then true). A value shared
// between consumers must be copied before either changes it.
func (s *readShare) do(ctx context.Context, key string, read func() (any, error), good func(any) bool) (v any, shared bool, err error) {
	s.mu.Lock()
	if c, ok := s.calls[key]; ok {
		c.waiters++
		s.mu.Unlock()
		select {
		case <-c.done:
		case <-ctx.Done():
			return nil, false, ctx.Err()
		}
		if c.err == nil && good(c.val) {
			return c.val, true, nil
		}
		if c.err != nil && !errors.Is(c.err, context.Canceled) && !errors.Is(c.err, context.DeadlineExceeded) {
			return nil, false, c.err // what this consumer's own statement would have met
		}
		v, err := read()
		return v, false, err
	}
	c := &sharedCall{done: make(chan struct{})}
	s.calls[key] = c
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.calls, key)
		s.mu.Unlock()
		close(c.done)
	}()
	c.val, c.err = read()
	return c.val, false, c.err
}

// headsKey names a read of heads: the projects, in the loop's order, and the tick whose time
// the read also returns.
func headsKey(projects []string, seenTick int64) string {
	return "heads\x00" + strconv.FormatInt(seenTick, 10) + "\x00" + strings.Join(projects, "\x00")
}

// firstKey names a combined first read: the projects, their positions and the limit.
func firstKey(projects []string, after []int64, limit int) string {
	var b strings.Builder
	b.WriteString("first\x00")
	b.WriteString(strconv.Itoa(limit))
	for i, p := range projects {
		b.WriteByte(0)
		b.WriteString(p)
		b.WriteByte(0)
		b.WriteString(strconv.FormatInt(after[i], 10))
	}
	return b.String()
}

// ticksKey names a read of ticks: the projects, the tick it reads after and the limit. The
// positions are not in it: each consumer takes its own batches from the shared rows.
func ticksKey(projects []string, tick int64, limit int) string {
	return "ticks\x00" + strconv.FormatInt(tick, 10) + "\x00" + strconv.Itoa(limit) + "\x00" + strings.Join(projects, "\x00")
}

// sharedHeads reads heads as queryHeads does, sharing the read with the pool's other consumers
// when its snapshot holds tick want (see readShare).
func sharedHeads(ctx context.Context, pool *pgxpool.Pool, projects []string, seenTick, want int64) (hr headsRead, shared bool, err error) {
	v, shared, err := shareOf(pool).do(ctx, headsKey(projects, seenTick), func() (any, error) {
		return queryHeads(ctx, pool, projects, seenTick, false)
	}, func(v any) bool { return v.(headsRead).newest >= want })
	if err != nil {
		return headsRead{}, false, err
	}
	hr = v.(headsRead)
	if shared {
		hr.heads = maps.Clone(hr.heads)
	}
	return hr, shared, nil
}

// sharedFirstEvents reads first batches as readFirstEvents does, sharing the read with the
// pool's other consumers (see readShare).
func sharedFirstEvents(ctx context.Context, pool *pgxpool.Pool, projects []string, after []int64, limit, capacity int) (map[string]firstBatch, bool, error) {
	v, shared, err := shareOf(pool).do(ctx, firstKey(projects, after, limit), func() (any, error) {
		return readFirstEvents(ctx, pool, projects, after, limit, capacity)
	}, func(any) bool { return true })
	if err != nil {
		return nil, false, err
	}
	first := v.(map[string]firstBatch)
	if shared {
		own := make(map[string]firstBatch, len(first))
		for p, b := range first {
			own[p] = firstBatch{after: b.after, events: slices.Clone(b.events)}
		}
		first = own
	}
	return first, shared, nil
}

// sharedTickEvents reads ticks as readTickEvents does, sharing the read with the pool's other
// consumers (see readShare). The read is shared as it came back; tickRead.served gives each
// consumer batches of its own.
func sharedTickEvents(ctx context.Context, pool *pgxpool.Pool, projects []string, tick int64, limit, capacity int) (tickRead, bool, error) {
	v, shared, err := shareOf(pool).do(ctx, ticksKey(projects, tick, limit), func() (any, error) {
		return readTickEvents(ctx, pool, projects, tick, limit, capacity)
	}, func(any) bool { return true })
	if err != nil {
		return tickRead{}, false, err
	}
	return v.(tickRead), shared, nil
}

// sharedTicksSince reads ticks with their state as readTicksSince does, sharing the read with
// the pool's other consumers when its snapshot holds tick want (see readShare), as reads of
// heads are shared: a read older than a tick the consumer saw or was announced would not
// stand for its heads.
func sharedTicksSince(ctx context.Context, pool *pgxpool.Pool, projects []string, tick int64, limit int, seen, want int64) (tickRead, bool, error) {
	key := "since\x00" + strconv.FormatInt(seen, 10) + "\x00" + ticksKey(projects, tick, limit)
	v, shared, err := shareOf(pool).do(ctx, key, func() (any, error) {
		return readTicksSince(ctx, pool, projects, tick, limit, min(limit, 256), seen)
	}, func(v any) bool { return v.(tickRead).state.newest >= want })
	if err != nil {
		return tickRead{}, false, err
	}
	return v.(tickRead), shared, nil
}

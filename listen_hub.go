package outbox

import (
	"context"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Consumers of one process share one LISTEN connection per pool (or per Config.ListenDSN) and
// channel: a hub. The server wakes each listening backend on every notification, so K
// consumers listening on K connections cost the primary K backend wake-ups per tick; on one
// connection they cost one, whatever K. The hub connects, listens, reconnects with backoff,
// and tells every member waker what happened (connected, lost, each notification); each waker
// keeps its own self-test, state, metrics and logs. The connection closes when the last member
// leaves.
type listenHub struct {
	key hubKey

	cancel context.CancelFunc
	done   chan struct{}

	mu      sync.Mutex // held while members are told anything, so each sees one order
	members map[*waker]struct{}
	up      bool // LISTEN is in place
	tried   bool // an attempt has ended, in LISTEN or in failure
}

// hubKey names a hub: the channel and where its connection comes from (the pool, or
// ListenDSN when set). A hub is removed when its last member leaves, so it keeps its pool no
// longer than they do.
type hubKey struct {
	pool    *pgxpool.Pool // nil when dsn is set
	dsn     string
	channel string
}

var hubs = struct {
	mu sync.Mutex
	m  map[hubKey]*listenHub
}{m: map[hubKey]*listenHub{}}

// joinHub makes wk a member of the hub for its pool or ListenDSN and its channel, starting
// the hub if there is none. A member joining a hub that listens is told it is connected at
// once; one joining a hub that is reconnecting is told it may start (polling meanwhile).
func joinHub(wk *waker) *listenHub {
	key := hubKey{dsn: wk.cfg.ListenDSN, channel: wk.cfg.TickChannel}
	if key.dsn == "" {
		key.pool = wk.pool
	}
	hubs.mu.Lock()
	defer hubs.mu.Unlock()
	h := hubs.m[key]
	if h == nil {
		ctx, cancel := context.WithCancel(context.Background())
		h = &listenHub{key: key, cancel: cancel, done: make(chan struct{}), members: map[*waker]struct{}{}}
		hubs.m[key] = h
		go h.run(ctx)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.members[wk] = struct{}{}
	switch {
	case h.up:
		wk.connected()
	case h.tried:
		wk.ready()
	}
	return h
}

// leave removes wk from the hub; the last member to leave closes the connection and waits for
// the hub to end.
func (h *listenHub) leave(wk *waker) {
	hubs.mu.Lock()
	h.mu.Lock()
	delete(h.members, wk)
	last := len(h.members) == 0
	h.mu.Unlock()
	if last {
		delete(hubs.m, h.key)
	}
	hubs.mu.Unlock()
	if last {
		h.cancel()
		<-h.done
	}
}

// tell runs fn for every member, under the hub's lock: fn must not block.
func (h *listenHub) tell(fn func(*waker)) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for wk := range h.members {
		fn(wk)
	}
}

// become records whether LISTEN is in place and tells every member so (fn), under one lock:
// a member joining meanwhile sees the state its fellows were told.
func (h *listenHub) become(up bool, fn func(*waker)) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.up, h.tried = up, true
	for wk := range h.members {
		fn(wk)
	}
}

// run keeps the connection listening until the last member leaves.
func (h *listenHub) run(ctx context.Context) {
	defer close(h.done)
	b := newBackoff()
	for {
		listened, err := h.listenOnce(ctx)
		if ctx.Err() != nil {
			return
		}
		if listened {
			b.reset()
		}
		h.become(false, func(wk *waker) { wk.lost(err, b.wait) })
		if !b.sleep(ctx) {
			return
		}
	}
}

// listenOnce opens the connection, listens and hands every notification to the members until
// the connection fails. listened says whether LISTEN was in place.
func (h *listenHub) listenOnce(ctx context.Context) (listened bool, err error) {
	conn, err := dedicatedConn(ctx, h.key.pool, h.key.dsn)
	if err != nil {
		return false, err
	}
	defer closeDedicated(conn)
	// LISTEN takes no parameter: the configured channel is quoted as an identifier.
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{h.key.channel}.Sanitize()); err != nil {
		return false, fmt.Errorf("listen: %w", err)
	}
	h.become(true, (*waker).connected)
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return true, fmt.Errorf("wait for notification: %w", err)
		}
		h.tell(func(wk *waker) { wk.notified(n.Channel, n.Payload) })
	}
}

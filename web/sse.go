package web

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"fusion/outbox"
	"fusion/outbox/startstop"
)

// SSEHandler streams observed task deletions to browsers as Server-Sent Events, and lets a
// reconnecting browser resume where it left off.
//
// It is fed by the process's durable consumer, as one of its observed listeners, which also
// hands it the process's own deletions (outbox.OwnWritesListener); browser clients are ephemeral and
// own no cursor. Per project it keeps a ring of the most recent events, contiguous in
// sequence order. Every event a client is sent carries an ID holding
// the client's position in every project of its stream (see sse_id.go), which a browser's
// EventSource sends back as Last-Event-ID when it reconnects. The handler then sends what the
// client missed, per project in sequence order, from the ring or, further back, from the
// retained outbox, and continues live: a client is only ever sent the event after the one it
// has, so there is no duplicate and no gap at the seam. A client further behind than
// MaxReplay, or whose next event was pruned, is sent a "reset" event instead, which tells the
// page to refetch its state; it then continues from the newest event.
//
// A client that reads slowly does not hold up the consumer: it just falls behind, and past
// MaxReplay it gets a reset. A client that stops reading has its connection closed after
// WriteTimeout.
//
// The host owns authentication: mount the handler behind it, and pass Authorize to decide
// per request which projects a client may see; the handler consults it for every project of
// every connection, a resumed one included, before it sends anything.
type SSEHandler struct {
	cfg    SSEOptions
	log    *zap.Logger
	replay *outboxReplay

	lifecycle startstop.Base // begun by NewSSEHandler, stopped by Stop or Close
	run       *startstop.Run
	streams   sync.WaitGroup // one per attached client

	mu     sync.Mutex
	logs   map[string]*projectLog
	closed bool

	clients atomic.Int64
	stats   sseCounters
	warned  atomic.Bool
}

// NewSSEHandler returns a handler with no clients.
func NewSSEHandler(opts SSEOptions) (*SSEHandler, error) {
	opts = opts.withDefaults()
	if err := opts.validate(); err != nil {
		return nil, err
	}
	h := &SSEHandler{cfg: opts, log: opts.Logger.Named("outbox.sse"), replay: newOutboxReplay(opts.Pool, opts.ReplayReadTimeout),
		logs: map[string]*projectLog{}}
	run, err := h.lifecycle.Begin()
	if err != nil {
		return nil, err // not reached: a new base always begins
	}
	h.run = run
	return h, nil
}

// Name implements outbox.Listener.
func (h *SSEHandler) Name() string { return "sse" }

// HandleObserved records the event in its project's ring and wakes that project's clients.
// It never blocks on a client and never fails for one. An event at or below the ring's
// newest (a retry, or a replayed dead letter) was already streamed in order and is ignored;
// one beyond the next (the consumer moved on after a lease change or a reconciliation, or a
// process whose dispatcher does not hand it its own events skipped them) starts the ring
// afresh, and clients read the events in between from the outbox.
func (h *SSEHandler) HandleObserved(_ context.Context, ev outbox.ObservedEvent) error {
	if ev.Replay {
		return nil
	}
	f, err := newFrame(ev.Event)
	if err != nil {
		return err
	}
	h.put(ev.ProjectID, f)
	return nil
}

// HandleParked implements outbox.ParkedListener: an event the consumer parked as a dead
// letter (a listener before the stream failed it every time, so the stream never got it)
// reaches the stream in its place, as a resuming client reads it from the outbox; a row that
// cannot be decoded is sent as a frame with its ID and no event, as the outbox replay sends
// it. Either way the clients move past it as the consumer did, even when no later event
// follows (a child worker would otherwise stay one behind the head for good).
func (h *SSEHandler) HandleParked(_ context.Context, ev outbox.Event) {
	f := sseFrame{seq: ev.Sequence}
	if ev.Validate() == nil {
		if full, err := newFrame(ev); err == nil {
			f = full
		}
	}
	h.put(ev.ProjectID, f)
}

// The stream is told of the process's own events and of parked ones.
var (
	_ outbox.OwnWritesListener = (*SSEHandler)(nil)
	_ outbox.ParkedListener    = (*SSEHandler)(nil)
)

// put adds frame f to project's log and wakes its clients.
func (h *SSEHandler) put(project string, f sseFrame) {
	h.mu.Lock()
	defer h.mu.Unlock()
	lg := h.logLocked(project)
	switch {
	case lg.known && f.seq <= lg.hi:
		return
	case lg.known && f.seq == lg.hi+1:
		lg.append(f, h.cfg.RingSize)
	default:
		lg.restart(f, h.cfg.RingSize)
	}
	for c := range lg.subs {
		select {
		case c.wake <- struct{}{}:
		default:
		}
	}
}

// HandleOwn implements outbox.OwnWritesListener: the process's own deletions reach its stream as
// soon as its consumer reads them, in sequence order with everyone else's, rather than when
// the next observed event reveals the gap. No local path feeds the stream, so nothing is
// streamed twice.
func (h *SSEHandler) HandleOwn(ctx context.Context, ev outbox.ObservedEvent) {
	if err := h.HandleObserved(ctx, ev); err != nil {
		h.log.Warn("event stream: own event not streamed", zap.String("project_id", ev.ProjectID),
			zap.Int64("sequence", ev.Sequence), zap.Error(err))
	}
}

func (h *SSEHandler) logLocked(project string) *projectLog {
	lg := h.logs[project]
	if lg == nil {
		lg = &projectLog{subs: map[*sseClient]struct{}{}}
		h.logs[project] = lg
	}
	return lg
}

// Clients is the number of connected clients.
func (h *SSEHandler) Clients() int { return int(h.clients.Load()) }

// Stop ends every stream and waits for them to return, bounded by ctx; a request after it
// gets an empty stream that tells the browser to reconnect after the retry delay (to the
// process that replaces this one). It is idempotent.
func (h *SSEHandler) Stop(ctx context.Context) error {
	h.mu.Lock()
	first := !h.closed
	h.closed = true // attach refuses from now on, so the count of streams only falls
	h.mu.Unlock()
	if first {
		go func() { h.streams.Wait(); h.run.Finished() }()
	}
	if err := h.lifecycle.Stop(ctx); err != nil {
		return fmt.Errorf("stop event stream: %w", err)
	}
	return nil
}

// Close ends every stream without waiting for them to return (an http.Server's
// RegisterOnShutdown hook, say: Shutdown itself waits for the handlers).
func (h *SSEHandler) Close() {
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	_ = h.Stop(ended)
}

// ServeHTTP streams events until the client goes away, stalls, or the handler closes. The
// optional query parameter project=a,b limits the stream to those projects.
func (h *SSEHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		w.Header().Set("Allow", http.MethodGet)
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	projects, status, msg := h.streamProjects(r)
	if status != 0 {
		h.stats.refused.Add(1)
		http.Error(w, msg, status)
		return
	}
	if n := h.clients.Add(1); n > int64(h.cfg.MaxClients) {
		h.clients.Add(-1)
		h.stats.refused.Add(1)
		w.Header().Set("Retry-After", "5")
		http.Error(w, "too many event-stream clients", http.StatusServiceUnavailable)
		return
	}
	defer h.clients.Add(-1)
	if h.isClosed() {
		h.closing(w)
		return
	}
	ctx := r.Context()
	for _, p := range projects {
		if err := h.ensureKnown(ctx, p); err != nil {
			h.log.Warn("event stream: could not read a project's head", zap.String("project_id", p), zap.Error(err))
			http.Error(w, "event stream unavailable", http.StatusServiceUnavailable)
			return
		}
	}
	fingerprint := streamFingerprint(projects)
	lastEventID := r.Header.Get("Last-Event-ID")
	var from []int64
	if lastEventID != "" {
		from, _ = parseStreamID(lastEventID, fingerprint, len(projects)) // nil: not this stream's
	}
	resumed := from != nil
	ahead, headReads, err := h.beyondHead(ctx, projects, from)
	if err != nil {
		h.log.Warn("event stream: could not read a project's head", zap.Error(err))
		http.Error(w, "event stream unavailable", http.StatusServiceUnavailable)
		return
	}
	c, resets, ok := h.attach(projects, fingerprint, from, ahead, headReads)
	if !ok {
		h.closing(w)
		return
	}
	defer h.detach(c)
	h.stats.connections.Add(1)
	if resumed {
		h.stats.resumes.Add(1)
	}

	s := &sseStream{h: h, w: w, rc: http.NewResponseController(w), deadlines: true}
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.Header().Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	// The opening frame names the client's starting position (an ID with no data dispatches
	// nothing but sets the browser's last event ID), so that a client that reconnects before
	// its first event still resumes from here. Each ID of the opening moves only what the
	// client has been sent up to it: the opening frame keeps the resumed position of every
	// project about to be reset, and each reset frame moves its own projects. A client that
	// keeps each ID once it has handled its frame (a StreamClient, or a browser whose
	// connection drops in between) and stops between them is then reset again when it comes
	// back, rather than resuming past a reset it never saw. An ID that is not this stream's
	// holds no position to keep: the reset of every project is the opening frame.
	open := fmt.Appendf(nil, "retry: %d\n: observing task:deleted\n\n", h.cfg.Retry.Milliseconds())
	if !resumed && lastEventID != "" {
		open = h.appendReset(open, c, c.pos, allIndexes(len(projects)), ResetUnknownPosition)
	} else {
		shown := slices.Clone(c.pos)
		for _, indexes := range resets {
			for _, i := range indexes {
				shown[i] = from[i]
			}
		}
		open = appendStreamFrame(open, StreamFrame{ID: string(appendStreamID(nil, c.fingerprint, shown))})
		for _, reason := range []string{ResetUnknownPosition, ResetReplayBudget} {
			for _, i := range resets[reason] {
				shown[i] = c.pos[i]
			}
			if len(resets[reason]) > 0 {
				open = h.appendReset(open, c, shown, resets[reason], reason)
			}
		}
	}
	if s.send(open) != nil {
		return
	}
	tick := time.NewTicker(h.cfg.Heartbeat)
	defer tick.Stop()
	// Access is checked again while the stream is open: a user whose access was revoked
	// must stop receiving events, not keep them until the connection happens to drop.
	var recheck outbox.Timer
	var recheckC <-chan time.Time
	if h.cfg.Authorize != nil {
		recheck = h.cfg.Clock.NewTimer(h.cfg.ReauthorizeInterval)
		recheckC = recheck.C()
		defer func() { recheck.Stop() }()
	}
	for {
		if err := h.catchUp(ctx, c, s); err != nil {
			if !errors.Is(err, context.Canceled) && !errors.Is(err, errClientGone) {
				h.log.Info("event stream ended", zap.Error(err))
			}
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-h.run.Ctx.Done():
			return
		case <-c.wake:
		case <-tick.C:
			if s.send([]byte(": keep-alive\n\n")) != nil {
				return
			}
		case <-recheckC:
			if p, ok := h.stillAuthorized(r, c); !ok {
				// End the stream: the browser reconnects, and that request is refused (or,
				// without ?project=, carries only what the client may still see).
				h.stats.refused.Add(1)
				h.log.Info("event stream ended: access revoked", zap.String("project_id", p))
				_ = s.send([]byte(": access revoked\n\n"))
				return
			}
			recheck = h.cfg.Clock.NewTimer(h.cfg.ReauthorizeInterval)
			recheckC = recheck.C()
		}
	}
}

// stillAuthorized asks Authorize again about every project of an open stream; it returns the
// first refused project.
func (h *SSEHandler) stillAuthorized(r *http.Request, c *sseClient) (string, bool) {
	for _, p := range c.projects {
		if !h.cfg.Authorize(r, p) {
			return p, false
		}
	}
	return "", true
}

// beyondHead reports, per project, whether a resuming client's position is beyond the
// project's head: not a position this stream ever sent, so the client would silently skip
// every event until the head passed it. A position beyond the ring's newest event is checked
// against the outbox, since another process serving the stream may be further ahead; each
// such read counts against the connection's MaxReplayReads, and past it the position is
// taken as beyond the head (a reset costs the client a refetch, never an event).
func (h *SSEHandler) beyondHead(ctx context.Context, projects []string, from []int64) (ahead []bool, reads int, err error) {
	if from == nil {
		return nil, 0, nil
	}
	ahead = make([]bool, len(projects))
	for i, p := range projects {
		h.mu.Lock()
		hi := h.logLocked(p).hi
		h.mu.Unlock()
		if from[i] <= hi {
			continue
		}
		if reads >= h.cfg.MaxReplayReads {
			ahead[i] = true
			continue
		}
		reads++
		head, err := h.replay.head(ctx, p)
		if err != nil {
			return nil, 0, err
		}
		ahead[i] = from[i] > head
	}
	return ahead, reads, nil
}

func (h *SSEHandler) isClosed() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.closed
}

// closing answers a request that arrives while the handler shuts down: an empty stream with
// the retry delay, not an error status, because an EventSource given any status but 200
// gives up for good, while one whose stream ends reconnects (to the next process) by itself.
func (h *SSEHandler) closing(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	_, _ = fmt.Fprintf(w, "retry: %d\n: shutting down; reconnect\n\n", h.cfg.Retry.Milliseconds())
}

// maxIDLen is the longest project ID outbox.ValidateProjectID accepts (queries_test.go holds the
// two together): with MaxProjects it bounds a request's query before it is parsed.
const maxIDLen = 128

// streamProjects is the sorted project list of a request, or an HTTP status and message.
func (h *SSEHandler) streamProjects(r *http.Request) (projects []string, status int, msg string) {
	// Bound the query before parsing it: a client must not make the handler hold megabytes.
	if len(r.URL.RawQuery) > h.cfg.MaxProjects*(3*maxIDLen+1)+64 {
		return nil, http.StatusRequestURITooLong, "query too long"
	}
	served, err := h.cfg.Projects.ObservedProjects(r.Context())
	if err != nil {
		h.log.Warn("event stream: could not list the served projects", zap.Error(err))
		return nil, http.StatusServiceUnavailable, "event stream unavailable"
	}
	allow := func(p string) bool { return h.cfg.Authorize == nil || h.cfg.Authorize(r, p) }
	q := strings.Join(r.URL.Query()["project"], ",")
	if q == "" {
		for _, p := range served {
			if allow(p) {
				projects = append(projects, p)
			}
		}
		if len(projects) == 0 {
			return nil, http.StatusForbidden, "forbidden"
		}
		slices.Sort(projects)
		return slices.Compact(projects), 0, ""
	}
	names := strings.Split(q, ",")
	if len(names) > h.cfg.MaxProjects {
		return nil, http.StatusBadRequest, fmt.Sprintf("at most %d projects per stream", h.cfg.MaxProjects)
	}
	for _, p := range names {
		if err := outbox.ValidateProjectID(p); err != nil {
			return nil, http.StatusBadRequest, err.Error()
		}
	}
	slices.Sort(names)
	names = slices.Compact(names)
	// A project the stream does not serve and one the client may not see get the same answer,
	// and Authorize is asked about both: a different status, message or cost would tell a
	// prober which project IDs exist.
	refused := false
	for _, p := range names {
		ok := allow(p)
		refused = refused || !ok || !slices.Contains(served, p)
	}
	if refused {
		return nil, http.StatusForbidden, "forbidden"
	}
	return names, 0, ""
}

// ensureKnown gives a project the handler has not seen a position: its head in the outbox.
func (h *SSEHandler) ensureKnown(ctx context.Context, project string) error {
	h.mu.Lock()
	known := h.logLocked(project).known
	h.mu.Unlock()
	if known {
		return nil
	}
	head, err := h.replay.head(ctx, project)
	if err != nil {
		return err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if lg := h.logLocked(project); !lg.known {
		lg.known, lg.lo, lg.hi = true, head, head
	}
	return nil
}

// attach registers a client at its starting position: from (a Last-Event-ID of this stream)
// when it is set, else each project's newest event. A project whose position is beyond its
// head (ahead) starts at its newest event with an unknown_position reset, and the projects
// whose replay does not fit in MaxReplayReads with a replay_budget reset: resets lists them
// by reason. headReads is what checking ahead already cost, against MaxReplayReads. ok is
// false once the handler is closed.
func (h *SSEHandler) attach(projects []string, fingerprint string, from []int64, ahead []bool, headReads int) (c *sseClient, resets map[string][]int, ok bool) {
	c = &sseClient{projects: projects, fingerprint: fingerprint, wake: make(chan struct{}, 1),
		logs: make([]*projectLog, len(projects)), replayTo: make([]int64, len(projects)), reads: headReads}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, nil, false
	}
	h.streams.Add(1) // under mu, before Stop can start waiting
	c.pos = make([]int64, len(projects))
	resets = map[string][]int{}
	planned := headReads // outbox reads the resume is expected to cost
	for i, p := range projects {
		lg := h.logLocked(p)
		lg.subs[c] = struct{}{}
		c.logs[i] = lg
		c.pos[i] = lg.hi
		if from == nil {
			continue
		}
		if ahead[i] {
			resets[ResetUnknownPosition] = append(resets[ResetUnknownPosition], i)
			continue
		}
		if lg.hi-from[i] <= int64(h.cfg.MaxReplay) {
			// A client further behind than MaxReplay is reset by next; one within it is
			// replayed only if its share of the connection's budget fits.
			n := replayReads(from[i], lg.lo)
			if planned+n > h.cfg.MaxReplayReads {
				resets[ResetReplayBudget] = append(resets[ResetReplayBudget], i)
				continue
			}
			planned += n
		}
		c.pos[i] = from[i]
		c.replayTo[i] = lg.hi
	}
	return c, resets, true
}

// replayReads is how many outbox page reads replaying the events after pos up to the ring's
// lowest, lo, takes: one per aligned page the range touches.
func replayReads(pos, lo int64) int {
	if pos >= lo {
		return 0
	}
	return int((lo-1)/replayPageSize - pos/replayPageSize + 1)
}

func (h *SSEHandler) detach(c *sseClient) {
	defer h.streams.Done()
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, lg := range c.logs {
		delete(lg.subs, c)
	}
}

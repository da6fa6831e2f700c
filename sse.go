package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"fusion/outbox/startstop"
)

// SSEHandler streams observed task deletions to browsers as Server-Sent Events, and lets a
// reconnecting browser resume where it left off.
//
// It is fed by the process's durable consumer, as one of its observed listeners; browser
// clients are ephemeral and own no cursor. Per project it keeps a ring of the most recent
// events, contiguous in sequence order. Every event a client is sent carries an ID holding
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

// SSEOptions configure an SSEHandler.
type SSEOptions struct {
	// Pool reads the retained outbox for clients the ring cannot serve, and the head of a
	// project for the first client of a project the handler has not seen yet. Required.
	Pool DBTX
	// Projects is the set of projects the stream serves: a request without ?project= gets
	// all of them (those Authorize allows), and a request naming another project is refused.
	// Normally the consumer's own Projects. Required.
	Projects Projects
	// Authorize, when set, is asked for every project of every connection whether r may see
	// it. A refused project named in ?project= fails the request with 403; without ?project=
	// the stream carries only the allowed projects. Without Authorize every served project is
	// open to anyone who reaches the handler: the host owns authentication.
	Authorize func(r *http.Request, projectID string) bool
	// MaxClients bounds the concurrent streams; a request beyond it gets 503 with
	// Retry-After. Defaults to 1000; 1 to 1000000.
	MaxClients int
	// MaxProjects bounds how many projects one request may name in ?project=. Defaults to 64;
	// 1 to 1024.
	MaxProjects int
	// RingSize is how many recent events the handler keeps per project to resume clients
	// from memory. Defaults to 1024; 16 to 1000000.
	RingSize int
	// MaxReplay is how far behind, in events of one project, a client may be and still be
	// resumed; further behind it is sent a reset. Defaults to 10000; at least RingSize, at
	// most 1000000.
	MaxReplay int
	// Heartbeat is how often an idle stream gets a comment line, which keeps proxies from
	// closing it. Defaults to 15s; at least 10ms.
	Heartbeat time.Duration
	// WriteTimeout bounds one write to a client; a client that does not take it in time is
	// disconnected (and resumes when it reconnects). Defaults to 10s; at least 10ms.
	WriteTimeout time.Duration
	// Retry is the reconnection delay the stream suggests to browsers (the SSE retry field).
	// Defaults to 2s; 10ms to 1h.
	Retry  time.Duration
	Logger *zap.Logger
}

// withDefaults fills every unset field.
func (o SSEOptions) withDefaults() SSEOptions {
	defInt := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	defInt(&o.MaxClients, 1000)
	defInt(&o.MaxProjects, 64)
	defInt(&o.RingSize, 1024)
	defInt(&o.MaxReplay, max(10000, o.RingSize))
	def(&o.Heartbeat, 15*time.Second)
	def(&o.WriteTimeout, 10*time.Second)
	def(&o.Retry, 2*time.Second)
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	return o
}

// validate reports every invalid field, each error naming it.
func (o SSEOptions) validate() error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, invalid("SSEOptions."+field, format, args...))
	}
	if o.Pool == nil {
		bad("Pool", "is nil: the stream reads the outbox to resume clients")
	}
	if o.Projects == nil {
		bad("Projects", "is nil: the stream must know which projects it serves")
	}
	if o.MaxClients < 1 || o.MaxClients > 1_000_000 {
		bad("MaxClients", "must be between 1 and 1000000 (got %d)", o.MaxClients)
	}
	if o.MaxProjects < 1 || o.MaxProjects > 1024 {
		bad("MaxProjects", "must be between 1 and 1024 (got %d)", o.MaxProjects)
	}
	if o.RingSize < 16 || o.RingSize > 1_000_000 {
		bad("RingSize", "must be between 16 and 1000000 (got %d)", o.RingSize)
	}
	if o.MaxReplay < o.RingSize || o.MaxReplay > 1_000_000 {
		bad("MaxReplay", "must be between RingSize %d and 1000000 (got %d)", o.RingSize, o.MaxReplay)
	}
	if o.Heartbeat < 10*time.Millisecond {
		bad("Heartbeat", "must be at least 10ms (got %s)", o.Heartbeat)
	}
	if o.WriteTimeout < 10*time.Millisecond {
		bad("WriteTimeout", "must be at least 10ms (got %s)", o.WriteTimeout)
	}
	if o.Retry < 10*time.Millisecond || o.Retry > time.Hour {
		bad("Retry", "must be between 10ms and 1h (got %s)", o.Retry)
	}
	if len(errs) > 0 {
		return fmt.Errorf("sse options: %w", errors.Join(errs...))
	}
	return nil
}

// The reasons a reset event gives.
const (
	// ResetBelowPrunedFloor: an event the client needs was pruned.
	ResetBelowPrunedFloor = "below_pruned_floor"
	// ResetTooFarBehind: the client is more than MaxReplay events behind.
	ResetTooFarBehind = "too_far_behind"
	// ResetUnknownPosition: the Last-Event-ID does not describe this stream (another
	// project list, another format, or garbage).
	ResetUnknownPosition = "unknown_position"
)

// SSEResetEvent is the event type of a reset; its data is an SSEReset.
const SSEResetEvent = "reset"

// SSEReset is the payload of a reset event: the page should refetch these projects' state,
// since the stream cannot tell it everything that happened; the stream continues from the
// newest event.
type SSEReset struct {
	Projects []string `json:"projects"`
	Reason   string   `json:"reason"`
}

// NewSSEHandler returns a handler with no clients.
func NewSSEHandler(opts SSEOptions) (*SSEHandler, error) {
	opts = opts.withDefaults()
	if err := opts.validate(); err != nil {
		return nil, err
	}
	h := &SSEHandler{cfg: opts, log: opts.Logger.Named("outbox.sse"), replay: newOutboxReplay(opts.Pool),
		logs: map[string]*projectLog{}}
	run, err := h.lifecycle.Begin()
	if err != nil {
		return nil, err // not reached: a new base always begins
	}
	h.run = run
	return h, nil
}

// Name implements Listener.
func (h *SSEHandler) Name() string { return "sse" }

// HandleObserved records the event in its project's ring and wakes that project's clients.
// It never blocks on a client and never fails for one. An event at or below the ring's
// newest (a retry, or a replayed dead letter) was already streamed in order and is ignored;
// one beyond the next (the consumer skipped events this process wrote, or moved on after a
// lease change or a reconciliation) starts the ring afresh, and clients read the events in
// between from the outbox.
func (h *SSEHandler) HandleObserved(_ context.Context, ev ObservedEvent) error {
	if ev.Replay {
		return nil
	}
	f, err := newFrame(ev.Event)
	if err != nil {
		return err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	lg := h.logLocked(ev.ProjectID)
	switch {
	case lg.known && f.seq <= lg.hi:
		return nil
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
	return nil
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
	c, resumed, ok := h.attach(projects, r.Header.Get("Last-Event-ID"))
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
	// its first event still resumes from here.
	open := fmt.Appendf(nil, "retry: %d\n: observing task:deleted\n\nid: ", h.cfg.Retry.Milliseconds())
	open = append(appendStreamID(open, c.fingerprint, c.pos), "\n\n"...)
	if !resumed && r.Header.Get("Last-Event-ID") != "" {
		open = h.appendReset(open, c, allIndexes(len(projects)), ResetUnknownPosition)
	}
	if s.send(open) != nil {
		return
	}
	tick := time.NewTicker(h.cfg.Heartbeat)
	defer tick.Stop()
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
		}
	}
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
		if err := ValidateProjectID(p); err != nil {
			return nil, http.StatusBadRequest, err.Error()
		}
	}
	slices.Sort(names)
	names = slices.Compact(names)
	for _, p := range names {
		if !slices.Contains(served, p) {
			return nil, http.StatusNotFound, fmt.Sprintf("project %q is not served by this stream", p)
		}
		if !allow(p) {
			return nil, http.StatusForbidden, "forbidden"
		}
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

// attach registers a client at its starting position: where Last-Event-ID says when it
// describes this stream, else each project's newest event. ok is false once the handler is
// closed.
func (h *SSEHandler) attach(projects []string, lastEventID string) (c *sseClient, resumed, ok bool) {
	c = &sseClient{projects: projects, fingerprint: streamFingerprint(projects), wake: make(chan struct{}, 1),
		logs: make([]*projectLog, len(projects)), replayTo: make([]int64, len(projects))}
	var from []int64
	if lastEventID != "" {
		if pos, err := parseStreamID(lastEventID, c.fingerprint, len(projects)); err == nil {
			from, resumed = pos, true
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return nil, false, false
	}
	h.streams.Add(1) // under mu, before Stop can start waiting
	c.pos = make([]int64, len(projects))
	for i, p := range projects {
		lg := h.logLocked(p)
		lg.subs[c] = struct{}{}
		c.logs[i] = lg
		c.pos[i] = lg.hi
		if resumed {
			c.pos[i] = from[i]
			c.replayTo[i] = lg.hi
		}
	}
	return c, resumed, true
}

func (h *SSEHandler) detach(c *sseClient) {
	defer h.streams.Done()
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, lg := range c.logs {
		delete(lg.subs, c)
	}
}

// catchUpChunk is the most frames one write carries.
const catchUpChunk = 256

// catchUp sends the client everything up to each project's newest event.
func (h *SSEHandler) catchUp(ctx context.Context, c *sseClient, s *sseStream) error {
	for i := range c.projects {
		for {
			frames, reset, fromOutbox, err := h.next(ctx, c, i)
			if err != nil {
				return err
			}
			var b []byte
			switch {
			case reset != "":
				b = h.appendReset(nil, c, []int{i}, reset)
			case len(frames) == 0:
			default:
				b = h.appendFrames(c, i, frames, fromOutbox)
			}
			if b == nil {
				break
			}
			if err := s.send(b); err != nil {
				return err
			}
		}
	}
	return nil
}

// next is the client's next step in project i: frames to send (from the ring or the
// outbox), a reset reason (the position already moved), or nothing when it is up to date.
func (h *SSEHandler) next(ctx context.Context, c *sseClient, i int) (frames []sseFrame, reset string, fromOutbox bool, err error) {
	h.mu.Lock()
	lg, pos := c.logs[i], c.pos[i]
	lo, hi := lg.lo, lg.hi
	switch {
	case pos >= hi:
		h.mu.Unlock()
		return nil, "", false, nil
	case hi-pos > int64(h.cfg.MaxReplay):
		h.mu.Unlock()
		c.pos[i] = hi
		return nil, ResetTooFarBehind, false, nil
	case pos >= lo:
		frames = lg.frames(pos, catchUpChunk)
		h.mu.Unlock()
		return frames, "", false, nil
	}
	h.mu.Unlock()
	frames, err = h.replay.events(ctx, c.projects[i], pos, lo)
	if errors.Is(err, errBelowFloor) {
		c.pos[i] = hi
		return nil, ResetBelowPrunedFloor, false, nil
	}
	return frames, "", true, err
}

// appendFrames renders frames of project i, each with the ID of the position it leaves the
// client at, and moves the client's position.
func (h *SSEHandler) appendFrames(c *sseClient, i int, frames []sseFrame, fromOutbox bool) []byte {
	var b []byte
	replayed := 0
	for _, f := range frames {
		c.pos[i] = f.seq
		if f.seq <= c.replayTo[i] {
			replayed++
		}
		b = append(b, "id: "...)
		b = appendStreamID(b, c.fingerprint, c.pos)
		b = append(b, "\nevent: "...)
		b = append(b, EventTypeTaskDeleted...)
		b = append(b, "\ndata: "...)
		b = append(b, f.data...)
		b = append(b, "\n\n"...)
	}
	if fromOutbox {
		h.stats.replayedOutbox.Add(int64(replayed))
	} else {
		h.stats.replayedRing.Add(int64(replayed))
	}
	return b
}

// appendReset renders a reset of the projects at indexes; their positions already moved.
func (h *SSEHandler) appendReset(b []byte, c *sseClient, indexes []int, reason string) []byte {
	r := SSEReset{Reason: reason}
	for _, i := range indexes {
		r.Projects = append(r.Projects, c.projects[i])
	}
	data, _ := json.Marshal(r) // strings and a slice of strings: cannot fail
	h.stats.resets.Add(int64(len(indexes)))
	b = append(b, "id: "...)
	b = appendStreamID(b, c.fingerprint, c.pos)
	b = append(b, "\nevent: "+SSEResetEvent+"\ndata: "...)
	b = append(b, data...)
	return append(b, "\n\n"...)
}

func allIndexes(n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = i
	}
	return out
}

// sseClient is one connected stream. Its positions are touched only by its own goroutine.
type sseClient struct {
	projects    []string      // sorted
	fingerprint string        // of projects, inside every ID
	logs        []*projectLog // per project, in projects' order
	pos         []int64       // the last sequence sent, per project
	replayTo    []int64       // frames at or below this were missed while disconnected
	wake        chan struct{}
}

// projectLog is one project's recent events: a ring holding the contiguous sequences
// (lo, hi]. Guarded by SSEHandler.mu.
type projectLog struct {
	known  bool // lo and hi mean something: set by the first event or the first client
	lo, hi int64
	ring   []sseFrame // the frame of sequence s is at ring[s % len(ring)]
	subs   map[*sseClient]struct{}
}

func (l *projectLog) append(f sseFrame, size int) {
	if l.ring == nil {
		l.ring = make([]sseFrame, size)
	}
	l.ring[f.seq%int64(len(l.ring))] = f
	l.hi = f.seq
	if l.hi-l.lo > int64(len(l.ring)) {
		l.lo = l.hi - int64(len(l.ring))
	}
}

func (l *projectLog) restart(f sseFrame, size int) {
	l.known, l.lo, l.hi = true, f.seq-1, f.seq-1
	l.append(f, size)
}

// frames copies at most n frames after sequence after, which must be in [lo, hi).
func (l *projectLog) frames(after int64, n int) []sseFrame {
	end := min(l.hi, after+int64(n))
	out := make([]sseFrame, 0, end-after)
	for s := after + 1; s <= end; s++ {
		out = append(out, l.ring[s%int64(len(l.ring))])
	}
	return out
}

// errClientGone is a write that failed or timed out: the client is gone or stalled.
var errClientGone = errors.New("event-stream client gone")

// sseStream writes to one client, each write bounded by WriteTimeout.
type sseStream struct {
	h         *SSEHandler
	w         http.ResponseWriter
	rc        *http.ResponseController
	deadlines bool // the writer supports write deadlines (as net/http's own do)
}

// send writes b and flushes it. The connection's write deadline bounds it; a ResponseWriter
// without deadlines (a middleware that hides them) gets a timer instead, which closes the
// connection by hijacking it if the writer allows that.
func (s *sseStream) send(b []byte) error {
	timeout := s.h.cfg.WriteTimeout
	if s.deadlines {
		if err := s.rc.SetWriteDeadline(time.Now().Add(timeout)); err != nil {
			s.deadlines = false
		}
	}
	var fired atomic.Bool
	var timer *time.Timer
	if !s.deadlines {
		timer = time.AfterFunc(timeout, func() { fired.Store(true); s.abort() })
	}
	_, err := s.w.Write(b)
	if err == nil {
		err = s.rc.Flush()
	}
	if timer != nil {
		timer.Stop()
	}
	switch {
	case fired.Load(), errors.Is(err, os.ErrDeadlineExceeded):
		s.h.stats.stalled.Add(1)
		return errClientGone
	case err != nil:
		return errClientGone
	}
	return nil
}

// abort closes a stalled client's connection from the timer.
func (s *sseStream) abort() {
	conn, _, err := s.rc.Hijack()
	if err != nil {
		if !s.h.warned.Swap(true) {
			s.h.log.Warn("a stalled event-stream client cannot be disconnected: the response writer supports neither write deadlines nor hijacking",
				zap.Duration("write_timeout", s.h.cfg.WriteTimeout))
		}
		return
	}
	_ = conn.Close()
}

type sseCounters struct {
	connections, resumes, replayedRing, replayedOutbox, resets, refused, stalled atomic.Int64
}

// SSEStats are an SSEHandler's counters since it was built.
type SSEStats struct {
	Clients            int   // connected now
	Connections        int64 // streams accepted
	Resumes            int64 // of which presented a Last-Event-ID of this stream
	ReplayedFromRing   int64 // events sent to resumed clients that they had missed, from memory
	ReplayedFromOutbox int64 // the same, read from the outbox
	Resets             int64 // project resets sent
	Refused            int64 // requests refused (limits, authorization, bad filters)
	Stalled            int64 // clients disconnected for not taking a write in time
	OutboxReads        int64 // outbox page reads (shared by every client that needed the page)
	HeadReads          int64 // project head reads (shared likewise)
}

// Stats returns the handler's counters.
func (h *SSEHandler) Stats() SSEStats {
	s := &h.stats
	return SSEStats{Clients: h.Clients(), Connections: s.connections.Load(), Resumes: s.resumes.Load(),
		ReplayedFromRing: s.replayedRing.Load(), ReplayedFromOutbox: s.replayedOutbox.Load(), Resets: s.resets.Load(),
		Refused: s.refused.Load(), Stalled: s.stalled.Load(), OutboxReads: h.replay.pageReads.Load(), HeadReads: h.replay.headReads.Load()}
}

// String is the stats on one line, for logs and test output.
func (s SSEStats) String() string {
	return "clients=" + strconv.Itoa(s.Clients) + " connections=" + strconv.FormatInt(s.Connections, 10) +
		" resumes=" + strconv.FormatInt(s.Resumes, 10) + " replayed_ring=" + strconv.FormatInt(s.ReplayedFromRing, 10) +
		" replayed_outbox=" + strconv.FormatInt(s.ReplayedFromOutbox, 10) + " resets=" + strconv.FormatInt(s.Resets, 10) +
		" refused=" + strconv.FormatInt(s.Refused, 10) + " stalled=" + strconv.FormatInt(s.Stalled, 10) +
		" outbox_reads=" + strconv.FormatInt(s.OutboxReads, 10) + " head_reads=" + strconv.FormatInt(s.HeadReads, 10)
}

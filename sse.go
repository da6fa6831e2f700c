package outbox

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// SSEHandler streams observed events to browsers as Server-Sent Events. It is fed by the
// process's one durable consumer, as one of its observed listeners: browser clients are
// ephemeral and own no cursor. Each client has a small buffer; a client that falls behind is
// dropped (its stream ends, and a browser's EventSource reconnects and should refetch), so a
// slow browser can never hold up the consumer.
type SSEHandler struct {
	buffer    int
	heartbeat time.Duration
	log       *zap.Logger

	mu      sync.Mutex
	clients map[*sseClient]struct{}
	closed  bool
	dropped atomic.Int64
}

// SSEOptions configure an SSEHandler.
type SSEOptions struct {
	// Buffer is how many events a client may have queued before it is dropped. Defaults to 256.
	Buffer int
	// Heartbeat is how often an idle stream gets a comment line, which keeps proxies from
	// closing it. Defaults to 15s.
	Heartbeat time.Duration
	Logger    *zap.Logger
}

type sseClient struct {
	projects map[string]bool // nil: every project
	events   chan []byte
	gone     chan struct{} // closed when the client is dropped or the handler closes
}

// NewSSEHandler returns a handler with no clients.
func NewSSEHandler(opts SSEOptions) *SSEHandler {
	if opts.Buffer <= 0 {
		opts.Buffer = 256
	}
	if opts.Heartbeat <= 0 {
		opts.Heartbeat = 15 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	return &SSEHandler{buffer: opts.Buffer, heartbeat: opts.Heartbeat, log: opts.Logger.Named("outbox.sse"),
		clients: map[*sseClient]struct{}{}}
}

// Name implements Listener.
func (h *SSEHandler) Name() string { return "sse" }

// HandleObserved queues the event for every connected client interested in its project. It
// never blocks and never fails: a client whose buffer is full is dropped instead.
func (h *SSEHandler) HandleObserved(_ context.Context, ev ObservedEvent) error {
	data, err := json.Marshal(ev)
	if err != nil {
		return fmt.Errorf("encode event: %w", err)
	}
	frame := []byte(fmt.Sprintf("id: %s:%d\nevent: %s\ndata: %s\n\n", ev.ProjectID, ev.Sequence, ev.EventType, data))
	h.mu.Lock()
	defer h.mu.Unlock()
	for c := range h.clients {
		if c.projects != nil && !c.projects[ev.ProjectID] {
			continue
		}
		select {
		case c.events <- frame:
		default:
			h.dropLocked(c)
			h.dropped.Add(1)
			h.log.Info("dropped a slow event-stream client", zap.Int("buffer", h.buffer))
		}
	}
	return nil
}

func (h *SSEHandler) dropLocked(c *sseClient) {
	if _, ok := h.clients[c]; ok {
		delete(h.clients, c)
		close(c.gone)
	}
}

// Clients is the number of connected clients.
func (h *SSEHandler) Clients() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return len(h.clients)
}

// Dropped is how many clients were dropped for being slow.
func (h *SSEHandler) Dropped() int64 { return h.dropped.Load() }

// Close ends every stream; new requests get 503.
func (h *SSEHandler) Close() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.closed = true
	for c := range h.clients {
		h.dropLocked(c)
	}
}

// ServeHTTP streams events until the client goes away, is dropped, or the handler closes.
// The optional query parameter project=a,b limits the stream to those projects.
func (h *SSEHandler) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		w.Header().Set("Allow", http.MethodGet)
		http.Error(w, "method not allowed", http.StatusMethodNotAllowed)
		return
	}
	c := &sseClient{events: make(chan []byte, h.buffer), gone: make(chan struct{})}
	if q := r.URL.Query().Get("project"); q != "" {
		c.projects = map[string]bool{}
		for _, p := range strings.Split(q, ",") {
			if err := ValidateProjectID(p); err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			c.projects[p] = true
		}
	}
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		http.Error(w, "shutting down", http.StatusServiceUnavailable)
		return
	}
	h.clients[c] = struct{}{}
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		h.dropLocked(c)
		h.mu.Unlock()
	}()

	rc := http.NewResponseController(w)
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-cache")
	w.Header().Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	write := func(b []byte) bool {
		// A client that stops reading must not pin this goroutine forever.
		_ = rc.SetWriteDeadline(time.Now().Add(10 * time.Second))
		if _, err := w.Write(b); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	if !write([]byte(": observing task:deleted\n\n")) {
		return
	}
	tick := time.NewTicker(h.heartbeat)
	defer tick.Stop()
	for {
		select {
		case <-r.Context().Done():
			return
		case <-c.gone:
			return
		case frame := <-c.events:
			if !write(frame) {
				return
			}
		case <-tick.C:
			if !write([]byte(": keep-alive\n\n")) {
				return
			}
		}
	}
}

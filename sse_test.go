package outbox_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
)

// stalledWriter is an http.ResponseWriter whose client never reads: every write blocks
// until released, as a browser on a dead connection would make it.
type stalledWriter struct {
	header  http.Header
	blocked chan struct{}
	release chan struct{}
	once    sync.Once
}

func newStalledWriter() *stalledWriter {
	return &stalledWriter{header: http.Header{}, blocked: make(chan struct{}), release: make(chan struct{})}
}

func (w *stalledWriter) Header() http.Header { return w.header }
func (w *stalledWriter) WriteHeader(int)     {}
func (w *stalledWriter) Flush()              {}
func (w *stalledWriter) Write(b []byte) (int, error) {
	w.once.Do(func() { close(w.blocked) })
	<-w.release
	return len(b), nil
}

// readEvents reads SSE frames from a real HTTP response and sends each data payload.
func readEvents(t *testing.T, resp *http.Response, out chan<- outbox.ObservedEvent) {
	defer close(out)
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64*1024), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if data, ok := strings.CutPrefix(line, "data: "); ok {
			var ev outbox.ObservedEvent
			if err := json.Unmarshal([]byte(data), &ev); err != nil {
				t.Errorf("bad frame %q: %v", data, err)
				return
			}
			out <- ev
		}
	}
}

func TestSSEStreamsObservedEventsAndDropsSlowClients(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	db := pgtest.NewDB(t)
	sse := outbox.NewSSEHandler(outbox.SSEOptions{Buffer: 128})
	srv := httptest.NewServer(sse)
	defer srv.Close()
	defer sse.Close()

	writer := startProcess(t, db.URL, processOpts{projects: []string{"p", "q"}})
	_, err := writer.store.CreateMany(ctx, "p", "t", 300)
	require.NoError(t, err)
	obs := startProcess(t, db.URL, processOpts{id: "web", projects: []string{"p", "q"}, cfg: fastConfig(), listeners: []outbox.Listener{sse}})

	// A browser-style client on project p over real HTTP.
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"?project=p", nil)
	require.NoError(t, err)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, "text/event-stream", resp.Header.Get("Content-Type"))
	events := make(chan outbox.ObservedEvent, 1000)
	go readEvents(t, resp, events)

	// A client that never reads, attached to the same handler.
	stalled := newStalledWriter()
	stalledReq := httptest.NewRequest(http.MethodGet, "/", nil).WithContext(ctx)
	stalledDone := make(chan struct{})
	go func() { defer close(stalledDone); sse.ServeHTTP(stalled, stalledReq) }()
	<-stalled.blocked
	require.Eventually(t, func() bool { return sse.Clients() == 2 }, 10*time.Second, time.Millisecond)

	for i := range 300 {
		_, err := writer.store.Delete(ctx, "p", fmt.Sprintf("t-%d", i+1))
		require.NoError(t, err)
	}
	// The consumer is not stalled by the stalled client: it acknowledges everything.
	waitCursor(t, ctx, obs.pool, "p", "web", 300)
	got := 0
	for got < 300 {
		select {
		case ev, ok := <-events:
			require.True(t, ok, "stream ended early after %d events", got)
			got++
			require.True(t, ev.Observed)
			require.Equal(t, int64(got), ev.Sequence)
		case <-ctx.Done():
			t.Fatalf("received %d of 300", got)
		}
	}
	require.GreaterOrEqual(t, sse.Dropped(), int64(1), "the stalled client was dropped")
	require.Equal(t, 1, sse.Clients())
	close(stalled.release)
	<-stalledDone
}

func TestSSERejectsBadRequests(t *testing.T) {
	t.Parallel()
	sse := outbox.NewSSEHandler(outbox.SSEOptions{})
	srv := httptest.NewServer(sse)
	defer srv.Close()
	resp, err := http.Post(srv.URL, "text/plain", nil)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode)
	resp, err = http.Get(srv.URL + "?project=not%20valid")
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusBadRequest, resp.StatusCode)
	sse.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL, nil)
	resp, err = http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
}

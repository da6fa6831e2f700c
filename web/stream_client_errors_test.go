package web_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/outboxtest"
	"fusion/outbox/web"
)

// TestStreamClientStopsWhenRefusedForGood: a status that retrying cannot mend (403 from
// Authorize, 400 for a bad project, 404 for a wrong URL) or a response that is not an event
// stream ends Run with ErrStreamRefused, at once and without a backoff.
func TestStreamClientStopsWhenRefusedForGood(t *testing.T) {
	t.Parallel()
	ctx := streamCtx(t)
	pool := pgtest.NewPool(t)
	sse := newSSE(t, pool, []string{"p"}, func(o *web.SSEOptions) {
		o.Authorize = func(r *http.Request, _ string) bool { return r.Header.Get("Authorization") == "Bearer node-1" }
	})
	mux := http.NewServeMux()
	mux.Handle("/events", sse)
	mux.HandleFunc("/page", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		_, _ = io.WriteString(w, "<html>a login page</html>")
	})
	srv := httptest.NewServer(mux)
	// After the clients stop (cleanups run last first): Close waits for their requests.
	t.Cleanup(srv.Close)
	clock := outboxtest.NewFakeClock() // never advanced: a backoff would hang the test
	for _, tc := range []struct {
		path, token, want string
	}{
		{"/events?project=p", "Bearer someone-else", "status 403"},
		{"/events?project=not%20valid", "Bearer node-1", "status 400"},
		{"/nowhere", "Bearer node-1", "status 404"},
		{"/page", "", "not an event stream"},
	} {
		c, err := web.NewStreamClient(web.StreamClientOptions{URL: srv.URL + tc.path, Clock: clock,
			Header:    http.Header{"Authorization": {tc.token}},
			Positions: web.FilePositions(filepath.Join(t.TempDir(), "position"))}, newStreamRecorder())
		require.NoError(t, err)
		err = c.Run(ctx)
		require.ErrorIs(t, err, web.ErrStreamRefused, tc.path)
		require.ErrorContains(t, err, tc.want)
		require.Equal(t, web.StreamClientStats{Errors: 1}, c.Stats())
	}
	// The same client with the right credentials follows the stream.
	rec := newStreamRecorder()
	c, _ := runClient(t, ctx, web.StreamClientOptions{URL: srv.URL + "/events?project=p", Clock: clock,
		Header: http.Header{"Authorization": {"Bearer node-1"}}, Positions: web.FilePositions(filepath.Join(t.TempDir(), "position"))}, rec)
	for c.Stats().Connects == 0 { // it starts at the head, 0: the event below is the next
		select {
		case <-ctx.Done():
			t.Fatal("the authorized client did not connect")
		case <-time.After(5 * time.Millisecond):
		}
	}
	require.NoError(t, sse.HandleObserved(ctx, outbox.ObservedEvent{Event: outbox.Event{ProjectID: "p", Sequence: 1,
		EventID: outbox.TaskDeletedEventID("seed-1", time.Date(2030, 1, 1, 0, 0, 1, 0, time.UTC)), EventType: outbox.EventTypeTaskDeleted,
		TaskID: "seed-1", DeletedAt: time.Date(2030, 1, 1, 0, 0, 1, 0, time.UTC), WriterProcessID: "w", PayloadVersion: 1}}))
	rec.waitEvents(t, ctx, map[string]int{"p": 1})
}

// TestStreamClientBacksOffOnItsClock: 503s are retried after a backoff that doubles from
// MinBackoff, jittered, on the client's clock; a Retry-After is honoured up to MaxBackoff; a
// connection that delivered something starts the backoff over.
func TestStreamClientBacksOffOnItsClock(t *testing.T) {
	t.Parallel()
	ctx := streamCtx(t)
	pool := pgtest.NewPool(t)
	testkit.SeedEvents(t, pool, "p", 3)
	sse := newSSE(t, pool, []string{"p"}, nil)
	answers := []func(http.ResponseWriter){
		func(w http.ResponseWriter) { http.Error(w, "busy", http.StatusServiceUnavailable) },
		func(w http.ResponseWriter) { http.Error(w, "busy", http.StatusServiceUnavailable) },
		func(w http.ResponseWriter) {
			w.Header().Set("Retry-After", "7")
			http.Error(w, "busy", http.StatusServiceUnavailable)
		},
		func(w http.ResponseWriter) {
			w.Header().Set("Retry-After", "3600")
			http.Error(w, "slow down", http.StatusTooManyRequests)
		},
	}
	var calls atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if n := int(calls.Add(1)); n <= len(answers) {
			answers[n-1](w)
			return
		}
		sse.ServeHTTP(w, r)
	}))
	// After the clients stop (cleanups run last first): Close waits for their requests.
	t.Cleanup(srv.Close)
	clock := outboxtest.NewFakeClock()
	positions := web.FilePositions(filepath.Join(t.TempDir(), "position"))
	require.NoError(t, positions.Save(ctx, streamPos([]string{"p"}, 0)))
	rec := newStreamRecorder()
	c, _ := runClient(t, ctx, web.StreamClientOptions{URL: srv.URL + "?project=p", Positions: positions, Clock: clock,
		MinBackoff: time.Second, MaxBackoff: 10 * time.Second}, rec)

	// waitBackoff waits for the client's backoff timer after request n, checks its length and
	// lets it fire.
	waitBackoff := func(n int64, lo, hi time.Duration) {
		t.Helper()
		d, err := clock.WaitForTimer(ctx, time.Nanosecond)
		require.NoError(t, err, "no backoff after request %d", n)
		require.Equal(t, n, calls.Load(), "no request is made before the backoff ends")
		require.Len(t, clock.Waiters(), 1)
		require.True(t, d >= lo && d <= hi, "backoff after request %d: %s, want %s to %s", n, d, lo, hi)
		clock.Advance(d)
	}
	waitBackoff(1, 500*time.Millisecond, time.Second)
	waitBackoff(2, time.Second, 2*time.Second)
	waitBackoff(3, 7*time.Second, 7*time.Second)   // Retry-After, longer than the 2s to 4s step
	waitBackoff(4, 10*time.Second, 10*time.Second) // Retry-After cut to MaxBackoff, longer than the 4s to 8s step
	rec.waitEvents(t, ctx, map[string]int{"p": 3})
	waitSaved(t, ctx, positions, streamPos([]string{"p"}, 3)) // saved after the count
	require.Equal(t, web.StreamClientStats{Connects: 1, Events: 3, Errors: 4}, c.Stats())

	// The stream ends (its handler shuts down): the connection made progress, so the backoff
	// starts over; the closing handler's empty streams make none, so it doubles again.
	sse.Close()
	waitBackoff(5, 500*time.Millisecond, time.Second)
	waitBackoff(6, time.Second, 2*time.Second)
	require.Equal(t, testkit.Seq(1, 3), rec.seqs("p"))
}

// TestStreamClientPassesWhatItCannotDecode: frames of no known type, or whose data is not a
// valid event or reset, are logged without their data, counted, and passed (their IDs saved),
// not retried forever; the events around them are handled.
func TestStreamClientPassesWhatItCannotDecode(t *testing.T) {
	t.Parallel()
	ctx := streamCtx(t)
	event := func(seq int64) string {
		ev := liveEvent("p", "t", int(seq), seq).Event
		b, err := json.Marshal(struct {
			outbox.Event
			Observed bool `json:"observed"`
		}{ev, true})
		require.NoError(t, err)
		return string(b)
	}
	stream := "retry: 50\n: hello\n\nid: 1.a.0\n\n" +
		"id: 1.a.1\nevent: task:deleted\ndata: " + event(1) + "\n\n" +
		"id: 1.a.2\nevent: task:deleted\ndata: {\"secret-payload\": true\n\n" + // not JSON
		"id: 1.a.3\nevent: task:deleted\ndata: " + strings.Replace(event(3), `"eventId":"task-deleted:t-3`, `"eventId":"secret-payload`, 1) + "\n\n" +
		"id: 1.a.4\nevent: task:created\ndata: {\"secret-payload\":1}\n\n" + // a type this build does not know
		"id: 1.a.5\nevent: reset\ndata: {\"projects\":[\"secret payload\"],\"reason\":\"x\"}\n\n" +
		": keep-alive\n\n" +
		"id: 1.a.6\nevent: task:deleted\ndata: " + event(6) + "\n\n"
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
		_, _ = io.WriteString(w, stream)
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}))
	// After the clients stop (cleanups run last first): Close waits for their requests.
	t.Cleanup(srv.Close)
	core, logs := observer.New(zap.DebugLevel)
	positions := web.FilePositions(filepath.Join(t.TempDir(), "position"))
	rec := newStreamRecorder()
	c, _ := runClient(t, ctx, web.StreamClientOptions{URL: srv.URL, Positions: positions, Logger: zap.New(core)}, rec)
	rec.waitEvents(t, ctx, map[string]int{"p": 2})
	require.Equal(t, []int64{1, 6}, rec.seqs("p"))
	waitSaved(t, ctx, positions, "1.a.6")
	require.Equal(t, web.StreamClientStats{Connects: 1, Events: 2, Undecodable: 4}, c.Stats())
	passed := logs.FilterMessageSnippet("cannot decode").All()
	require.Len(t, passed, 4)
	for _, e := range logs.All() {
		require.NotContains(t, fmt.Sprint(e.Message, e.ContextMap()), "secret", "a log repeats a payload")
	}
}

// TestStreamClientDropsAnIdleConnection: a connection on which nothing arrives for
// IdleTimeout (a peer that vanished without closing it) is dropped and resumed.
func TestStreamClientDropsAnIdleConnection(t *testing.T) {
	t.Parallel()
	ctx := streamCtx(t)
	var calls atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "id: 1.a.0\n\n")
		w.(http.Flusher).Flush()
		<-r.Context().Done() // then silence
	}))
	// After the clients stop (cleanups run last first): Close waits for their requests.
	t.Cleanup(srv.Close)
	c, _ := runClient(t, ctx, quick(web.StreamClientOptions{URL: srv.URL, IdleTimeout: 20 * time.Millisecond,
		Positions: web.FilePositions(filepath.Join(t.TempDir(), "position"))}), newStreamRecorder())
	for calls.Load() < 3 {
		select {
		case <-ctx.Done():
			t.Fatalf("the client stays on a silent connection: %+v", c.Stats())
		case <-time.After(5 * time.Millisecond):
		}
	}
	require.GreaterOrEqual(t, c.Stats().Errors, int64(2))
}

func TestNewStreamClientRejectsBadOptions(t *testing.T) {
	t.Parallel()
	_, err := web.NewStreamClient(web.StreamClientOptions{
		URL:         "http://user:hunter2@/events", // no host
		HTTPClient:  &http.Client{Timeout: time.Minute},
		Header:      http.Header{"Last-Event-ID": {"1.a.1"}},
		ConsumerID:  "not valid",
		MinBackoff:  -time.Second,
		MaxBackoff:  2 * time.Hour,
		IdleTimeout: time.Millisecond,
	}, nil)
	require.Error(t, err)
	for _, field := range []string{"StreamClientOptions.URL", "StreamClientOptions.HTTPClient", "StreamClientOptions.Header",
		"StreamClientOptions.Positions", "StreamClientOptions.ConsumerID", "StreamClientOptions.MinBackoff",
		"StreamClientOptions.MaxBackoff", "StreamClientOptions.IdleTimeout", "StreamHandler"} {
		require.ErrorContains(t, err, field)
	}
	require.NotContains(t, err.Error(), "hunter2", "the error repeats the URL's credentials")
	for _, u := range []string{"", "ftp://engine/events", "/events", "engine:8080/events"} {
		_, err = web.NewStreamClient(web.StreamClientOptions{URL: u, Positions: web.FilePositions("x")}, newStreamRecorder())
		require.ErrorContains(t, err, "StreamClientOptions.URL", "%q", u)
	}

	// Defaults: MaxBackoff is at least MinBackoff.
	_, err = web.NewStreamClient(web.StreamClientOptions{URL: "http://parent/events", MinBackoff: time.Minute,
		Positions: web.FilePositions("x")}, newStreamRecorder())
	require.NoError(t, err)
}

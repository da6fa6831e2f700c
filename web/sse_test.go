package web_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
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

func TestSSEStreamsObservedEventsAndNeverStallsTheConsumer(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	sse := newSSE(t, pool, []string{"p", "q"}, nil)
	srv := httptest.NewServer(sse)
	defer srv.Close()

	writer := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: []string{"p", "q"}})
	_, err := writer.Store.CreateMany(ctx, "p", "t", 300)
	require.NoError(t, err)
	obs := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "web", Projects: []string{"p", "q"}, Config: testkit.FastConfig(), Listeners: []outbox.Listener{sse}})

	client, status := openStream(t, ctx, srv.URL+"?project=p", "")
	require.Equal(t, http.StatusOK, status)
	defer client.close()

	// A client that never reads, attached to the same handler.
	stalled := newStalledWriter()
	sctx, cancelStalled := context.WithCancel(ctx)
	stalledDone := make(chan struct{})
	go func() {
		defer close(stalledDone)
		sse.ServeHTTP(stalled, httptest.NewRequest(http.MethodGet, "/", nil).WithContext(sctx))
	}()
	<-stalled.blocked
	require.Eventually(t, func() bool { return sse.Clients() == 2 }, testkit.WaitLimit, time.Millisecond)

	for i := range 300 {
		_, err := writer.Store.Delete(ctx, "p", fmt.Sprintf("t-%d", i+1))
		require.NoError(t, err)
	}
	// The consumer is not held up by the stalled client: it acknowledges everything, and
	// the reading client gets every event in order.
	testkit.WaitCursor(t, ctx, obs.Pool, "p", "web", 300)
	client.expectDeletions(t, ctx, "p", 1, 300)
	close(stalled.release)
	cancelStalled()
	<-stalledDone
}

// TestSSEResumesFromTheRingAndTheOutbox: a client that missed more than the ring holds gets
// the older events from the outbox and the newer ones from memory, with no duplicate and no
// gap at either seam, and then the live ones.
func TestSSEResumesFromTheRingAndTheOutbox(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	projects := []string{"p", "q"}
	sse := newSSE(t, pool, projects, func(o *web.SSEOptions) { o.RingSize = 16 })
	srv := httptest.NewServer(sse)
	defer srv.Close()
	writer := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: projects})
	for _, p := range projects {
		_, err := writer.Store.CreateMany(ctx, p, "t", 100)
		require.NoError(t, err)
	}
	testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "web", Projects: projects, Config: testkit.FastConfig(), Listeners: []outbox.Listener{sse}})
	deleteRange := func(p string, from, to int) {
		for i := from; i <= to; i++ {
			_, err := writer.Store.Delete(ctx, p, fmt.Sprintf("t-%d", i))
			require.NoError(t, err)
		}
	}

	first, _ := openStream(t, ctx, srv.URL+"?project=p,q", "")
	deleteRange("p", 1, 3)
	deleteRange("q", 1, 2)
	seen := map[string]int64{}
	for seen["p"] < 3 || seen["q"] < 2 {
		d := decodeDeletion(t, first.next(t, ctx, "first connection"))
		require.Equal(t, seen[d.ProjectID]+1, d.Sequence)
		seen[d.ProjectID] = d.Sequence
	}
	lastID := first.close()

	deleteRange("p", 4, 60) // 57 missed: more than the ring's 16
	deleteRange("q", 3, 7)  // 5 missed: all in the ring
	testkit.WaitCursor(t, ctx, pool, "p", "web", 60)
	testkit.WaitCursor(t, ctx, pool, "q", "web", 7)
	before := sse.Stats()

	resumed, _ := openStream(t, ctx, srv.URL+"?project=p,q", lastID)
	defer resumed.close()
	got := map[string][]int64{}
	for len(got["p"]) < 57 || len(got["q"]) < 5 {
		d := decodeDeletion(t, resumed.next(t, ctx, "a missed event"))
		got[d.ProjectID] = append(got[d.ProjectID], d.Sequence)
	}
	require.Equal(t, testkit.Seq(4, 60), got["p"])
	require.Equal(t, testkit.Seq(3, 7), got["q"])
	deleteRange("p", 61, 62)
	resumed.expectDeletions(t, ctx, "p", 61, 62)

	after := sse.Stats()
	t.Logf("resume: %s", after)
	require.Equal(t, int64(1), after.Resumes-before.Resumes)
	require.Equal(t, int64(57-16), after.ReplayedFromOutbox-before.ReplayedFromOutbox, "p's events older than the ring")
	require.Equal(t, int64(16+5), after.ReplayedFromRing-before.ReplayedFromRing, "p's ring and all of q")
	require.Zero(t, after.Resets)
}

// TestSSEHerdOfReconnectsCostsBoundedReads: 500 clients reconnect to a handler that has just
// started (after a deploy: an empty ring), each at its own position. Every client gets exactly
// what it missed, and the database sees one head read per project and one read per page of
// the range they need, not one per client.
func TestSSEHerdOfReconnectsCostsBoundedReads(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	testkit.SeedEvents(t, pool, "p", 1200)
	testkit.SeedEvents(t, pool, "q", 30)
	sse := newSSE(t, pool, []string{"p", "q"}, nil)
	srv := httptest.NewServer(sse)
	defer srv.Close()

	// The IDs the clients last saw, as the previous process sent them.
	probe, _ := openStream(t, ctx, srv.URL, "")
	headID := probe.position(t, ctx) // "1.<fingerprint>.<p head>.<q head>"
	parts := strings.Split(headID, ".")
	require.Len(t, parts, 4)
	const clients = 500
	rng := rand.New(rand.NewPCG(18, 500))
	type client struct{ p, q int64 }
	cs := make([]client, clients)
	pages := map[string]bool{}
	for i := range cs {
		cs[i] = client{p: 1199 - rng.Int64N(250), q: 30 - rng.Int64N(31)}
		for s := cs[i].p + 1; s <= 1200; s++ {
			pages[fmt.Sprintf("p/%d", (s-1)/500)] = true
		}
		for s := cs[i].q + 1; s <= 30; s++ {
			pages[fmt.Sprintf("q/%d", (s-1)/500)] = true
		}
	}
	before := sse.Stats()
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for _, c := range cs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- herdClient(ctx, srv.URL, fmt.Sprintf("1.%s.%s.%s", parts[1], b36(c.p), b36(c.q)), c.p, c.q)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	st := sse.Stats()
	t.Logf("herd of %d: %s; distinct pages needed: %d", clients, st, len(pages))
	require.Equal(t, int64(clients), st.Resumes-before.Resumes)
	require.LessOrEqual(t, st.OutboxReads-before.OutboxReads, int64(len(pages)), "one read per page, not per client")
	require.Equal(t, int64(2), st.HeadReads, "one head read per project, ever")
}

func b36(v int64) string { return strconv.FormatInt(v, 36) }

// herdClient resumes at (p, q) and checks it receives exactly p+1..1200 and q+1..30.
func herdClient(ctx context.Context, url, lastID string, p, q int64) error {
	ctx, cancel := context.WithTimeout(ctx, testkit.WaitLimit)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	req.Header.Set("Last-Event-ID", lastID)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	want := map[string]int64{"p": p, "q": q}
	return readDeletions(resp, func(d deletion) (bool, error) {
		if d.Sequence != want[d.ProjectID]+1 {
			return false, fmt.Errorf("client at %s: got %s/%d after %d", lastID, d.ProjectID, d.Sequence, want[d.ProjectID])
		}
		want[d.ProjectID] = d.Sequence
		return want["p"] == 1200 && want["q"] == 30, nil
	})
}

func TestSSEResets(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	pruneSetup(t, ctx, pool)
	sse := newSSE(t, pool, []string{"p", "q"}, func(o *web.SSEOptions) { o.RingSize = 16; o.MaxReplay = 350 })
	srv := httptest.NewServer(sse)
	defer srv.Close()
	probe, _ := openStream(t, ctx, srv.URL+"?project=p,q", "")
	fp := strings.Split(probe.position(t, ctx), ".")[1]
	id := func(p, q int64) string { return "1." + fp + "." + b36(p) + "." + b36(q) }

	// p below its floor: a reset for p (the client now stands at p's head), then q's rest.
	s, _ := openStream(t, ctx, srv.URL+"?project=p,q", id(90, 395))
	f := s.next(t, ctx, "the reset")
	require.Equal(t, web.SSEResetEvent, f.Event)
	require.JSONEq(t, `{"projects":["p"],"reason":"below_pruned_floor"}`, f.Data)
	require.Equal(t, id(400, 395), f.ID)
	s.expectDeletions(t, ctx, "q", 396, 400)
	s.close()

	// q further behind than MaxReplay: p's rest, then a reset for q.
	s, _ = openStream(t, ctx, srv.URL+"?project=p,q", id(395, 10))
	s.expectDeletions(t, ctx, "p", 396, 400)
	f = s.next(t, ctx, "the reset")
	require.JSONEq(t, `{"projects":["q"],"reason":"too_far_behind"}`, f.Data)
	require.Equal(t, id(400, 400), f.ID)
	s.close()

	// Within reach and above the floor: resumed from the outbox, no reset.
	s, _ = openStream(t, ctx, srv.URL+"?project=p,q", id(160, 400))
	s.expectDeletions(t, ctx, "p", 161, 400)
	s.close()

	// An ID of another stream (another fingerprint), of the old format, or garbage: a reset
	// of every project.
	for _, bad := range []string{strings.Replace(id(160, 10), fp, "00000000", 1), "p:160", strings.Repeat("9", 5000)} {
		s, _ = openStream(t, ctx, srv.URL+"?project=p,q", bad)
		f = s.next(t, ctx, "the reset")
		require.JSONEq(t, `{"projects":["p","q"],"reason":"unknown_position"}`, f.Data, "Last-Event-ID %.40q", bad)
		require.Equal(t, id(400, 400), f.ID)
		s.close()
	}
	require.Equal(t, int64(1+1+2*3), sse.Stats().Resets)
}

// TestSSELimitsAndAuthorize is issue 14 item 6: a client cap, a bounded filter, and an
// Authorize hook consulted for every project of every stream, resumed ones included.
func TestSSELimitsAndAuthorize(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	testkit.SeedEvents(t, pool, "open", 5)
	testkit.SeedEvents(t, pool, "secret", 5)
	var mu sync.Mutex
	asked := map[string]int{}
	sse := newSSE(t, pool, []string{"open", "secret"}, func(o *web.SSEOptions) {
		o.MaxClients = 2
		o.MaxProjects = 3
		o.Authorize = func(r *http.Request, project string) bool {
			mu.Lock()
			defer mu.Unlock()
			asked[project]++
			return project == "open" || r.Header.Get("X-Role") == "admin"
		}
	})
	srv := httptest.NewServer(sse)
	defer srv.Close()
	get := func(query string, header ...string) int {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+query, nil)
		for i := 0; i+1 < len(header); i += 2 {
			req.Header.Set(header[i], header[i+1])
		}
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		resp.Body.Close()
		return resp.StatusCode
	}
	require.Equal(t, http.StatusForbidden, get("?project=secret"))
	require.Equal(t, http.StatusForbidden, get("?project=open,secret"))
	require.Equal(t, http.StatusBadRequest, get("?project=a,b,c,d"), "more than MaxProjects")
	require.Equal(t, http.StatusRequestURITooLong, get("?project="+strings.Repeat("a,", 20000)))
	require.Equal(t, http.StatusForbidden, get("?project=elsewhere"), "a project not served is answered as a forbidden one")

	// Without a filter the stream carries only what Authorize allows: its ID has one
	// position, and even an ID forged to start at zero replays only "open".
	probe, _ := openStream(t, ctx, srv.URL, "")
	probeID := probe.position(t, ctx)
	require.Len(t, strings.Split(probeID, "."), 3)
	fp := strings.Split(probeID, ".")[1]
	require.Eventually(t, func() bool { return sse.Clients() == 0 }, testkit.WaitLimit, time.Millisecond)
	mu.Lock()
	asked = map[string]int{}
	mu.Unlock()
	s, _ := openStream(t, ctx, srv.URL, "1."+fp+".0")
	s.expectDeletions(t, ctx, "open", 1, 5)
	mu.Lock()
	require.Equal(t, map[string]int{"open": 1, "secret": 1}, asked, "the resumed stream asked about every project")
	mu.Unlock()

	// MaxClients: two streams, the third is refused with Retry-After.
	admin, status := openStream(t, ctx, srv.URL+"?project=secret", "", "X-Role", "admin")
	require.Equal(t, http.StatusOK, status)
	require.Eventually(t, func() bool { return sse.Clients() == 2 }, testkit.WaitLimit, time.Millisecond)
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"?project=open", nil)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	require.Equal(t, "5", resp.Header.Get("Retry-After"))
	admin.close()
	s.close()
}

// TestSSEClosesAStalledClientWithoutDeadlines: a ResponseWriter that hides write deadlines
// (a middleware without Unwrap) used to pin the handler's goroutine on a client that stopped
// reading, since the SetWriteDeadline error was ignored. A timer now closes the connection.
func TestSSEClosesAStalledClientWithoutDeadlines(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.Pool(t, pgtest.NewDB(t).URL)
	core, logs := observer.New(zap.WarnLevel)
	sse := newSSE(t, pool, []string{"p"}, func(o *web.SSEOptions) {
		o.WriteTimeout = 50 * time.Millisecond
		o.Logger = zap.New(core)
	})

	w := newHijackableWriter()
	done := make(chan struct{})
	go func() {
		defer close(done)
		sse.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/?project=p", nil).WithContext(ctx))
	}()
	<-w.blocked
	select {
	case <-done:
	case <-ctx.Done():
		t.Fatal("the handler is still blocked on a client that does not read")
	}
	<-w.hijacked
	require.Equal(t, int64(1), sse.Stats().Stalled)

	// A writer that offers neither: nothing can close it, and the log says so once.
	stalled := newStalledWriter()
	sctx, cancel := context.WithCancel(ctx)
	done = make(chan struct{})
	go func() {
		defer close(done)
		sse.ServeHTTP(stalled, httptest.NewRequest(http.MethodGet, "/?project=p", nil).WithContext(sctx))
	}()
	<-stalled.blocked
	for logs.FilterMessageSnippet("cannot be disconnected").Len() == 0 {
		select {
		case <-ctx.Done():
			t.Fatal("no warning about a client that cannot be disconnected")
		case <-time.After(5 * time.Millisecond):
		}
	}
	close(stalled.release)
	cancel()
	<-done
}

func TestSSERejectsBadRequestsAndOptions(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.Pool(t, pgtest.NewDB(t).URL)
	sse := newSSE(t, pool, []string{"p"}, nil)
	srv := httptest.NewServer(sse)
	defer srv.Close()
	resp, err := http.Post(srv.URL, "text/plain", nil)
	require.NoError(t, err)
	resp.Body.Close()
	require.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode)
	_, status := openStream(t, ctx, srv.URL+"?project=not%20valid", "")
	require.Equal(t, http.StatusBadRequest, status)
	// Closed (shutting down): an empty stream, so that an EventSource reconnects rather than
	// give up as it would on an error status.
	sse.Close()
	s, status := openStream(t, ctx, srv.URL, "")
	require.Equal(t, http.StatusOK, status)
	_, more := <-s.frames
	require.False(t, more, "the stream ends at once, with no event")
	s.close()

	_, err = web.NewSSEHandler(web.SSEOptions{RingSize: 8, MaxReplay: 4, Retry: time.Nanosecond})
	require.Error(t, err)
	for _, field := range []string{"SSEOptions.Pool", "SSEOptions.Projects", "SSEOptions.RingSize", "SSEOptions.MaxReplay", "SSEOptions.Retry"} {
		require.ErrorContains(t, err, field)
	}
}

// readDeletions reads a stream's task:deleted events into fn until fn says it is done; a
// reset or the end of the stream is an error.
func readDeletions(resp *http.Response, fn func(deletion) (done bool, err error)) error {
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	event := ""
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "event: "):
			event = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: "):
			if event != outbox.EventTypeTaskDeleted {
				return fmt.Errorf("unexpected %s event: %s", event, line)
			}
			var d deletion
			if err := json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &d); err != nil {
				return err
			}
			if done, err := fn(d); done || err != nil {
				return err
			}
		case line == "":
			event = ""
		}
	}
	return fmt.Errorf("stream ended: %v", sc.Err())
}

// TestSSEStreamsTheProcessOwnDeletionsAtOnce: a process's consumer does not hand the
// process's own deletions to its own listeners (its local emitter already told them), so the
// stream used to learn of them only when the next observed event showed the gap: a dashboard
// that deleted a task did not see it on its own stream. The dispatcher now hands them to the
// stream (an OwnWritesListener), in sequence order with everyone else's.
func TestSSEStreamsTheProcessOwnDeletionsAtOnce(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	sse := newSSE(t, pool, []string{"p"}, nil)
	srv := httptest.NewServer(sse)
	defer srv.Close()
	other := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: []string{"p"}})
	self := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{ID: "web", Projects: []string{"p"}, Config: testkit.FastConfig(), Listeners: []outbox.Listener{sse}})
	_, err := self.Store.CreateMany(ctx, "p", "t", 10)
	require.NoError(t, err)

	client, _ := openStream(t, ctx, srv.URL+"?project=p", "")
	defer client.close()
	deleteTasks(t, ctx, other, "p", 1, 2) // observed: 1, 2
	client.expectDeletions(t, ctx, "p", 1, 2)
	deleteTasks(t, ctx, self, "p", 3, 5) // this process's own: 3, 4, 5
	// No other deletion follows: the stream must show 3 to 5 by itself. A bounded wait, so
	// that a stream that waits for the next observed event fails within testkit.WaitLimit.
	own, cancel := context.WithTimeout(ctx, testkit.WaitLimit)
	defer cancel()
	client.expectDeletions(t, own, "p", 3, 5)
	deleteTasks(t, ctx, other, "p", 6, 6) // observed again, right after them
	client.expectDeletions(t, ctx, "p", 6, 6)
	require.Equal(t, int64(3), self.Consumer.Stats().Own, "the listeners that take no own writes still do not get them")
	require.Zero(t, sse.Stats().ReplayedFromOutbox+sse.Stats().OutboxReads, "nothing was filled in from the outbox")
}

// TestSSEAnswersUnservedAndForbiddenProjectsAlike is issue 28's project-ID oracle: a project
// the stream does not serve got 404 and a served one the client may not see 403, so anyone
// who reached the stream could probe which project IDs exist.
func TestSSEAnswersUnservedAndForbiddenProjectsAlike(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.Pool(t, pgtest.NewDB(t).URL)
	testkit.SeedEvents(t, pool, "open", 1)
	testkit.SeedEvents(t, pool, "secret", 1)
	sse := newSSE(t, pool, []string{"open", "secret"}, func(o *web.SSEOptions) {
		o.Authorize = func(_ *http.Request, p string) bool { return p == "open" }
	})
	srv := httptest.NewServer(sse)
	defer srv.Close()
	answer := func(query string) string {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+query, nil)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return fmt.Sprintf("%d %s", resp.StatusCode, b)
	}
	forbidden := answer("?project=secret")
	require.True(t, strings.HasPrefix(forbidden, "403 "), forbidden)
	require.Equal(t, forbidden, answer("?project=globex"), "a project that does not exist is answered as a forbidden one")
	require.Equal(t, forbidden, answer("?project=open,globex"))
}

// TestSSEEndsAStreamWhoseAccessIsRevoked: Authorize was consulted only at connect, so a user
// whose access was revoked kept streaming for as long as the connection lasted. The open
// stream now asks again every ReauthorizeInterval (on the handler's clock, here a fake one)
// and ends when a project is refused; the browser's reconnect is then refused.
func TestSSEEndsAStreamWhoseAccessIsRevoked(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.Pool(t, pgtest.NewDB(t).URL)
	testkit.SeedEvents(t, pool, "p", 3)
	clock := outboxtest.NewFakeClock()
	var revoked atomic.Bool
	var asked atomic.Int64
	sse := newSSE(t, pool, []string{"p"}, func(o *web.SSEOptions) {
		o.Clock = clock
		o.ReauthorizeInterval = time.Minute
		o.Authorize = func(*http.Request, string) bool { asked.Add(1); return !revoked.Load() }
	})
	srv := httptest.NewServer(sse)
	defer srv.Close()
	s, status := openStream(t, ctx, srv.URL+"?project=p", "")
	require.Equal(t, http.StatusOK, status)
	defer s.close()
	// A bounded wait for the stream's check to be scheduled, so that a stream that never
	// checks again fails within testkit.WaitLimit.
	wait, cancel := context.WithTimeout(ctx, testkit.WaitLimit)
	defer cancel()
	_, err := clock.WaitForTimer(wait, time.Minute)
	require.NoError(t, err, "the open stream schedules no check of its access")

	// Still allowed: the stream stays open and carries the next event.
	clock.Advance(time.Minute)
	_, err = clock.WaitForTimer(wait, time.Minute)
	require.NoError(t, err, "the next check is scheduled")
	require.Equal(t, int64(2), asked.Load(), "asked at connect and at the check")
	require.NoError(t, sse.HandleObserved(ctx, outbox.ObservedEvent{Event: outbox.Event{ProjectID: "p", Sequence: 4,
		EventType: outbox.EventTypeTaskDeleted, TaskID: "t-4", DeletedAt: time.Now()}}))
	s.expectDeletions(t, ctx, "p", 4, 4)

	revoked.Store(true)
	clock.Advance(time.Minute)
	select {
	case f, ok := <-s.frames:
		require.False(t, ok, "the revoked stream sent %+v", f)
	case <-wait.Done():
		t.Fatal("the stream is still open after its access was revoked")
	}
	_, status = openStream(t, ctx, srv.URL+"?project=p", "")
	require.Equal(t, http.StatusForbidden, status, "the reconnect is refused")
}

// TestSSEResetsAPositionBeyondTheHead: a well-formed Last-Event-ID at 1,295 with the head at
// 152 was taken as a position, and the client silently skipped every event until the head
// passed it. It is reset, as an unknown position is; a position beyond this handler's newest
// event but within the outbox's head (another process was further ahead) is not.
func TestSSEResetsAPositionBeyondTheHead(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.Pool(t, pgtest.NewDB(t).URL)
	testkit.SeedEvents(t, pool, "p", 152)
	testkit.SeedEvents(t, pool, "q", 5)
	sse := newSSE(t, pool, []string{"p", "q"}, nil)
	srv := httptest.NewServer(sse)
	defer srv.Close()
	probe, _ := openStream(t, ctx, srv.URL+"?project=p,q", "")
	fp := strings.Split(probe.position(t, ctx), ".")[1]
	id := func(p, q int64) string { return "1." + fp + "." + b36(p) + "." + b36(q) }

	s, _ := openStream(t, ctx, srv.URL+"?project=p,q", id(1295, 0))
	f := s.next(t, ctx, "the reset")
	require.Equal(t, web.SSEResetEvent, f.Event, "a position beyond the head is not reset: %+v", f)
	require.JSONEq(t, `{"projects":["p"],"reason":"unknown_position"}`, f.Data)
	require.Equal(t, id(152, 0), f.ID)
	s.expectDeletions(t, ctx, "q", 1, 5)
	s.close()

	// The outbox moves on to 162 while this handler has seen 152: a client at 160 (from a
	// process further ahead) keeps its position and gets 161 on.
	testkit.SeedMore(t, pool, "p", "more", 10)
	before := sse.Stats().Resets
	s, _ = openStream(t, ctx, srv.URL+"?project=p,q", id(160, 5))
	defer s.close()
	for seq := int64(153); seq <= 162; seq++ {
		require.NoError(t, sse.HandleObserved(ctx, outbox.ObservedEvent{Event: outbox.Event{ProjectID: "p", Sequence: seq,
			EventType: outbox.EventTypeTaskDeleted, TaskID: fmt.Sprintf("late-%d", seq), DeletedAt: time.Now()}}))
	}
	s.expectDeletions(t, ctx, "p", 161, 162)
	require.Equal(t, before, sse.Stats().Resets)
}

// TestSSEBudgetsTheHeadReadsOfPositionsBeyondTheRing: checking a resumed position beyond the
// handler's newest event costs a head read, so a client naming many such positions would cost
// one read per project; the reads count against MaxReplayReads, and a position left unchecked
// is reset as unknown.
func TestSSEBudgetsTheHeadReadsOfPositionsBeyondTheRing(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.Pool(t, pgtest.NewDB(t).URL)
	testkit.SeedEvents(t, pool, "p", 5)
	testkit.SeedEvents(t, pool, "q", 5)
	sse := newSSE(t, pool, []string{"p", "q"}, func(o *web.SSEOptions) { o.MaxReplayReads = 1 })
	srv := httptest.NewServer(sse)
	defer srv.Close()
	probe, _ := openStream(t, ctx, srv.URL+"?project=p,q", "")
	fp := strings.Split(probe.position(t, ctx), ".")[1] // the handler has seen 5 of each
	testkit.SeedMore(t, pool, "p", "more", 5)
	testkit.SeedMore(t, pool, "q", "more", 5) // the outbox is at 10 in both

	s, _ := openStream(t, ctx, srv.URL+"?project=p,q", "1."+fp+".8.8")
	defer s.close()
	f := s.next(t, ctx, "the reset")
	require.Equal(t, web.SSEResetEvent, f.Event, "q's position was taken unchecked: %+v", f)
	require.JSONEq(t, `{"projects":["q"],"reason":"unknown_position"}`, f.Data)
	require.Equal(t, "1."+fp+".8.5", f.ID, "p's position, checked with the one read, is kept")
	for seq := int64(6); seq <= 10; seq++ {
		require.NoError(t, sse.HandleObserved(ctx, outbox.ObservedEvent{Event: outbox.Event{ProjectID: "p", Sequence: seq,
			EventType: outbox.EventTypeTaskDeleted, TaskID: fmt.Sprintf("more-%d", seq-5), DeletedAt: time.Now()}}))
	}
	s.expectDeletions(t, ctx, "p", 9, 10)
}

// TestSSEBoundsTheReplayReadsOfAConnection: a client naming many projects, each up to
// MaxReplay behind, cost one outbox read per page of each (64 projects, 1,280 reads at the
// defaults). A connection now spends at most MaxReplayReads (by default two projects'
// worth of MaxReplay: 10 reads at MaxReplay 2000), and the projects that do not fit are reset
// explicitly, never skipped.
func TestSSEBoundsTheReplayReadsOfAConnection(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.Pool(t, pgtest.NewDB(t).URL)
	projects := []string{"p", "q", "r"}
	for _, p := range projects {
		testkit.SeedEvents(t, pool, p, 2000)
	}
	sse := newSSE(t, pool, projects, func(o *web.SSEOptions) { o.RingSize = 16; o.MaxReplay = 2000 })
	srv := httptest.NewServer(sse)
	defer srv.Close()
	url := srv.URL + "?project=p,q,r"
	probe, _ := openStream(t, ctx, url, "")
	fp := strings.Split(probe.position(t, ctx), ".")[1]
	before := sse.Stats()

	// Each project 2000 behind, within MaxReplay: four page reads each.
	s, _ := openStream(t, ctx, url, "1."+fp+".0.0.0")
	defer s.close()
	f := s.next(t, ctx, "the reset")
	require.Equal(t, web.SSEResetEvent, f.Event, "r replayed past the connection's budget: %.80s", f.Data)
	require.JSONEq(t, `{"projects":["r"],"reason":"replay_budget"}`, f.Data)
	require.Equal(t, "1."+fp+".0.0."+b36(2000), f.ID)
	s.expectDeletions(t, ctx, "p", 1, 2000)
	s.expectDeletions(t, ctx, "q", 1, 2000)
	after := sse.Stats()
	t.Logf("replay of p and q, reset of r: %s", after)
	require.Equal(t, int64(8), after.OutboxReads-before.OutboxReads, "four pages of p and of q")
	require.Equal(t, int64(1), after.Resets-before.Resets)
}

// TestSSEBudgetAlsoBoundsALiveClientThatFallsBehind: the replay budget is the connection's,
// not only its resume's: a client that falls behind the ring while connected reads the outbox
// until the budget is spent, and is then reset, never silently moved past what it missed.
func TestSSEBudgetAlsoBoundsALiveClientThatFallsBehind(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.Pool(t, pgtest.NewDB(t).URL)
	sse := newSSE(t, pool, []string{"p"}, func(o *web.SSEOptions) {
		o.RingSize = 16
		o.MaxReplayReads = 1
		o.WriteTimeout = time.Hour // the gated writer below blocks for as long as the test needs
	})
	w := newGatedWriter()
	sctx, cancel := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer w.pw.Close() // the test's reader sees the stream end
		sse.ServeHTTP(w, httptest.NewRequest(http.MethodGet, "/?project=p", nil).WithContext(sctx))
	}()
	defer func() {
		cancel()
		select {
		case <-w.gate:
		default:
			close(w.gate)
		}
		w.pr.Close()
		<-done
	}()
	<-w.blocked // attached at p's head, 0; its opening frame waits

	// 600 deletions arrive while the client does not read: the ring keeps the last 16.
	testkit.SeedEvents(t, pool, "p", 600)
	for seq := int64(1); seq <= 600; seq++ {
		require.NoError(t, sse.HandleObserved(ctx, outbox.ObservedEvent{Event: outbox.Event{ProjectID: "p", Sequence: seq,
			EventType: outbox.EventTypeTaskDeleted, TaskID: fmt.Sprintf("seed-%d", seq), DeletedAt: time.Now()}}))
	}
	close(w.gate)

	// One outbox read (sequences 1 to 500), then the budget is spent: a reset, not 501 on.
	sc := bufio.NewScanner(w.pr)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	var want int64 = 1
	event := ""
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "event: "):
			event = strings.TrimPrefix(line, "event: ")
		case strings.HasPrefix(line, "data: ") && event == outbox.EventTypeTaskDeleted:
			var d deletion
			require.NoError(t, json.Unmarshal([]byte(strings.TrimPrefix(line, "data: ")), &d))
			require.Equal(t, want, d.Sequence, "after sequence %d", want-1)
			require.LessOrEqual(t, d.Sequence, int64(500), "an event beyond the one page the budget allows, and no reset")
			want++
		case strings.HasPrefix(line, "data: ") && event == web.SSEResetEvent:
			require.Equal(t, int64(501), want, "the reset comes after the one page the budget allows")
			require.JSONEq(t, `{"projects":["p"],"reason":"replay_budget"}`, strings.TrimPrefix(line, "data: "))
			return
		}
	}
	t.Fatalf("the stream ended without a reset: %v", sc.Err())
}

// gatedWriter is a ResponseWriter whose writes wait until the gate opens and then go to a
// pipe the test reads.
type gatedWriter struct {
	header  http.Header
	gate    chan struct{}
	blocked chan struct{}
	once    sync.Once
	pr      *io.PipeReader
	pw      *io.PipeWriter
}

func newGatedWriter() *gatedWriter {
	pr, pw := io.Pipe()
	return &gatedWriter{header: http.Header{}, gate: make(chan struct{}), blocked: make(chan struct{}), pr: pr, pw: pw}
}

func (w *gatedWriter) Header() http.Header { return w.header }
func (w *gatedWriter) WriteHeader(int)     {}
func (w *gatedWriter) Flush()              {}
func (w *gatedWriter) Write(b []byte) (int, error) {
	w.once.Do(func() { close(w.blocked) })
	<-w.gate
	return w.pw.Write(b)
}

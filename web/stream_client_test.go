package web_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/web"
)

// server is an event stream that can be stopped abruptly and started again (a new handler on
// the same database, as after a restart) where clients find it.
type streamServer interface {
	start(t *testing.T, h *web.SSEHandler)
	stop()
}

// tcpServer serves on one TCP address across restarts.
type tcpServer struct {
	addr string
	srv  *http.Server
}

func (s *tcpServer) start(t *testing.T, h *web.SSEHandler) {
	t.Helper()
	var ln net.Listener
	var err error
	deadline := time.Now().Add(testkit.WaitLimit)
	for {
		if ln, err = net.Listen("tcp", s.addr); err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond) // the address the previous server closed is not free yet
	}
	require.NoError(t, err)
	s.addr = ln.Addr().String()
	s.srv = &http.Server{Handler: h}
	go func() { _ = s.srv.Serve(ln) }()
	t.Cleanup(s.stop)
}

// stop closes the listener and every connection at once, streams included.
func (s *tcpServer) stop() { _ = s.srv.Close() }

// unixServer serves on a unix socket from ListenUnix across restarts.
type unixServer struct {
	path string
	srv  *http.Server
}

func (s *unixServer) start(t *testing.T, h *web.SSEHandler) {
	t.Helper()
	ln, err := web.ListenUnix(s.path)
	require.NoError(t, err)
	fi, err := os.Lstat(s.path)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), fi.Mode().Perm(), "only the owner may connect")
	s.srv = &http.Server{Handler: h}
	go func() { _ = s.srv.Serve(ln) }()
	t.Cleanup(s.stop)
}

func (s *unixServer) stop() { _ = s.srv.Close() }

// followAcrossRestart: a client follows a stream of two projects from its start; the server
// is stopped while the client's handler holds the 20th event, more deletions are numbered
// while it is down, and a new handler on the same database is started where the old one was.
// The client must get every event once, in order, marked observed, and keep its position.
func followAcrossRestart(t *testing.T, srv streamServer, url string, client *http.Client) {
	ctx := streamCtx(t)
	pool := pgtest.NewPool(t)
	projects := []string{"p", "q"}
	testkit.SeedEvents(t, pool, "p", 60)
	testkit.SeedEvents(t, pool, "q", 30)
	var current *web.SSEHandler
	newHandler := func() *web.SSEHandler {
		current = newSSE(t, pool, projects, func(o *web.SSEOptions) { o.RingSize = 16 })
		return current
	}
	srv.start(t, newHandler())

	positions := web.FilePositions(filepath.Join(t.TempDir(), "position"))
	require.NoError(t, positions.Save(ctx, streamPos(projects, 0, 0)), "from the start of both projects")
	rec := newStreamRecorder()
	held, release := make(chan struct{}), make(chan struct{})
	n := 0
	var failedOn outbox.ObservedEvent
	rec.onEvent = func(ev outbox.ObservedEvent) error {
		switch n++; n {
		case 20:
			close(held)
			<-release
		case 120: // on the second connection: the first can carry no more than the 90 events before the restart
			failedOn = ev
			return errors.New("the handler fails once") // the client resumes, and the event comes again
		}
		return nil
	}
	opts := quick(web.StreamClientOptions{URL: url, HTTPClient: client, Positions: positions, ConsumerID: "child-1"})
	c, stop := runClient(t, ctx, opts, rec)

	select {
	case <-held:
	case <-ctx.Done():
		t.Fatal("the client got no 20th event")
	}
	srv.stop()
	testkit.SeedMore(t, pool, "p", "down", 40) // numbered while no stream is served: 61 to 100
	testkit.SeedMore(t, pool, "q", "down", 20) // 31 to 50
	srv.start(t, newHandler())
	close(release)

	rec.waitEvents(t, ctx, map[string]int{"p": 100, "q": 50})
	require.Equal(t, testkit.Seq(1, 100), rec.seqs("p"), "every event of p once, in order")
	require.Equal(t, testkit.Seq(1, 50), rec.seqs("q"), "every event of q once, in order")
	rec.mu.Lock()
	for i, ev := range rec.events {
		var fence *outbox.FenceError
		require.ErrorAs(t, rec.fenced[i], &fence, "RefuseObserved in the handler's context")
		require.Equal(t, outbox.Observed{ConsumerID: "child-1", EventID: ev.EventID, WriterProcessID: "writer-0123456789abcdef"}, rec.markers[i])
		attempt := 1
		if ev.ProjectID == failedOn.ProjectID && ev.Sequence == failedOn.Sequence {
			attempt = 2 // the one the handler failed on, once
		}
		require.Equal(t, outbox.ObservedEvent{Event: ev.Event, Observed: true, ConsumerID: "child-1", Attempt: attempt}, ev)
		require.Equal(t, outbox.TaskDeletedEventID(ev.TaskID, ev.DeletedAt), ev.EventID)
	}
	rec.mu.Unlock()
	waitSaved(t, ctx, positions, streamPos(projects, 100, 50))
	require.ErrorIs(t, stop(), context.Canceled)
	st := c.Stats()
	t.Logf("client: %+v", st)
	require.Equal(t, int64(150), st.Events)
	require.GreaterOrEqual(t, st.Connects, int64(3), "it reconnected after the restart and after the handler failed")
	require.GreaterOrEqual(t, st.Errors, int64(2), "the dropped connection, the failed handler")
	require.Zero(t, st.Resets+st.Undecodable)

	// A new client process with the same position file, after more deletions reached the
	// stream: it resumes where the first one stopped.
	testkit.SeedMore(t, pool, "p", "later", 10)
	for i := range 10 {
		require.NoError(t, current.HandleObserved(ctx, liveEvent("p", "later", i+1, int64(101+i))))
	}
	rec2 := newStreamRecorder()
	runClient(t, ctx, opts, rec2)
	rec2.waitEvents(t, ctx, map[string]int{"p": 10})
	require.Equal(t, testkit.Seq(101, 110), rec2.seqs("p"))
	waitSaved(t, ctx, positions, streamPos(projects, 110, 50))
	require.Empty(t, rec2.seqs("q"))
}

func TestStreamClientFollowsAcrossARestartOverHTTP(t *testing.T) {
	t.Parallel()
	srv := &tcpServer{addr: freeAddr(t)}
	followAcrossRestart(t, srv, "http://"+srv.addr+"/events?project=p,q", nil)
}

func TestStreamClientFollowsAcrossARestartOverAUnixSocket(t *testing.T) {
	t.Parallel()
	dir := shortTempDir(t)
	srv := &unixServer{path: filepath.Join(dir, "parent.sock")}
	followAcrossRestart(t, srv, "http://parent/events?project=p,q", web.UnixSocketClient(srv.path))
	srv.stop()
	_, err := os.Lstat(srv.path)
	require.True(t, errors.Is(err, os.ErrNotExist), "the closed listener removed its socket: %v", err)
}

// TestStreamClientGetsResetsAndGoesOn: a client whose saved position is below the pruned
// floor, or further behind than MaxReplay, is handed a reset and then the events after it;
// a reset its handler failed on comes again.
func TestStreamClientGetsResetsAndGoesOn(t *testing.T) {
	t.Parallel()
	ctx := streamCtx(t)
	pool := pgtest.NewPool(t)
	pruneSetup(t, ctx, pool)
	projects := []string{"p", "q"}
	sse := newSSE(t, pool, projects, func(o *web.SSEOptions) { o.RingSize = 16; o.MaxReplay = 350 })
	srv := &tcpServer{addr: "127.0.0.1:0"}
	srv.start(t, sse)
	url := "http://" + srv.addr + "/events?project=p,q"
	follow := func(from string, rec *streamRecorder) (*web.StreamClient, web.PositionStore) {
		positions := web.FilePositions(filepath.Join(t.TempDir(), "position"))
		require.NoError(t, positions.Save(ctx, from))
		c, _ := runClient(t, ctx, quick(web.StreamClientOptions{URL: url, Positions: positions}), rec)
		return c, positions
	}

	// p below its floor: a reset of p, q's rest, then live events of p.
	below := newStreamRecorder()
	_, belowPos := follow(streamPos(projects, 90, 395), below)
	below.waitEvents(t, ctx, map[string]int{"q": 5})
	testkit.SeedMore(t, pool, "p", "live", 2)
	for i := range 2 {
		require.NoError(t, sse.HandleObserved(ctx, liveEvent("p", "live", i+1, int64(401+i))))
	}
	below.waitEvents(t, ctx, map[string]int{"p": 2})
	below.mu.Lock()
	require.Equal(t, []web.SSEReset{{Projects: []string{"p"}, Reason: web.ResetBelowPrunedFloor}}, below.resets)
	require.Equal(t, "p", below.events[len(below.events)-1].ProjectID)
	below.mu.Unlock()
	require.Equal(t, testkit.Seq(396, 400), below.seqs("q"))
	require.Equal(t, testkit.Seq(401, 402), below.seqs("p"), "after the reset, p goes on from its newest event")
	waitSaved(t, ctx, belowPos, streamPos(projects, 402, 400))

	// q further behind than MaxReplay: p's rest, then a reset of q.
	behind := newStreamRecorder()
	follow(streamPos(projects, 395, 10), behind)
	behind.waitUntil(t, ctx, "the reset of q", func() bool { return len(behind.resets) == 1 })
	require.Equal(t, testkit.Seq(396, 402), behind.seqs("p"))
	require.Equal(t, web.SSEReset{Projects: []string{"q"}, Reason: web.ResetTooFarBehind}, behind.resets[0])

	// A position of another stream, whose reset the handler fails on once: the reset comes
	// again on the next connection, and the position never moved past it meanwhile.
	other := newStreamRecorder()
	failed := false
	other.onReset = func(web.SSEReset) error {
		if !failed {
			failed = true
			return errors.New("refetch failed")
		}
		return nil
	}
	c, otherPos := follow("1.00000000.1.1", other)
	other.waitUntil(t, ctx, "the reset, again", func() bool { return len(other.resets) == 1 })
	require.Equal(t, web.SSEReset{Projects: projects, Reason: web.ResetUnknownPosition}, other.resets[0])
	waitSaved(t, ctx, otherPos, streamPos(projects, 402, 400))
	st := c.Stats()
	require.Equal(t, web.StreamClientStats{Connects: 2, Resets: 1, Errors: 1}, st)
}

// waitSaved waits until positions holds want.
func waitSaved(t *testing.T, ctx context.Context, positions web.PositionStore, want string) {
	t.Helper()
	var got string
	for {
		var err error
		got, err = positions.Load(ctx)
		require.NoError(t, err)
		if got == want {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("saved position %q, want %q", got, want)
		case <-time.After(5 * time.Millisecond):
		}
	}
}

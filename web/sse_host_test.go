package web_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/fx"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
	"fusion/outbox/internal/testkit"
)

// sseFrame is one dispatched server-sent event as a browser's EventSource sees it.
type sseFrame struct {
	ID    string // the last event ID after this event
	Event string
	Data  string
}

// sseStream is a client of an event stream over real HTTP. It parses frames as the
// EventSource algorithm does: an "id" line sets the last event ID even when the frame has no
// data (and so dispatches nothing).
type sseStream struct {
	resp   *http.Response
	cancel context.CancelFunc
	frames chan sseFrame
	lastID chan string // the last event ID once the stream ends
	opened chan string // the first event ID the stream sent
	once   sync.Once
	last   string
}

// openStream connects to url, sending lastEventID when it is not empty. It returns the
// response status for a refused stream.
func openStream(t *testing.T, ctx context.Context, url, lastEventID string, header ...string) (*sseStream, int) {
	t.Helper()
	ctx, cancel := context.WithCancel(ctx)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	require.NoError(t, err)
	if lastEventID != "" {
		req.Header.Set("Last-Event-ID", lastEventID)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	if resp.StatusCode != http.StatusOK {
		resp.Body.Close()
		cancel()
		return nil, resp.StatusCode
	}
	s := &sseStream{resp: resp, cancel: cancel, frames: make(chan sseFrame, 4096), lastID: make(chan string, 1),
		opened: make(chan string, 1)}
	go func() {
		defer close(s.frames)
		id := lastEventID
		defer func() { s.lastID <- id }()
		var event, data string
		var hasData bool
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			switch {
			case line == "":
				if hasData {
					if event == "" {
						event = "message"
					}
					select {
					case s.frames <- sseFrame{ID: id, Event: event, Data: data}:
					case <-ctx.Done():
						return
					}
				}
				event, data, hasData = "", "", false
			case strings.HasPrefix(line, ":"):
			case strings.HasPrefix(line, "id: "):
				id = strings.TrimPrefix(line, "id: ")
				select {
				case s.opened <- id:
				default:
				}
			case strings.HasPrefix(line, "event: "):
				event = strings.TrimPrefix(line, "event: ")
			case strings.HasPrefix(line, "data: "):
				data, hasData = strings.TrimPrefix(line, "data: "), true
			}
		}
	}()
	return s, http.StatusOK
}

// close drops the connection and returns the last event ID the client saw.
func (s *sseStream) close() string {
	s.once.Do(func() {
		s.cancel()
		s.resp.Body.Close()
		for range s.frames {
		}
		s.last = <-s.lastID
	})
	return s.last
}

// position waits for the stream's first event ID (the position it opened at), then closes it.
func (s *sseStream) position(t *testing.T, ctx context.Context) string {
	t.Helper()
	select {
	case id := <-s.opened:
		s.close()
		return id
	case <-ctx.Done():
		t.Fatal("the stream sent no event ID")
	}
	return ""
}

// next returns the next frame or fails the test when none comes before ctx ends.
func (s *sseStream) next(t *testing.T, ctx context.Context, what string) sseFrame {
	t.Helper()
	select {
	case f, ok := <-s.frames:
		if !ok {
			t.Fatalf("%s: the stream ended", what)
		}
		return f
	case <-ctx.Done():
		t.Fatalf("%s: no frame before the deadline", what)
	}
	return sseFrame{}
}

// deletion is the part of an event frame's payload the tests check.
type deletion struct {
	ProjectID string `json:"projectId"`
	Sequence  int64  `json:"sequence"`
	TaskID    string `json:"taskId"`
	Observed  bool   `json:"observed"`
}

func decodeDeletion(t *testing.T, f sseFrame) deletion {
	t.Helper()
	require.Equal(t, outbox.EventTypeTaskDeleted, f.Event, "frame %+v", f)
	var d deletion
	require.NoError(t, json.Unmarshal([]byte(f.Data), &d))
	return d
}

// expectDeletions reads frames and requires exactly the given sequences of project, in order.
func (s *sseStream) expectDeletions(t *testing.T, ctx context.Context, project string, from, to int64) {
	t.Helper()
	for want := from; want <= to; want++ {
		d := decodeDeletion(t, s.next(t, ctx, fmt.Sprintf("sequence %d of %s", want, project)))
		require.Equal(t, project, d.ProjectID)
		require.Equal(t, want, d.Sequence, "expected sequence %d of %s, got %d", want, project, d.Sequence)
		require.True(t, d.Observed)
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	return ln.Addr().String()
}

// hostApp is the reference host as an engine binary builds it, serving HTTP on addr.
type hostApp struct {
	app  *fx.App
	addr string
}

// startHost starts the reference host with the durable identity consumer (set in its
// settings scope) observing projects, serving HTTP on addr.
func startHost(t *testing.T, url, consumer, addr string, projects []string, tweak func(*testhost.HostConfig), extra ...fx.Option) *hostApp {
	t.Helper()
	ctx := testkit.Ctx(t)
	pool := pgtest.Pool(t, url)
	scope := consumer + "-node"
	require.NoError(t, testhost.NewSettings(pool, scope).Set(ctx, "outbox.consumer_id", consumer))
	cfg := testhost.HostConfig{DSN: url, Projects: projects, SettingsScope: scope, HTTPAddr: addr, Actor: "test",
		Outbox: testkit.FastConfig()}
	if tweak != nil {
		tweak(&cfg)
	}
	app := fx.New(append([]fx.Option{outbox.Module, testhost.Module, fx.Supply(cfg, zaptest.NewLogger(t)), fx.NopLogger}, extra...)...)
	require.NoError(t, app.Err())
	require.NoError(t, app.Start(ctx))
	h := &hostApp{app: app, addr: addr}
	t.Cleanup(func() { h.stop(t) })
	return h
}

func (h *hostApp) stop(t *testing.T) {
	if h.app == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), testkit.WaitLimit)
	defer cancel()
	require.NoError(t, h.app.Stop(ctx))
	h.app = nil
}

// TestSSEReferenceHostResumesAReconnectingClient is issue 18's resume, through the reference
// host's own /events: a client reads part of the stream, drops its connection, deletions go on
// while it is away, and it reconnects with the Last-Event-ID it last saw, as an EventSource
// does. It must get exactly the events it missed, in order, and then the live ones.
func TestSSEReferenceHostResumesAReconnectingClient(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	projects := []string{"alpha", "beta"}
	writer := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: projects})
	for _, p := range projects {
		_, err := writer.Store.CreateMany(ctx, p, "t", 40)
		require.NoError(t, err)
	}
	host := startHost(t, db.URL, "dashboard", freeAddr(t), projects, nil)
	url := "http://" + host.addr + "/events?project=alpha,beta"

	first, status := openStream(t, ctx, url, "")
	require.Equal(t, http.StatusOK, status)
	for i := 1; i <= 5; i++ {
		_, err := writer.Store.Delete(ctx, "alpha", fmt.Sprintf("t-%d", i))
		require.NoError(t, err)
	}
	first.expectDeletions(t, ctx, "alpha", 1, 5)
	lastID := first.close()

	// While the client is away: ten more deletions in alpha, three in beta.
	for i := 6; i <= 15; i++ {
		_, err := writer.Store.Delete(ctx, "alpha", fmt.Sprintf("t-%d", i))
		require.NoError(t, err)
	}
	for i := 1; i <= 3; i++ {
		_, err := writer.Store.Delete(ctx, "beta", fmt.Sprintf("t-%d", i))
		require.NoError(t, err)
	}
	testkit.WaitCursor(t, ctx, writer.Pool, "alpha", "dashboard", 15)
	testkit.WaitCursor(t, ctx, writer.Pool, "beta", "dashboard", 3)

	// A bounded wait, so that a stream that never resumes fails before the test's deadline.
	rctx, cancel := context.WithTimeout(ctx, testkit.WaitLimit)
	defer cancel()
	resumed, status := openStream(t, rctx, url, lastID)
	require.Equal(t, http.StatusOK, status)
	defer resumed.close()
	got := map[string][]int64{}
	for len(got["alpha"])+len(got["beta"]) < 13 {
		d := decodeDeletion(t, resumed.next(t, rctx, "a missed deletion"))
		got[d.ProjectID] = append(got[d.ProjectID], d.Sequence)
	}
	require.Equal(t, testkit.Seq(6, 15), got["alpha"], "missed alpha deletions, in order, each once")
	require.Equal(t, testkit.Seq(1, 3), got["beta"], "missed beta deletions, in order, each once")
	// Then live, with nothing repeated at the seam.
	_, err := writer.Store.Delete(ctx, "alpha", "t-16")
	require.NoError(t, err)
	resumed.expectDeletions(t, rctx, "alpha", 16, 16)
}

// TestSSEReferenceHostBoundsTheProjectFilter is issue 14 item 6's unbounded filter: a 1 MB
// ?project= list was accepted and held per connection.
func TestSSEReferenceHostBoundsTheProjectFilter(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	host := startHost(t, db.URL, "dashboard", freeAddr(t), []string{"alpha"}, nil)
	base := "http://" + host.addr + "/events?project="

	names := make([]string, 65)
	for i := range names {
		names[i] = fmt.Sprintf("p%d", i)
	}
	s, status := openStream(t, ctx, base+strings.Join(names, ","), "")
	if s != nil {
		s.close()
	}
	require.Equal(t, http.StatusBadRequest, status, "65 projects in one filter")

	huge := strings.Repeat("p,", 15_000) + "alpha"
	s, status = openStream(t, ctx, base+huge, "")
	if s != nil {
		s.close()
	}
	require.Equal(t, http.StatusRequestURITooLong, status, "a 30 kB filter")

	s, status = openStream(t, ctx, base+"not-served", "")
	if s != nil {
		s.close()
	}
	require.Equal(t, http.StatusForbidden, status, "a project the host does not serve, answered as a forbidden one")
}

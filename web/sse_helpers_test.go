package web_test

import (
	"bufio"
	"context"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/web"
)

// Helpers of the event-stream tests (the seeded events are internal/testkit's): a handler, and
// response writers that stall or can be hijacked.

// newSSE builds a stream handler over pool serving projects.
func newSSE(t *testing.T, pool *pgxpool.Pool, projects []string, tweak func(*web.SSEOptions)) *web.SSEHandler {
	t.Helper()
	// A client goroutine of a test on a busy machine may not read for seconds, and a shared
	// replay read of a herd may take more than the default 10s: only the tests of stalled
	// clients (which set their own) may see a write or a read time out.
	opts := web.SSEOptions{Pool: pool, Projects: outbox.StaticProjects(projects), Retry: 50 * time.Millisecond,
		WriteTimeout: testkit.WaitLimit, ReplayReadTimeout: testkit.WaitLimit}
	if tweak != nil {
		tweak(&opts)
	}
	h, err := web.NewSSEHandler(opts)
	require.NoError(t, err)
	t.Cleanup(h.Close)
	return h
}

// pruneSetup is TestSSEResets's database: p numbered 1 to 400 with 1 to 100 pruned, q 1 to 400.
func pruneSetup(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	t.Helper()
	testkit.SeedEvents(t, pool, "p", 100) // one tick
	testkit.SeedMore(t, pool, "p", "late", 300)
	testkit.SeedEvents(t, pool, "q", 400)
	// Retention pruned p through 100: the events of its first tick.
	tag, err := pool.Exec(ctx, `DELETE FROM lifecycle_event_log WHERE project_id = 'p' AND task_id LIKE 'seed-%'`)
	require.NoError(t, err)
	require.Equal(t, int64(100), tag.RowsAffected())
	_, err = pool.Exec(ctx, `UPDATE lifecycle_outbox_heads SET pruned_through = 100, last_sequence = GREATEST(last_sequence, 100) WHERE project_id = 'p'`)
	require.NoError(t, err)
}

// stalledWriter is an http.ResponseWriter whose client never reads: every write blocks until
// released, as a browser on a dead connection would make it. It supports neither write
// deadlines nor hijacking.
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

// hijackableWriter is a ResponseWriter without write deadlines whose connection the handler
// can take over: writes go to one end of a pipe nobody reads.
type hijackableWriter struct {
	header   http.Header
	server   net.Conn
	client   net.Conn
	blocked  chan struct{}
	once     sync.Once
	hijacked chan struct{}
}

func newHijackableWriter() *hijackableWriter {
	s, c := net.Pipe()
	return &hijackableWriter{header: http.Header{}, server: s, client: c, blocked: make(chan struct{}), hijacked: make(chan struct{})}
}

func (w *hijackableWriter) Header() http.Header { return w.header }
func (w *hijackableWriter) WriteHeader(int)     {}
func (w *hijackableWriter) Flush()              {}
func (w *hijackableWriter) Write(b []byte) (int, error) {
	w.once.Do(func() { close(w.blocked) })
	return w.server.Write(b)
}
func (w *hijackableWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	close(w.hijacked)
	return w.server, nil, nil
}

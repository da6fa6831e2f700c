package web_test

import (
	"bufio"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/web"
)

// Helpers of the event-stream tests: seeded events, a handler, and response writers that stall
// or can be hijacked.

// seedEvents writes n events into project's log, as many writers would have, and ticks: what a
// freshly started stream handler finds there, numbered.
func seedEvents(t *testing.T, pool *pgxpool.Pool, project string, n int) {
	t.Helper()
	ctx := ctxT(t)
	_, err := pool.Exec(ctx, `
INSERT INTO lifecycle_event_log (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
SELECT $1, 'seed-' || g, timestamptz '2030-01-01' + g * interval '1 second', 'task:deleted', false, 1, clock_timestamp(), 'writer-0123456789abcdef'
FROM generate_series(1, $2) g`, project, n)
	require.NoError(t, err)
	_, err = outbox.Sequence(ctx, pool, []string{project}, 10000)
	require.NoError(t, err)
}

// seedMore numbers n more events of project after whatever it has, with task IDs of prefix.
func seedMore(t *testing.T, pool *pgxpool.Pool, project, prefix string, n int) {
	t.Helper()
	ctx := ctxT(t)
	_, err := pool.Exec(ctx, `
INSERT INTO lifecycle_event_log (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
SELECT $1, $2 || '-' || g, timestamptz '2031-01-01' + g * interval '1 second', 'task:deleted', false, 1, clock_timestamp(), 'writer-0123456789abcdef'
FROM generate_series(1, $3) g`, project, prefix, n)
	require.NoError(t, err)
	_, err = outbox.Sequence(ctx, pool, []string{project}, 10000)
	require.NoError(t, err)
}

// seedUndecodableAt4 stores project's first four events as the stream numbered before schema 18
// holds them: three well-formed ones (as seedEvents names them), then at sequence 4 a row the
// reader cannot deliver (deleted_at = 'infinity', which the log's types refuse but a numbered
// row of the stream may hold); then it writes two well-formed events into the log and ticks, so
// they are numbered 5 and 6 after the stream.
func seedUndecodableAt4(t *testing.T, pool *pgxpool.Pool, project string) {
	t.Helper()
	ctx := ctxT(t)
	_, err := pool.Exec(ctx, `
INSERT INTO lifecycle_outbox (project_id, sequence, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
SELECT $1, g, 'seed-' || g, timestamptz '2030-01-01' + g * interval '1 second', 'task:deleted', false, 1, clock_timestamp(), 'writer-0123456789abcdef'
FROM generate_series(1, 3) g`, project)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `
INSERT INTO lifecycle_outbox (project_id, sequence, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
VALUES ($1, 4, 'forever', 'infinity', 'task:deleted', false, 1, now(), 'writer-0123456789abcdef')`, project)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO lifecycle_outbox_heads (project_id, last_sequence) VALUES ($1, 4)
		ON CONFLICT (project_id) DO UPDATE SET last_sequence = 4`, project)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `
INSERT INTO lifecycle_event_log (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
SELECT $1, 'late-' || g, timestamptz '2031-01-01' + g * interval '1 second', 'task:deleted', false, 1, clock_timestamp(), 'writer-0123456789abcdef'
FROM generate_series(1, 2) g`, project)
	require.NoError(t, err)
	_, err = outbox.Sequence(ctx, pool, []string{project}, 10000) // sequences 5 and 6
	require.NoError(t, err)
}

// newSSE builds a stream handler over pool serving projects.
func newSSE(t *testing.T, pool *pgxpool.Pool, projects []string, tweak func(*web.SSEOptions)) *web.SSEHandler {
	t.Helper()
	// A client goroutine of a test on a busy machine may not read for seconds, and a shared
	// replay read of a herd may take more than the default 10s: only the tests of stalled
	// clients (which set their own) may see a write or a read time out.
	opts := web.SSEOptions{Pool: pool, Projects: outbox.StaticProjects(projects), Retry: 50 * time.Millisecond,
		WriteTimeout: waitLimit, ReplayReadTimeout: waitLimit}
	if tweak != nil {
		tweak(&opts)
	}
	h, err := web.NewSSEHandler(opts)
	require.NoError(t, err)
	t.Cleanup(h.Close)
	return h
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

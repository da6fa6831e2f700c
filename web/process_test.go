package web_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
)

// The fixture the web tests share with the core's (process_test.go, schema_test.go and
// retry_test.go at the module root, of which these are the parts they use): simulated processes
// on a throwaway database, through the core's public API only.

func TestMain(m *testing.M) { pgtest.Main(m) }

// ctxT bounds a test. Like waitLimit it only says when to give up, so it is generous: a busy
// machine runs a test many times slower than an idle one.
func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// waitLimit bounds a wait for something that should happen. It is a failure bound, not a
// measure of how soon it happens, so it is generous: on a busy machine (two cores shared by a
// whole CI run and other work) what takes milliseconds idle can take many seconds.
const waitLimit = 2 * time.Minute

// errListener is what a failing listener returns; its text must reach no page.
var errListener = errors.New("listener says no: secret-token-123 and some prose")

// recorder is an observed listener that can be told to fail.
type recorder struct {
	mu   sync.Mutex
	fail func(outbox.ObservedEvent) error // nil: succeed
}

func newRecorder() *recorder { return &recorder{} }

func (r *recorder) Name() string { return "recorder" }

func (r *recorder) HandleObserved(_ context.Context, ev outbox.ObservedEvent) error {
	r.mu.Lock()
	fail := r.fail
	r.mu.Unlock()
	if fail != nil {
		return fail(ev)
	}
	return nil
}

func (r *recorder) setFail(fn func(outbox.ObservedEvent) error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fail = fn
}

// process is one simulated OS process: its own pool, task store, cache and (optionally)
// consumer, all on the shared database.
type process struct {
	pool     *pgxpool.Pool
	store    *testhost.Store
	writer   *outbox.Writer
	consumer *outbox.Consumer
	rec      *recorder
}

type processOpts struct {
	id        outbox.ConsumerID // empty: a writer-only process
	projects  []string
	cfg       outbox.Config
	listeners []outbox.Listener
	noStart   bool
}

func startProcess(t *testing.T, url string, o processOpts) *process {
	t.Helper()
	ctx := ctxT(t)
	p := &process{pool: pgtest.Pool(t, url), rec: newRecorder()}
	w, err := outbox.NewWriter(p.pool, o.cfg, zaptest.NewLogger(t))
	require.NoError(t, err)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
		defer cancel()
		require.NoError(t, w.Close(ctx))
	})
	p.writer = w
	p.store = testhost.New(p.pool, testhost.Options{Writer: w, Logger: zaptest.NewLogger(t)})
	require.NoError(t, p.store.LoadCache(ctx, o.projects...))
	if o.id == "" {
		return p
	}
	d := outbox.NewDispatcher(outbox.DispatcherOptions{
		Listeners: append([]outbox.Listener{p.rec}, o.listeners...), Cache: p.store.Cache(),
		SelfWriterID: w.ProcessID(), Timeout: o.cfg.WithDefaults().ListenerTimeout, Logger: zaptest.NewLogger(t),
	})
	c, err := outbox.NewConsumer(outbox.ConsumerOptions{
		ID: o.id, Pool: p.pool, Config: o.cfg, Projects: outbox.StaticProjects(o.projects), Dispatcher: d,
		LiveTasks: p.store, Cache: p.store.Cache(), Audit: p.store, Logger: zaptest.NewLogger(t),
	})
	require.NoError(t, err)
	p.consumer = c
	if !o.noStart {
		p.start(t)
	}
	return p
}

func (p *process) start(t *testing.T) {
	t.Helper()
	require.NoError(t, p.consumer.Start(ctxT(t)))
	t.Cleanup(func() { p.stop(t) })
}

func (p *process) stop(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	require.NoError(t, p.consumer.Stop(ctx))
}

func fastConfig() outbox.Config {
	return outbox.Config{PollInterval: 50 * time.Millisecond, LeaseTTL: 3 * time.Second, HeartbeatInterval: time.Second, NewCursor: outbox.NewCursorOldest}
}

func cursorOf(t *testing.T, pool *pgxpool.Pool, project, consumer string) int64 {
	t.Helper()
	var c *int64
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT last_acked_sequence FROM lifecycle_consumer_cursors WHERE project_id = $1 AND consumer_id = $2`,
		project, consumer).Scan(&c))
	if c == nil {
		return -1
	}
	return *c
}

func waitCursor(t *testing.T, ctx context.Context, pool *pgxpool.Pool, project, consumer string, want int64) {
	t.Helper()
	for {
		if cursorOf(t, pool, project, consumer) == want {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("cursor of %s/%s never reached %d (at %d)", project, consumer, want, cursorOf(t, pool, project, consumer))
		case <-time.After(10 * time.Millisecond):
		}
	}
}

type deliveryRow struct {
	State    string
	Attempts int
	Class    string
	Wait     time.Duration // next_attempt_at - last_failed_at
}

func deliveryOf(t *testing.T, pool *pgxpool.Pool, consumer string, seq int64) deliveryRow {
	t.Helper()
	var r deliveryRow
	var waitSeconds float64
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT state, attempts, coalesce(last_failure_class, ''),
		coalesce(extract(epoch FROM next_attempt_at - last_failed_at), 0)::float8
		FROM lifecycle_consumer_deliveries WHERE consumer_id = $1 AND sequence = $2`, consumer, seq).Scan(&r.State, &r.Attempts, &r.Class, &waitSeconds))
	r.Wait = time.Duration(waitSeconds * float64(time.Second)).Round(time.Millisecond)
	return r
}

func newRetention(t *testing.T, pool *pgxpool.Pool, cfg outbox.Config) *outbox.Retention {
	t.Helper()
	r, err := outbox.NewRetention(pool, cfg, zaptest.NewLogger(t), nil)
	require.NoError(t, err)
	return r
}

func floorOf(t *testing.T, pool *pgxpool.Pool, project string) int64 {
	t.Helper()
	var f int64
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT pruned_through FROM lifecycle_outbox_heads WHERE project_id = $1`, project).Scan(&f))
	return f
}

func seq(from, to int64) []int64 {
	var out []int64
	for i := from; i <= to; i++ {
		out = append(out, i)
	}
	return out
}

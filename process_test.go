package outbox_test

import (
	"context"
	"fmt"
	"slices"
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

// The simulated processes the consumer tests run: a recording listener, a process with its
// own pool, store and consumer, and cursor helpers.

// recorder is an observed listener that remembers what it got, and can be told to fail.
type recorder struct {
	mu      sync.Mutex
	events  []outbox.ObservedEvent
	changed chan struct{}
	fail    func(outbox.ObservedEvent) error // nil: succeed
}

func newRecorder() *recorder { return &recorder{changed: make(chan struct{})} }

func (r *recorder) Name() string { return "recorder" }

func (r *recorder) HandleObserved(ctx context.Context, ev outbox.ObservedEvent) error {
	r.mu.Lock()
	fail := r.fail
	r.mu.Unlock()
	var err error
	if fail != nil {
		err = fail(ev)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if err == nil {
		r.events = append(r.events, ev)
	}
	close(r.changed)
	r.changed = make(chan struct{})
	return err
}

func (r *recorder) setFail(fn func(outbox.ObservedEvent) error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fail = fn
}

func (r *recorder) snapshot() []outbox.ObservedEvent {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.events)
}

// waitFor blocks until cond holds over the recorded events or ctx ends.
func (r *recorder) waitFor(t *testing.T, ctx context.Context, what string, cond func([]outbox.ObservedEvent) bool) []outbox.ObservedEvent {
	t.Helper()
	for {
		r.mu.Lock()
		evs, ch := slices.Clone(r.events), r.changed
		r.mu.Unlock()
		if cond(evs) {
			return evs
		}
		select {
		case <-ch:
		case <-ctx.Done():
			t.Fatalf("waiting for %s: %v (have %d events)", what, ctx.Err(), len(evs))
		}
	}
}

func (r *recorder) waitCount(t *testing.T, ctx context.Context, n int) []outbox.ObservedEvent {
	t.Helper()
	return r.waitFor(t, ctx, fmt.Sprintf("%d events", n), func(evs []outbox.ObservedEvent) bool { return len(evs) >= n })
}

// process is one simulated OS process: its own pool, task store, cache and (optionally)
// consumer, all on the shared database.
type process struct {
	pool     *pgxpool.Pool
	store    *testhost.Store
	writer   *outbox.Writer
	consumer *outbox.Consumer
	rec      *recorder
	// stalled, when set, describes what the process's connections wait on (the bouncer's state).
	stalled func() string
	// serverURL, when set, reaches PostgreSQL directly, so that a stalled stop can also log the
	// server's view of the sessions behind the bouncer.
	serverURL string
}

type processOpts struct {
	id        outbox.ConsumerID // empty: a writer-only process
	projects  []string
	cfg       outbox.Config
	listeners []outbox.Listener
	live      outbox.LiveTasks // defaults to the store
	noStart   bool
	metrics   *outbox.Metrics
}

func startProcess(t *testing.T, url string, o processOpts) *process {
	t.Helper()
	ctx := ctxT(t)
	p := &process{pool: pgtest.Pool(t, url), rec: newRecorder()}
	w, err := outbox.NewWriter(p.pool, o.cfg, zaptest.NewLogger(t))
	require.NoError(t, err)
	t.Cleanup(func() { closeWriter(t, w) })
	p.writer = w
	p.store = testhost.New(p.pool, testhost.Options{Writer: w, Logger: zaptest.NewLogger(t)})
	require.NoError(t, p.store.LoadCache(ctx, o.projects...))
	if o.id == "" {
		return p
	}
	if o.live == nil {
		o.live = p.store
	}
	d := outbox.NewDispatcher(outbox.DispatcherOptions{
		Listeners: append([]outbox.Listener{p.rec}, o.listeners...), Cache: p.store.Cache(),
		SelfWriterID: w.ProcessID(), Timeout: o.cfg.WithDefaults().ListenerTimeout, Logger: zaptest.NewLogger(t),
	})
	c, err := outbox.NewConsumer(outbox.ConsumerOptions{
		ID: o.id, Pool: p.pool, Config: o.cfg, Projects: outbox.StaticProjects(o.projects), Dispatcher: d,
		LiveTasks: o.live, Cache: p.store.Cache(), Audit: p.store, Metrics: o.metrics, Logger: zaptest.NewLogger(t),
	})
	require.NoError(t, err)
	p.consumer = c
	if !o.noStart {
		p.start(t)
	}
	return p
}

// newConsumerWith builds a consumer for p with extra listeners after the recorder.
func newConsumerWith(t *testing.T, p *process, id outbox.ConsumerID, projects []string, cfg outbox.Config, extra ...outbox.Listener) *outbox.Consumer {
	t.Helper()
	d := outbox.NewDispatcher(outbox.DispatcherOptions{
		Listeners: append([]outbox.Listener{p.rec}, extra...), Cache: p.store.Cache(),
		SelfWriterID: p.writer.ProcessID(), Timeout: cfg.WithDefaults().ListenerTimeout, Logger: zaptest.NewLogger(t),
	})
	c, err := outbox.NewConsumer(outbox.ConsumerOptions{
		ID: id, Pool: p.pool, Config: cfg, Projects: outbox.StaticProjects(projects), Dispatcher: d,
		LiveTasks: p.store, Cache: p.store.Cache(), Audit: p.store, Logger: zaptest.NewLogger(t),
	})
	require.NoError(t, err)
	return c
}

func (p *process) start(t *testing.T) {
	t.Helper()
	require.NoError(t, p.consumer.Start(ctxT(t)))
	t.Cleanup(func() { p.stop(t) })
}

func (p *process) stop(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- p.consumer.Stop(ctx) }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		// A stop this slow has stalled (seen through PgBouncer, cause not found): say what the
		// bouncer holds while it does.
		if p.stalled != nil {
			t.Logf("consumer stop still running after 10s; the bouncer: %s", p.stalled())
		}
		if p.serverURL != "" {
			logServerState(t, p.serverURL)
		}
		require.NoError(t, <-done)
	}
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

// waitReconciled waits until c has reconciled want times. The cursor a reconciliation moves
// is committed before its count goes up, so a test that saw the cursor waits for the count.
func waitReconciled(t *testing.T, ctx context.Context, c *outbox.Consumer, want int64) {
	t.Helper()
	for c.Stats().Reconciliations < want {
		select {
		case <-ctx.Done():
			t.Fatalf("consumer reconciled %d times, want %d", c.Stats().Reconciliations, want)
		case <-time.After(5 * time.Millisecond):
		}
	}
	require.Equal(t, want, c.Stats().Reconciliations)
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

package testkit

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
)

// The simulated processes the consumer tests run: a recording listener, a process with its
// own pool, store and consumer, and cursor helpers.

// Recorder is an observed listener that remembers what it got, and can be told to fail.
type Recorder struct {
	mu      sync.Mutex
	events  []outbox.ObservedEvent
	changed chan struct{}
	fail    func(outbox.ObservedEvent) error // nil: succeed
	parked  []int64                          // sequences the consumer told it it parked
}

// NewRecorder returns a recorder that has recorded nothing and fails nothing.
func NewRecorder() *Recorder { return &Recorder{changed: make(chan struct{})} }

// Name is the listener's name.
func (r *Recorder) Name() string { return "recorder" }

// HandleObserved records ev, unless the function SetFail gave fails it.
func (r *Recorder) HandleObserved(ctx context.Context, ev outbox.ObservedEvent) error {
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

// HandleParked records that the consumer parked ev (outbox.ParkedListener).
func (r *Recorder) HandleParked(_ context.Context, ev outbox.Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.parked = append(r.parked, ev.Sequence)
}

// Parked returns the sequences the consumer said it parked, in order.
func (r *Recorder) Parked() []int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]int64(nil), r.parked...)
}

// SetFail makes every later call return what fn returns for its event (nil: succeed); a nil
// fn fails nothing.
func (r *Recorder) SetFail(fn func(outbox.ObservedEvent) error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.fail = fn
}

// Snapshot is what the recorder has recorded so far, in order.
func (r *Recorder) Snapshot() []outbox.ObservedEvent {
	r.mu.Lock()
	defer r.mu.Unlock()
	return slices.Clone(r.events)
}

// WaitFor blocks until cond holds over the recorded events or ctx ends.
func (r *Recorder) WaitFor(t testing.TB, ctx context.Context, what string, cond func([]outbox.ObservedEvent) bool) []outbox.ObservedEvent {
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

// WaitCount waits for n recorded events or more.
func (r *Recorder) WaitCount(t testing.TB, ctx context.Context, n int) []outbox.ObservedEvent {
	t.Helper()
	return r.WaitFor(t, ctx, fmt.Sprintf("%d events", n), func(evs []outbox.ObservedEvent) bool { return len(evs) >= n })
}

// Process is one simulated OS process: its own pool, task store, cache and (optionally)
// consumer, all on the shared database.
type Process struct {
	Pool     *pgxpool.Pool
	Store    *testhost.Store
	Writer   *outbox.Writer
	Consumer *outbox.Consumer
	Rec      *Recorder
	// Stalled, when set, describes what the process's connections wait on (the bouncer's state).
	Stalled func() string
	// ServerURL, when set, reaches PostgreSQL directly, so that a stalled stop can also log the
	// server's view of the sessions behind the bouncer.
	ServerURL string
}

// ProcessOpts says what StartProcess starts.
type ProcessOpts struct {
	ID        outbox.ConsumerID // empty: a writer-only process
	Projects  []string
	Config    outbox.Config
	Listeners []outbox.Listener // after the recorder
	Live      outbox.LiveTasks  // defaults to the store
	NoStart   bool
	Metrics   *outbox.Metrics
}

// StartProcess starts a process on the database at url: a writer and a store with the
// projects' cache loaded, and with an ID a consumer, started unless o.NoStart. The test's
// cleanup stops and closes them.
func StartProcess(t testing.TB, url string, o ProcessOpts) *Process {
	t.Helper()
	ctx := Ctx(t)
	p := &Process{Pool: pgtest.Pool(t, url), Rec: NewRecorder()}
	w, err := outbox.NewWriter(p.Pool, o.Config, zaptest.NewLogger(t))
	require.NoError(t, err)
	t.Cleanup(func() { CloseWriter(t, w) })
	p.Writer = w
	p.Store = testhost.New(p.Pool, testhost.Options{Writer: w, Logger: zaptest.NewLogger(t)})
	require.NoError(t, p.Store.LoadCache(ctx, o.Projects...))
	if o.ID == "" {
		return p
	}
	if o.Live == nil {
		o.Live = p.Store
	}
	d := outbox.NewDispatcher(outbox.DispatcherOptions{
		Listeners: append([]outbox.Listener{p.Rec}, o.Listeners...), Cache: p.Store.Cache(),
		SelfWriterID: w.ProcessID(), Timeout: o.Config.WithDefaults().ListenerTimeout, Logger: zaptest.NewLogger(t),
	})
	c, err := outbox.NewConsumer(outbox.ConsumerOptions{
		ID: o.ID, Pool: p.Pool, Config: o.Config, Projects: outbox.StaticProjects(o.Projects), Dispatcher: d,
		LiveTasks: o.Live, Cache: p.Store.Cache(), Audit: p.Store, Metrics: o.Metrics, Logger: zaptest.NewLogger(t),
	})
	require.NoError(t, err)
	p.Consumer = c
	if !o.NoStart {
		p.Start(t)
	}
	return p
}

// Start starts the process's consumer; the test's cleanup stops it.
func (p *Process) Start(t testing.TB) {
	t.Helper()
	require.NoError(t, p.Consumer.Start(Ctx(t)))
	t.Cleanup(func() { p.Stop(t) })
}

// Stop stops the process's consumer within WaitLimit. A stop still running after 10s logs
// what p.Stalled and p.ServerURL can tell.
func (p *Process) Stop(t testing.TB) {
	ctx, cancel := context.WithTimeout(context.Background(), WaitLimit)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- p.Consumer.Stop(ctx) }()
	select {
	case err := <-done:
		require.NoError(t, err)
	case <-time.After(10 * time.Second):
		// A stop this slow has stalled (seen through PgBouncer, cause not found): say what the
		// bouncer holds while it does.
		if p.Stalled != nil {
			t.Logf("consumer stop still running after 10s; the bouncer: %s", p.Stalled())
		}
		if p.ServerURL != "" {
			LogServerState(t, p.ServerURL)
		}
		require.NoError(t, <-done)
	}
}

// CloseWriter closes w within a bound, as a host's stop path would.
func CloseWriter(t testing.TB, w *outbox.Writer) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), WaitLimit)
	defer cancel()
	require.NoError(t, w.Close(ctx))
}

// FastConfig polls, heartbeats and expires leases fast, and starts a new cursor at the oldest
// event.
func FastConfig() outbox.Config {
	return outbox.Config{PollInterval: 50 * time.Millisecond, LeaseTTL: 3 * time.Second, HeartbeatInterval: time.Second, NewCursor: outbox.NewCursorOldest}
}

// CursorOf is the consumer's acknowledged sequence in project: -1 for a cursor that has
// acknowledged nothing.
func CursorOf(t testing.TB, pool *pgxpool.Pool, project, consumer string) int64 {
	t.Helper()
	var c *int64
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT last_acked_sequence FROM lifecycle_consumer_cursors WHERE project_id = $1 AND consumer_id = $2`,
		project, consumer).Scan(&c))
	if c == nil {
		return -1
	}
	return *c
}

// WaitCursor waits until the consumer's cursor in project is at want, or fails when ctx ends.
func WaitCursor(t testing.TB, ctx context.Context, pool *pgxpool.Pool, project, consumer string, want int64) {
	t.Helper()
	for {
		if CursorOf(t, pool, project, consumer) == want {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("cursor of %s/%s never reached %d (at %d)", project, consumer, want, CursorOf(t, pool, project, consumer))
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// DeliveryRow is a consumer's delivery row of one event.
type DeliveryRow struct {
	State    string
	Attempts int
	Class    string
	Wait     time.Duration // next_attempt_at - last_failed_at
}

// DeliveryOf reads the consumer's delivery row of the event at seq.
func DeliveryOf(t testing.TB, pool *pgxpool.Pool, consumer string, seq int64) DeliveryRow {
	t.Helper()
	var r DeliveryRow
	var waitSeconds float64
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT state, attempts, coalesce(last_failure_class, ''),
		coalesce(extract(epoch FROM next_attempt_at - last_failed_at), 0)::float8
		FROM lifecycle_consumer_deliveries WHERE consumer_id = $1 AND sequence = $2`, consumer, seq).Scan(&r.State, &r.Attempts, &r.Class, &waitSeconds))
	r.Wait = time.Duration(waitSeconds * float64(time.Second)).Round(time.Millisecond)
	return r
}

// NewRetention builds a retention over pool.
func NewRetention(t testing.TB, pool *pgxpool.Pool, cfg outbox.Config) *outbox.Retention {
	t.Helper()
	r, err := outbox.NewRetention(pool, cfg, zaptest.NewLogger(t), nil)
	require.NoError(t, err)
	return r
}

// FloorOf is how far retention has pruned project.
func FloorOf(t testing.TB, pool *pgxpool.Pool, project string) int64 {
	t.Helper()
	var f int64
	require.NoError(t, pool.QueryRow(context.Background(), `SELECT pruned_through FROM lifecycle_outbox_heads WHERE project_id = $1`, project).Scan(&f))
	return f
}

// Seq lists from to to.
func Seq(from, to int64) []int64 {
	var out []int64
	for i := from; i <= to; i++ {
		out = append(out, i)
	}
	return out
}

// LogServerState logs, for a failed test, the sessions of the database at url (straight to
// PostgreSQL), the locks they wait for, and the outbox's rows.
func LogServerState(t testing.TB, url string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Logf("server state: %v", err)
		return
	}
	defer conn.Close(ctx)
	for _, q := range []string{
		`SELECT pid, usename, application_name, state, now() - state_change AS in_state, backend_xid, now() - xact_start AS xact_age, wait_event_type, wait_event, left(query, 160) AS query
		 FROM pg_catalog.pg_stat_activity WHERE datname = current_database() AND pid <> pg_catalog.pg_backend_pid()`,
		`SELECT pid, locktype, mode, relation::regclass::text, granted FROM pg_catalog.pg_locks WHERE NOT granted`,
		`SELECT project_id, last_sequence, sequencer_owner, sequencer_until - now() AS hold_left FROM lifecycle_outbox_heads`,
		`SELECT project_id, task_id FROM lifecycle_outbox_pending`,
		`SELECT project_id, sequence, task_id FROM lifecycle_outbox ORDER BY project_id, sequence`,
		`SELECT project_id, task_id, txid FROM lifecycle_event_log ORDER BY txid, project_id`,
		`SELECT tick_id, project_id, first_sequence, events FROM lifecycle_tick_project ORDER BY tick_id, project_id`,
		`SELECT project_id, consumer_id, last_acked_sequence, lease_owner, lease_epoch, lease_expires_at - now() AS lease_left FROM lifecycle_consumer_cursors`,
		`SELECT project_id, consumer_id, sequence, state, attempts FROM lifecycle_consumer_deliveries`,
	} {
		rows, err := conn.Query(ctx, q)
		if err != nil {
			t.Logf("%s: %v", q, err)
			continue
		}
		all, err := pgx.CollectRows(rows, pgx.RowToMap)
		t.Logf("%s:\n%v (%v)", q, all, err)
	}
}

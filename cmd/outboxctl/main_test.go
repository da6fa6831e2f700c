package main_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
)

// binary is the outboxctl built once for the whole test run.
var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "outboxctl-test-")
	if err != nil {
		fmt.Fprintf(os.Stderr, "temp dir: %v\n", err)
		os.Exit(1)
	}
	if err := removeAtExit(dir); err != nil {
		fmt.Fprintf(os.Stderr, "%v\n", err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "outboxctl")
	out, err := exec.Command("go", "build", "-o", binary, ".").CombinedOutput()
	if err != nil {
		fmt.Fprintf(os.Stderr, "build outboxctl: %v\n%s", err, out)
		os.Exit(1)
	}
	pgtest.Main(m)
}

// cleanerPipe is the write end of the pipe removeAtExit's cleaner reads. Kept in a variable
// so that no finalizer closes it before the process exits.
var cleanerPipe *os.File

// removeAtExit removes dir when this process exits, however it exits: pgtest.Main ends with
// os.Exit, so a deferred RemoveAll would never run. A shell reading the other end of a pipe
// removes dir once the pipe closes, which the kernel does when this process ends.
func removeAtExit(dir string) error {
	r, w, err := os.Pipe()
	if err != nil {
		return fmt.Errorf("cleaner pipe: %w", err)
	}
	cmd := exec.Command("/bin/sh", "-c", `read _ignored; rm -rf "$1"`, "cleaner", dir)
	cmd.Stdin = r
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		_ = r.Close()
		_ = w.Close()
		return fmt.Errorf("start cleaner: %w", err)
	}
	_ = r.Close()
	cleanerPipe = w
	return nil
}

// result is one run of the CLI.
type result struct {
	stdout, stderr string
	code           int
}

func (r result) String() string {
	return fmt.Sprintf("exit %d\n--- stdout\n%s--- stderr\n%s", r.code, r.stdout, r.stderr)
}

// ctl runs outboxctl with args and extra environment, stdin not a terminal (/dev/null).
func ctl(t *testing.T, env []string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	cmd := exec.CommandContext(ctx, binary, args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "DATABASE_URL=") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	res := result{stdout: stdout.String(), stderr: stderr.String()}
	var exitErr *exec.ExitError
	switch {
	case errors.As(err, &exitErr):
		res.code = exitErr.ExitCode()
	case err != nil:
		t.Fatalf("run outboxctl %v: %v", args, err)
	}
	require.NotContains(t, res.stderr, "goroutine ", "no stack trace")
	require.NotContains(t, res.stderr, "panic:", "no panic")
	return res
}

// decode unmarshals a --json result.
func decode[T any](t *testing.T, r result) T {
	t.Helper()
	require.Equal(t, 0, r.code, "%s", r)
	var v T
	require.NoError(t, json.Unmarshal([]byte(r.stdout), &v), "%s", r)
	return v
}

// waitLimit bounds a wait for something that should happen (a command's run, a consumer's
// stop, a replay resolved): only where the test gives up, so generous for a busy machine.
const waitLimit = 2 * time.Minute

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// consumerProc is one simulated process running a real consumer whose listener can be told
// to fail.
type consumerProc struct {
	consumer *outbox.Consumer
	mu       sync.Mutex
	fail     func(outbox.ObservedEvent) bool
	replayed []int64
	stopped  bool
}

func (p *consumerProc) handle(_ context.Context, ev outbox.ObservedEvent) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.fail != nil && p.fail(ev) {
		return errors.New("listener broken")
	}
	if ev.Replay {
		p.replayed = append(p.replayed, ev.Sequence)
	}
	return nil
}

// heal makes the listener succeed from now on, as a deployed fix would.
func (p *consumerProc) heal() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.fail = nil
}

func (p *consumerProc) replays() []int64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]int64(nil), p.replayed...)
}

func (p *consumerProc) stop(t *testing.T) {
	t.Helper()
	p.mu.Lock()
	if p.stopped {
		p.mu.Unlock()
		return
	}
	p.stopped = true
	p.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), waitLimit)
	defer cancel()
	require.NoError(t, p.consumer.Stop(ctx))
}

func consumerConfig(maxAttempts int) outbox.Config {
	return outbox.Config{PollInterval: 50 * time.Millisecond, LeaseTTL: 30 * time.Second, HeartbeatInterval: time.Second,
		NewCursor: outbox.NewCursorOldest, MaxAttempts: maxAttempts}
}

// startConsumer starts consumer id on projects in a process of its own (pool, cache).
func startConsumer(t *testing.T, url string, id outbox.ConsumerID, projects []string, maxAttempts int, fail func(outbox.ObservedEvent) bool) *consumerProc {
	t.Helper()
	ctx := testCtx(t)
	pool := pgtest.Pool(t, url)
	store := testhost.New(pool, testhost.Options{})
	require.NoError(t, store.LoadCache(ctx, projects...))
	log := zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel))
	p := &consumerProc{fail: fail}
	cfg := consumerConfig(maxAttempts)
	cfg.ListenerTimeout = 5 * time.Second
	d := outbox.NewDispatcher(outbox.DispatcherOptions{Listeners: []outbox.Listener{outbox.ListenerFunc("probe", p.handle)},
		Cache: store.Cache(), NoLocalWriter: true, Logger: log})
	c, err := outbox.NewConsumer(outbox.ConsumerOptions{ID: id, Pool: pool, Config: cfg, Projects: outbox.StaticProjects(projects),
		Dispatcher: d, LiveTasks: store, Cache: store.Cache(), Logger: log})
	require.NoError(t, err)
	p.consumer = c
	require.NoError(t, c.Start(ctx))
	t.Cleanup(func() { p.stop(t) })
	return p
}

// waitUntil polls cond until it holds or ctx ends.
func waitUntil(t *testing.T, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for %s: %v", what, ctx.Err())
		case <-tick.C:
		}
	}
}

func cursorOf(t *testing.T, pool *pgxpool.Pool, project, consumer string) int64 {
	t.Helper()
	var c *int64
	err := pool.QueryRow(context.Background(), `SELECT last_acked_sequence FROM lifecycle_consumer_cursors
		WHERE project_id = $1 AND consumer_id = $2`, project, consumer).Scan(&c)
	if err != nil || c == nil {
		return -1
	}
	return *c
}

func waitCursor(t *testing.T, ctx context.Context, pool *pgxpool.Pool, project, consumer string, want int64) {
	t.Helper()
	waitUntil(t, ctx, fmt.Sprintf("cursor %s/%s at %d", project, consumer, want), func() bool {
		return cursorOf(t, pool, project, consumer) == want
	})
}

// fixture is a database with real traffic:
//
//	alpha: 5 deletions. reporter read 2 and stopped (lags 3, oldest unread 40 days old);
//	       dashboard read all; engine read all but parked sequence 2 as a dead letter.
//	beta:  2 deletions, read by dashboard.
//
// Every event, and the tick that numbered it, is backdated 40 days, past the 30-day retention
// window.
type fixture struct {
	db        pgtest.DB
	pool      *pgxpool.Pool // superuser, for assertions
	engine    *consumerProc
	dashboard *consumerProc
}

func newFixture(t *testing.T) *fixture {
	t.Helper()
	ctx := testCtx(t)
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	w, err := outbox.NewWriter(pool, outbox.Config{}, zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, w.Close(context.Background())) })
	store := testhost.New(pool, testhost.Options{Writer: w})
	_, err = store.CreateMany(ctx, "alpha", "t", 5)
	require.NoError(t, err)
	_, err = store.CreateMany(ctx, "beta", "t", 2)
	require.NoError(t, err)
	// Each deletion is numbered by a tick of its own: retention prunes a project's part of a
	// tick whole, and the prune tests count event by event.
	del := func(project string, ids ...int) {
		for _, i := range ids {
			_, err := store.Delete(ctx, project, fmt.Sprintf("t-%d", i))
			require.NoError(t, err)
			_, err = outbox.Tick(ctx, pool)
			require.NoError(t, err)
		}
	}
	del("alpha", 1, 2)
	del("beta", 1)
	reporter := startConsumer(t, db.URL, "reporter", []string{"alpha"}, 0, nil)
	waitCursor(t, ctx, pool, "alpha", "reporter", 2)
	reporter.stop(t)
	del("alpha", 3, 4, 5)
	del("beta", 2)

	f := &fixture{db: db, pool: pool}
	f.dashboard = startConsumer(t, db.URL, "dashboard", []string{"alpha", "beta"}, 0, nil)
	f.engine = startConsumer(t, db.URL, "engine", []string{"alpha"}, 1, func(ev outbox.ObservedEvent) bool {
		return ev.ProjectID == "alpha" && ev.Sequence == 2
	})
	waitCursor(t, ctx, pool, "alpha", "dashboard", 5)
	waitCursor(t, ctx, pool, "beta", "dashboard", 2)
	waitCursor(t, ctx, pool, "alpha", "engine", 5)
	// The events are in the log (schema 18), and retention judges a part of a tick by when it
	// was ticked: both are backdated (only the test's superuser may rewrite them).
	_, err = pool.Exec(ctx, `UPDATE lifecycle_event_log SET occurred_at = occurred_at - interval '40 days'`)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `UPDATE lifecycle_tick SET ticked_at = ticked_at - interval '40 days'`)
	require.NoError(t, err)
	return f
}

// ctl runs outboxctl against the fixture's database.
func (f *fixture) ctl(t *testing.T, args ...string) result {
	t.Helper()
	return ctl(t, nil, append([]string{"--dsn", f.db.URL}, args...)...)
}

func (f *fixture) eventID(t *testing.T, project string, seq int64) string {
	t.Helper()
	var id string
	require.NoError(t, f.pool.QueryRow(context.Background(), `SELECT lifecycle_event_id(task_id, deleted_at)
		FROM lifecycle_outbox_read($1, $2 - 1, 1, NULL, NULL, NULL) WHERE sequence = $2`, project, seq).Scan(&id))
	return id
}

// auditRow is a lifecycle_audit row as the tests read it.
type auditRow struct {
	Project, Consumer, Actor, Reason, EventID string
	Sequence                                  int64
}

func audits(t *testing.T, pool *pgxpool.Pool, action outbox.AuditAction) []auditRow {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT project_id, coalesce(consumer_id, ''), coalesce(actor, ''), coalesce(reason, ''),
		coalesce(event_id, ''), coalesce(sequence, 0) FROM lifecycle_audit WHERE action = $1 ORDER BY id`, string(action))
	require.NoError(t, err)
	defer rows.Close()
	var out []auditRow
	for rows.Next() {
		var a auditRow
		require.NoError(t, rows.Scan(&a.Project, &a.Consumer, &a.Actor, &a.Reason, &a.EventID, &a.Sequence))
		out = append(out, a)
	}
	require.NoError(t, rows.Err())
	return out
}

// tableRows splits a table's lines into fields, keyed by the first two cells.
func tableRows(t *testing.T, out string) (header []string, rows map[string][]string) {
	t.Helper()
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	require.NotEmpty(t, lines)
	header = strings.Fields(lines[0])
	rows = map[string][]string{}
	for _, l := range lines[1:] {
		if l == "" {
			break // the table ends at a blank line; a summary may follow
		}
		f := strings.Fields(l)
		require.GreaterOrEqual(t, len(f), 2, "line %q", l)
		rows[f[0]+"/"+f[1]] = f
	}
	return header, rows
}

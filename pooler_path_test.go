package outbox_test

import (
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/outboxtest"
)

// TestWholePathThroughPgBouncerLeavesNoSessionState runs every part of the module through
// PgBouncer in transaction mode, with two server connections shared by all of them: the writer
// hook inside the host's delete transaction, two consumers (leases, acknowledgements, the
// sequencer, a retried event, a parked one and its replay, a reconciliation), the admin calls
// and a retention sweep. Only the LISTEN connection goes to PostgreSQL directly (ListenDSN).
// Then it holds both server connections at once and checks that nothing was left on them: no
// prepared statement, no LISTEN, no advisory lock, no temporary table, no session setting.
func TestWholePathThroughPgBouncerLeavesNoSessionState(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	projects := []string{"alpha", "beta"}
	cfg := outbox.Config{PollInterval: 50 * time.Millisecond, LeaseTTL: 3 * time.Second, HeartbeatInterval: time.Second,
		NewCursor: outbox.NewCursorOldest, TransactionPooler: true, ListenDSN: db.URL + "&application_name=" + directListen,
		RetrySchedule: []time.Duration{10 * time.Millisecond, 20 * time.Millisecond}, MaxAttempts: 3,
		// The self-test's NOTIFY goes through a bouncer whose two server connections everything
		// shares: a loaded machine must not turn a slow notification into polling-only.
		ListenCheckTimeout: 10 * time.Second}
	writer := startPooledProcess(t, pgtest.NewPooledPool(t, db), testkit.ProcessOpts{Projects: projects, Config: cfg})
	for _, p := range projects {
		_, err := writer.Store.CreateMany(ctx, p, "t", 20)
		require.NoError(t, err)
	}

	engine := startPooledProcess(t, pgtest.NewPooledPool(t, db), testkit.ProcessOpts{ID: "engine", Projects: projects, Config: cfg, NoStart: true})
	var mu sync.Mutex
	failures := map[string]int{}
	fixed := false
	engine.Rec.SetFail(func(ev outbox.ObservedEvent) error {
		mu.Lock()
		defer mu.Unlock()
		switch {
		case ev.TaskID == "t-2" && failures[ev.EventID] < 2: // retried twice, then delivered
			failures[ev.EventID]++
			return testkit.ErrListener
		case ev.ProjectID == "alpha" && ev.TaskID == "t-4" && !fixed: // parked after three attempts
			failures[ev.EventID]++
			return testkit.ErrListener
		}
		return nil
	})
	engine.Start(t)
	waitWakeups(t, ctx, engine.Consumer, outbox.WakeupsWorking)
	for i := 1; i <= 10; i++ {
		for _, p := range projects {
			_, err := writer.Store.Delete(ctx, p, fmt.Sprintf("t-%d", i))
			require.NoError(t, err)
		}
	}
	for _, p := range projects {
		testkit.WaitCursor(t, ctx, writer.Pool, p, "engine", 10)
	}
	require.Equal(t, "dead", testkit.DeliveryOf(t, writer.Pool, "engine", 4).State)
	require.Equal(t, 1, pgtest.QueryInt(t, writer.Pool, `SELECT count(*) FROM run_audit WHERE action = $1`, outbox.AuditConsumerPoisoned))

	// A consumer that starts late reconciles from the live tasks instead of replaying.
	late := cfg
	late.NewCursor = outbox.NewCursorReconcile
	dashboard := startPooledProcess(t, pgtest.NewPooledPool(t, db), testkit.ProcessOpts{ID: "dashboard", Projects: projects, Config: late})
	for _, p := range projects {
		testkit.WaitCursor(t, ctx, writer.Pool, p, "dashboard", 10)
		require.Len(t, dashboard.Store.Cache().Live(p), 10, "the live set came from the reconciliation")
	}
	require.Equal(t, 2, pgtest.QueryInt(t, writer.Pool, `SELECT count(*) FROM lifecycle_consumer_cursors WHERE reconcile_reason IS NOT NULL`))
	for i := 11; i <= 20; i++ {
		for _, p := range projects {
			_, err := writer.Store.Delete(ctx, p, fmt.Sprintf("t-%d", i))
			require.NoError(t, err)
		}
	}

	// The operator replays the parked event once the listener is fixed, through the pooler too.
	mu.Lock()
	fixed = true
	mu.Unlock()
	admin := outbox.NewAdmin(writer.Pool, outbox.AdminOptions{Audit: writer.Store})
	_, err := admin.RequestReplay(ctx, outbox.ReplayRequest{ProjectID: "alpha", ConsumerID: "engine", Sequence: 4,
		Operator: outbox.Operator{Actor: "oncall", Reason: "FN-17"}})
	require.NoError(t, err)
	for _, c := range []string{"engine", "dashboard"} {
		for _, p := range projects {
			testkit.WaitCursor(t, ctx, writer.Pool, p, c, 20)
		}
	}
	require.Eventually(t, func() bool { return testkit.DeliveryOf(t, writer.Pool, "engine", 4).State == "resolved" }, testkit.WaitLimit, 10*time.Millisecond)
	status, err := admin.Status(ctx, outbox.StatusFilter{})
	require.NoError(t, err)
	require.Len(t, status, 4)

	got := map[string]int{}
	attempts := map[string]int{}
	for _, ev := range engine.Rec.Snapshot() {
		got[ev.EventID]++
		attempts[ev.EventID] = max(attempts[ev.EventID], ev.Attempt)
	}
	require.Len(t, got, 40, "every deletion reached the engine")
	retried, replayed := 0, 0
	for id, n := range attempts {
		switch {
		case strings.Contains(id, ":t-2:"):
			require.Equal(t, 3, n, "%s: two failures, then the third attempt", id)
			retried++
		case strings.HasPrefix(id, "task-deleted:t-4:") && got[id] == 1 && n == 4:
			replayed++ // alpha's t-4: three failed attempts, then the replay
		}
	}
	require.Equal(t, 2, retried)
	require.Equal(t, 1, replayed)
	require.Len(t, dashboard.Rec.Snapshot(), 20, "the late consumer got what came after its reconciliation")

	// Retention, with a clock a year ahead so that every acknowledged row is old enough.
	clock := outboxtest.NewFakeClock()
	clock.Advance(365 * 24 * time.Hour)
	rcfg := cfg
	rcfg.Clock = clock
	retention, err := outbox.NewRetention(writer.Pool, rcfg, nil, nil)
	require.NoError(t, err)
	res, err := retention.Sweep(ctx)
	require.NoError(t, err)
	require.Equal(t, int64(40), res.Pruned())

	engine.Stop(t)
	dashboard.Stop(t)
	require.NoError(t, writer.Writer.Close(ctx))
	requireNoSessionState(t, db)
}

// requireSessionStateOnDedicatedConn checks that every function of a file that LISTENs or takes
// a session advisory lock runs it on a connection of dedicatedConn's, and that there is one.
func requireSessionStateOnDedicatedConn(t *testing.T, name, src string) {
	t.Helper()
	file, err := parser.ParseFile(token.NewFileSet(), name, src, 0)
	require.NoError(t, err)
	session := regexp.MustCompile(`(?i)"(UN)?LISTEN |pg_(try_)?advisory_lock(_shared)?\(`)
	found := 0
	for _, d := range file.Decls {
		fn, ok := d.(*ast.FuncDecl)
		if !ok || fn.Body == nil {
			continue
		}
		body := src[fn.Body.Pos()-file.FileStart : fn.Body.End()-file.FileStart]
		if !session.MatchString(body) {
			continue
		}
		found++
		require.Regexp(t, `conn, err := dedicatedConn\(`, body, "%s: %s keeps session state on a connection that is not its own", name, fn.Name.Name)
		require.NotRegexp(t, `\.pool\.(Exec|Query|QueryRow)\(`, body, "%s: %s also uses the pool", name, fn.Name.Name)
	}
	require.Positive(t, found, "%s: the election's session state was not found", name)
}

// directListen names the LISTEN connections that go straight to PostgreSQL, so the session
// state check can tell them from the bouncer's server connections.
const directListen = "direct-listen"

// TestSessionStateCheckSeesALeak makes sure the check above can fail: a plain SET through the
// bouncer stays on the server connection, and the check names it.
func TestSessionStateCheckSeesALeak(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	pool := pgtest.NewPooledPool(t, db)
	_, err := pool.Exec(ctx, `SET statement_timeout = '1234s'`)
	require.NoError(t, err)
	leaks := sessionState(t, db)
	require.NotEmpty(t, leaks)
	require.Contains(t, strings.Join(leaks, "\n"), "statement_timeout")
}

// requireNoSessionState fails t when a server connection of db behind the bouncer carries
// session state.
func requireNoSessionState(t *testing.T, db pgtest.DB) {
	t.Helper()
	require.Empty(t, sessionState(t, db), "session state left on PgBouncer's server connections")
}

// trackedByBouncer are the parameters PgBouncer itself sets on a server connection to match
// the client it hands it to.
var trackedByBouncer = []string{"client_encoding", "DateStyle", "TimeZone", "standard_conforming_strings", "application_name"}

const sessionStateSQL = `
SELECT pg_backend_pid(),
       (SELECT count(*) FROM pg_prepared_statements),
       (SELECT count(*) FROM pg_listening_channels()),
       (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()),
       (SELECT count(*) FROM pg_class WHERE relnamespace = pg_my_temp_schema()),
       coalesce((SELECT string_agg(name, ',' ORDER BY name) FROM pg_settings WHERE source = 'session' AND NOT (name = ANY ($1))), '')`

// sessionState holds every server connection the bouncer has for db at once (one client
// transaction each: in transaction mode each gets its own) and lists what state it carries.
// It also checks that the connections it inspected are all the server connections there are.
func sessionState(t *testing.T, db pgtest.DB) []string {
	t.Helper()
	ctx := testkit.Ctx(t)
	url := pgtest.PooledURL(t, db)
	var leaks []string
	var pids []int32
	var txs []pgx.Tx
	for range pgtest.BouncerDefaultPoolSize {
		conn, err := pgx.Connect(ctx, url)
		require.NoError(t, err)
		defer conn.Close(ctx)
		tx, err := conn.Begin(ctx) // holds its server connection until the end of the check
		require.NoError(t, err)
		txs = append(txs, tx)
		var pid int32
		var prepared, listening, advisory, temp int
		var settings string
		require.NoError(t, tx.QueryRow(ctx, sessionStateSQL, trackedByBouncer).Scan(&pid, &prepared, &listening, &advisory, &temp, &settings))
		pids = append(pids, pid)
		for what, n := range map[string]int{"prepared statements": prepared, "LISTEN channels": listening, "advisory locks": advisory, "temporary tables": temp} {
			if n > 0 {
				leaks = append(leaks, fmt.Sprintf("server connection %d: %d %s", pid, n, what))
			}
		}
		if settings != "" {
			leaks = append(leaks, fmt.Sprintf("server connection %d: session settings %s", pid, settings))
		}
	}
	direct := pgtest.Pool(t, db.URL)
	rows, err := direct.Query(ctx, `SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()
		AND backend_type = 'client backend' AND application_name <> $1`, directListen)
	require.NoError(t, err)
	all, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	require.NoError(t, err)
	for _, pid := range all {
		require.True(t, slices.Contains(pids, pid), "backend %d of the test database was not inspected (inspected %v)", pid, pids)
	}
	for _, tx := range txs {
		_ = tx.Rollback(ctx)
	}
	return leaks
}

// TestNoSessionStateInTheSource is the static half of the audit: no statement the module runs
// sets a session-level setting, takes a session advisory lock, creates a temporary table or
// prepares a named statement, and only the listen files LISTEN. The ticker's election (a
// session advisory lock, and LISTEN for the writers' hints) and the process's shared LISTEN
// (listen_hub.go) are the exception: each runs only on a dedicated connection, which never
// goes back to the pool.
func TestNoSessionStateInTheSource(t *testing.T) {
	t.Parallel()
	testkit.RequireNoSessionState(t, outbox.Statements, func(name string, s testkit.SessionState) bool {
		return name == "tickerLockSQL" && s == testkit.SessionLock // the election's lock: the exception above
	})
	require.Regexp(t, testkit.SessionLock.Re, outbox.Statements["tickerLockSQL"], "the election takes a session lock")
	// Outside the SQL constants: LISTEN only in the listen files, and no .Prepare call.
	for _, name := range testkit.GoFiles(t) {
		listens := name == "listen.go" || name == "listen_selftest.go"
		if name == "ticker.go" || name == "listen_hub.go" {
			requireSessionStateOnDedicatedConn(t, name, testkit.RequireNoSessionStateInSource(t, name, true, true))
			continue
		}
		testkit.RequireNoSessionStateInSource(t, name, listens, false)
	}
	for _, m := range outbox.Migrations() {
		require.NotRegexp(t, testkit.SessionLock.Re, m.SQL, "migration %d", m.Version)
	}
}

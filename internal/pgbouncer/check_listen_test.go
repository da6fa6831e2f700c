package pgbouncer_test

import (
	"context"
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"fusion/outbox/internal/pgbouncer"
	"fusion/outbox/internal/pgcluster"
)

// TestServerCheckIsEndedByAStrayNotification is the cause of the runbook's open finding ("a
// server check that never finished"), played deterministically on PgBouncer 1.18 with one
// server connection.
//
// A LISTEN sent through a transaction-pooling bouncer stays registered on the server
// connection that ran it. PgBouncer's server check (launch_recheck) sends server_check_query
// without marking the server busy, and a NotificationResponse keeps the server's "ready" flag
// as it was. So a notification that reaches the bouncer after the check was sent and before
// its reply ends the check at once: the server is handed to the waiting client while the
// check's reply is still on its way, the client reads that reply ("1") as the answer to its
// own statement, and its real answer is dropped. From then on the server's replies can be out
// of step with its clients; when the reply that ends a later check is a transaction's
// (ReadyForQuery "in transaction"), the check never completes, the server stays "tested", and
// PgBouncer keeps a waiting client waiting while a server is being tested.
//
// The interleaving is forced: the listening backend is stopped (SIGSTOP) while a NOTIFY
// commits and while the bouncer sends its check; when it continues it sends the pending
// notification before it reads the check, and the check (checkQuery) takes long enough for
// the bouncer to read the notification alone.
// checkQuery is PgBouncer's default check ("select 1") made to take a moment, so that the
// notification the backend sends before it reads the check and the check's reply reach the
// bouncer in two reads, as they do when the notification commits just as the check is sent.
const checkQuery = "select 1 from pg_sleep(0.05)"

func TestServerCheckIsEndedByAStrayNotification(t *testing.T) {
	r := startStrayListen(t)
	const attempts = 5
	wrong := 0
	for i := 1; i <= attempts; i++ {
		want := 1000 + i
		var answer int
		r.duringCheck(func() error { return r.client.QueryRow(r.ctx, fmt.Sprintf("SELECT %d", want)).Scan(&answer) })
		if answer != want {
			wrong++
			t.Logf("attempt %d: SELECT %d was answered %d: a reply that was not its own", i, want, answer)
		}
	}
	t.Logf("%d of %d statements were answered with a reply that was not theirs", wrong, attempts)
	require.Positive(t, wrong, "a notification during the server check did not end the check early: "+
		"this PgBouncer does not show the cause the runbook gives for the stalled check")
}

// TestServerCheckNeverFinishesAfterAStrayNotification plays the stall itself. The statement
// that gets the server early opens a transaction, and its reply comes after the check's: the
// bouncer hands the server back to its pool on the check's ReadyForQuery with the
// transaction's reply still unread. The next check reads that reply, whose ReadyForQuery says
// "in transaction", as its own, and then its own reply, also "in transaction": neither makes
// the server ready, so the check never finishes. The server stays "tested", its backend idle in
// transaction, and the next client waits until its deadline: what the runbook's finding saw.
func TestServerCheckNeverFinishesAfterAStrayNotification(t *testing.T) {
	r := startStrayListen(t)
	// A transaction's opening that takes a moment, as a host's BEGIN followed by its first
	// statements does, so that its reply reaches the bouncer after the check's.
	r.duringCheck(func() error { _, err := r.client.Exec(r.ctx, "SELECT pg_sleep(0.05); BEGIN"); return err })

	ctx, cancel := context.WithTimeout(r.ctx, 3*time.Second)
	defer cancel()
	var n int
	err := r.client.QueryRow(ctx, "SELECT 7").Scan(&n)
	states, serr := r.b.ServerStates(r.ctx, "postgres")
	require.NoError(t, serr)
	var backend string
	require.NoError(t, r.direct.QueryRow(r.ctx, "SELECT state FROM pg_stat_activity WHERE pid = $1", r.pid).Scan(&backend))
	t.Logf("next statement: %v; the bouncer's server: %s; its backend: %s", err, states[r.pid], backend)
	require.ErrorIs(t, err, context.DeadlineExceeded, "the next statement waits for a server until its deadline (answered %d)", n)
	require.Equal(t, "tested", states[r.pid], "the check never finished")
	require.Equal(t, "idle in transaction", backend)
}

// strayListen is a cluster, a bouncer with one server connection that checks every reuse,
// a LISTEN left on that server connection, a direct connection and a pooled client.
type strayListen struct {
	t      *testing.T
	ctx    context.Context
	b      *pgbouncer.Bouncer
	pid    int // the server connection's backend
	direct *pgx.Conn
	client *pgx.Conn
}

func startStrayListen(t *testing.T) *strayListen {
	for _, find := range []func() (string, error){pgbouncer.FindBinary, pgcluster.FindBinDir} {
		if _, err := find(); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("CI=true: %v", err)
			}
			t.Skip(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	c, err := pgcluster.Start(ctx, pgcluster.Options{})
	require.NoError(t, err)
	t.Cleanup(c.Stop)
	b, err := pgbouncer.Start(ctx, pgbouncer.Options{ServerSocketDir: c.SocketDir(), ServerPort: 5432, DefaultPoolSize: 1,
		CheckEveryReuse: true, CheckQuery: checkQuery})
	require.NoError(t, err)
	t.Cleanup(b.Stop)
	pooled := b.DSN("postgres", "postgres") + " default_query_exec_mode=exec"
	connect := func(dsn string) *pgx.Conn {
		conn, err := pgx.Connect(ctx, dsn)
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close(context.Background()) })
		return conn
	}
	r := &strayListen{t: t, ctx: ctx, b: b}
	// The listener: its LISTEN stays on the pool's only server connection.
	listener := connect(pooled)
	_, err = listener.Exec(ctx, "LISTEN stray")
	require.NoError(t, err)
	require.NoError(t, listener.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&r.pid))
	r.direct = connect(c.DSN("postgres"))
	r.client = connect(pooled)
	return r
}

// waitState waits until the bouncer shows its server connection in the given state.
func (r *strayListen) waitState(want string) {
	r.t.Helper()
	for {
		states, err := r.b.ServerStates(r.ctx, "postgres")
		require.NoError(r.t, err)
		if states[r.pid] == want {
			return
		}
		require.Len(r.t, states, 1, "one server connection, the listener's: %v", states)
		select {
		case <-r.ctx.Done():
			r.t.Fatalf("the server never was %q: %v%s", want, states, r.b.LogTail())
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// duringCheck runs statement on the client so that the server connection it needs is being
// checked when a notification reaches it: the backend is stopped, a NOTIFY commits, the
// statement makes the bouncer send its check, and the backend continues.
func (r *strayListen) duringCheck(statement func() error) {
	r.t.Helper()
	r.waitState("used") // released after its last client; its next reuse is checked
	require.NoError(r.t, syscall.Kill(r.pid, syscall.SIGSTOP))
	defer func() { _ = syscall.Kill(r.pid, syscall.SIGCONT) }() // also when the test fails
	_, err := r.direct.Exec(r.ctx, "NOTIFY stray")
	require.NoError(r.t, err)
	done := make(chan error, 1)
	go func() { done <- statement() }()
	r.waitState("tested") // the check is sent; the stopped backend has not read it
	require.NoError(r.t, syscall.Kill(r.pid, syscall.SIGCONT))
	require.NoError(r.t, <-done)
}

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
	for _, find := range []func() (string, error){pgbouncer.FindBinary, pgcluster.FindBinDir} {
		if _, err := find(); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("CI=true: %v", err)
			}
			t.Skip(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := pgcluster.Start(ctx, pgcluster.Options{})
	require.NoError(t, err)
	defer c.Stop()
	b, err := pgbouncer.Start(ctx, pgbouncer.Options{ServerSocketDir: c.SocketDir(), ServerPort: 5432, DefaultPoolSize: 1,
		CheckEveryReuse: true, CheckQuery: checkQuery})
	require.NoError(t, err)
	defer b.Stop()
	pooled := b.DSN("postgres", "postgres") + " default_query_exec_mode=exec"

	// The listener: its LISTEN stays on the pool's only server connection.
	listener, err := pgx.Connect(ctx, pooled)
	require.NoError(t, err)
	defer listener.Close(ctx)
	_, err = listener.Exec(ctx, "LISTEN stray")
	require.NoError(t, err)
	var pid int
	require.NoError(t, listener.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid))

	direct, err := pgx.Connect(ctx, c.DSN("postgres"))
	require.NoError(t, err)
	defer direct.Close(ctx)
	client, err := pgx.Connect(ctx, pooled)
	require.NoError(t, err)
	defer client.Close(ctx)

	waitState := func(want string) {
		t.Helper()
		for {
			states, err := b.ServerStates(ctx, "postgres")
			require.NoError(t, err)
			if states[pid] == want {
				return
			}
			require.Len(t, states, 1, "one server connection, the listener's: %v", states)
			select {
			case <-ctx.Done():
				t.Fatalf("the server never was %q: %v%s", want, states, b.LogTail())
			case <-time.After(5 * time.Millisecond):
			}
		}
	}
	stopped := false
	defer func() {
		if stopped {
			_ = syscall.Kill(pid, syscall.SIGCONT)
		}
	}()

	const attempts = 5
	wrong := 0
	for i := 1; i <= attempts; i++ {
		waitState("used") // released after its last client; its next reuse is checked
		require.NoError(t, syscall.Kill(pid, syscall.SIGSTOP))
		stopped = true
		_, err := direct.Exec(ctx, "NOTIFY stray")
		require.NoError(t, err)
		want := 1000 + i
		got := make(chan error, 1)
		var answer int
		go func() { got <- client.QueryRow(ctx, fmt.Sprintf("SELECT %d", want)).Scan(&answer) }()
		waitState("tested") // the check is sent; the stopped backend has not read it
		require.NoError(t, syscall.Kill(pid, syscall.SIGCONT))
		stopped = false
		require.NoError(t, <-got)
		if answer != want {
			wrong++
			t.Logf("attempt %d: SELECT %d was answered %d: a reply that was not its own", i, want, answer)
		}
	}
	t.Logf("%d of %d statements were answered with a reply that was not theirs", wrong, attempts)
	require.Positive(t, wrong, "a notification during the server check did not end the check early: "+
		"this PgBouncer does not show the cause the runbook gives for the stalled check")
}

package pgbouncer_test

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"fusion/outbox/internal/pgbouncer"
	"fusion/outbox/internal/pgcluster"
)

// TestBouncerForwardsTransactionsAndAddsUsers starts a cluster and a bouncer in front of it,
// runs transactions through it, and adds a role to the auth file of the running bouncer.
func TestBouncerForwardsTransactionsAndAddsUsers(t *testing.T) {
	if _, err := pgbouncer.FindBinary(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI=true: %v", err)
		}
		t.Skip(err)
	}
	if _, err := pgcluster.FindBinDir(); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI=true: %v", err)
		}
		t.Skip(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := pgcluster.Start(ctx, pgcluster.Options{})
	require.NoError(t, err)
	defer c.Stop()
	b, err := pgbouncer.Start(ctx, pgbouncer.Options{ServerSocketDir: c.SocketDir(), ServerPort: 5432, DefaultPoolSize: 1})
	require.NoError(t, err)
	defer b.Stop()

	conn, err := pgx.Connect(ctx, b.DSN("postgres", "postgres")+" default_query_exec_mode=exec")
	require.NoError(t, err, b.LogTail())
	defer conn.Close(ctx)
	var one int
	require.NoError(t, conn.QueryRow(ctx, "SELECT $1::int", 1).Scan(&one))
	require.Equal(t, 1, one)

	_, err = conn.Exec(ctx, `CREATE ROLE bouncer_guest LOGIN`)
	require.NoError(t, err)
	_, err = pgx.Connect(ctx, b.DSN("bouncer_guest", "postgres"))
	require.Error(t, err, "a user not in the auth file is refused")
	require.NoError(t, b.AddUser("bouncer_guest"))
	guest, err := pgx.Connect(ctx, b.DSN("bouncer_guest", "postgres")+" default_query_exec_mode=exec")
	require.NoError(t, err, b.LogTail())
	defer guest.Close(ctx)
	var who string
	require.NoError(t, guest.QueryRow(ctx, "SELECT current_user").Scan(&who))
	require.Equal(t, "bouncer_guest", who)

	// The admin console's view, for a test to log while something waits on the bouncer.
	state := b.State(ctx)
	require.Contains(t, state, "SHOW POOLS:")
	require.Contains(t, state, "bouncer_guest", "the guest's pool and client are listed")
	require.NotContains(t, state, "pgbouncer state:", "the console answered")
}

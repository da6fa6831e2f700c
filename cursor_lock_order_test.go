package outbox_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
)

// TestCursorWritesLockInProjectOrder: a consumer's acknowledgement and its lease heartbeat
// write several of its cursor rows each, on two connections at once. Each took the rows in the
// order its arguments came (the order of a Go map), so the two could wait on each other: a
// deadlock, which PostgreSQL breaks only after deadlock_timeout (1s), and a second of lag for
// every event of that consumer (seen in the bench's sustained case with 8 consumers, lag p99
// 863 and 892ms). Every statement that writes several cursor rows now takes them in project
// order. Here another transaction holds the last project's row, and each statement is given
// the consumer's 16 projects last first: while it waits for that row, it must already hold the
// first project's, whatever plan the server picks.
func TestCursorWritesLockInProjectOrder(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	url := pgtest.NewDB(t).URL
	const id, owner = "c1", "c1@0123456789abcdef"
	var projects []string
	var epochs, seqs []int64
	for i := 15; i >= 0; i-- {
		projects, epochs, seqs = append(projects, fmt.Sprintf("p%02d", i)), append(epochs, 1), append(seqs, 5)
	}
	for _, c := range []struct {
		name   string
		leased bool // the rows are leased to owner; else free for acquiring
		args   []any
	}{
		{"ackSQL", true, []any{pgx.StrictNamedArgs{"consumer": id, "owner": owner, "projects": projects, "epochs": epochs,
			"sequences": seqs, "clock_offset": time.Duration(0)}}},
		{"renewSQL", true, []any{pgx.StrictNamedArgs{"consumer": id, "owner": owner, "projects": projects, "epochs": epochs,
			"lease_ttl": 30 * time.Second, "clock_offset": time.Duration(0)}}},
		{"releaseSQL", true, []any{id, owner, projects, epochs}},
		{"acquireSQL", false, []any{pgx.StrictNamedArgs{"consumer": id, "owner": owner, "projects": projects,
			"lease_ttl": 30 * time.Second, "clock_offset": time.Duration(0)}}},
		{"retireSQL", true, []any{pgx.StrictNamedArgs{"consumer": id, "project": "", "actor": "operator", "reason": "test",
			"clock_offset": time.Duration(0)}}},
	} {
		t.Run(c.name, func(t *testing.T) {
			conns := make([]*pgx.Conn, 3)
			for i := range conns {
				conn, err := pgx.Connect(ctx, url)
				require.NoError(t, err)
				t.Cleanup(func() { conn.Close(context.Background()) })
				conns[i] = conn
			}
			holder, writer, probe := conns[0], conns[1], conns[2]
			_, err := holder.Exec(ctx, `DELETE FROM lifecycle_consumer_cursors WHERE consumer_id = $1`, id)
			require.NoError(t, err)
			leaseOwner := any(nil)
			if c.leased {
				leaseOwner = owner
			}
			_, err = holder.Exec(ctx, `INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id, lease_owner, lease_epoch, lease_expires_at)
				SELECT p, $1, $2::text, 1, CASE WHEN $2::text IS NULL THEN NULL ELSE now() + interval '1 hour' END FROM unnest($3::text[]) AS p`, id, leaseOwner, projects)
			require.NoError(t, err)

			tx, err := holder.Begin(ctx)
			require.NoError(t, err)
			_, err = tx.Exec(ctx, `SELECT 1 FROM lifecycle_consumer_cursors WHERE consumer_id = $1 AND project_id = 'p15' FOR NO KEY UPDATE`, id)
			require.NoError(t, err)

			// The plan a server's statistics may pick for a few rows: a sequential scan, which
			// meets the rows in the order they were inserted (the last project first). A
			// statement that relies on an index's order to take them in project order does not.
			_, err = writer.Exec(ctx, `SET enable_indexscan = off; SET enable_bitmapscan = off; SET enable_indexonlyscan = off`)
			require.NoError(t, err)
			writerPID := writer.PgConn().PID()
			done, finished := make(chan error, 1), make(chan struct{})
			go func() {
				defer close(finished)
				rows, err := writer.Query(ctx, outbox.Statements[c.name], c.args...)
				if err == nil {
					rows.Close()
					err = rows.Err()
				}
				done <- err
			}()
			// Registered after the connections' own clean-ups, so it runs before them: a failed
			// check lets the statement go and waits for it, and no connection closes under it.
			t.Cleanup(func() {
				_ = tx.Rollback(context.Background())
				<-finished
			})
			// Until the statement waits for the held row: blocked by the holder, not by anything
			// else a busy server may make it wait for a moment.
			holderPID := holder.PgConn().PID()
			require.Eventually(t, func() bool {
				var waiting bool
				err := probe.QueryRow(ctx, `SELECT $2::int = ANY (pg_catalog.pg_blocking_pids($1))`, writerPID, holderPID).Scan(&waiting)
				return err == nil && waiting
			}, testkit.WaitLimit, 5*time.Millisecond, "the statement never waited for the held row")

			_, err = probe.Exec(ctx, `SELECT 1 FROM lifecycle_consumer_cursors WHERE consumer_id = $1 AND project_id = 'p00' FOR NO KEY UPDATE NOWAIT`, id)
			var pgErr *pgconn.PgError
			require.True(t, errors.As(err, &pgErr) && pgErr.Code == pgerrcode.LockNotAvailable,
				"row p00 was not locked while the statement waited for p15: it takes rows out of project order (got %v)", err)

			require.NoError(t, tx.Rollback(ctx))
			require.NoError(t, <-done)
		})
	}
}

package pgtest

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"fusion/outbox/internal/pgbouncer"
)

// The PgBouncer part of the harness: one real PgBouncer per test binary, in transaction
// pooling mode, in front of the throwaway cluster. It starts on first use and stops with the
// cluster when the binary's tests end (and, like the cluster, is reaped if the binary dies).

// Bouncer limits. MaxClientConn is small enough that a module which opened connections
// without bound would be refused; DefaultPoolSize is eight server connections per database and
// role, fewer than the clients of one test (two pools of four, a LISTEN connection, an admin
// pool), so clients share them and session state one client left behind would reach the next.
// With two, tests through the bouncer stalled in about half the full runs on the 2-core
// machine (a consumer whose statements waited for a server connection until its deadline);
// with five, in about one in three clean CI runs once consumers scanned more often. The cause
// was a LISTEN left on a server connection by a consumer whose LISTEN went through the bouncer,
// which PgBouncer's server check cannot cope with (the runbook's pooler section); consumers
// with TransactionPooler no longer LISTEN through it.
const (
	BouncerMaxClientConn   = 60
	BouncerDefaultPoolSize = 8
	// PooledMaxConns is the pool size of NewPooledPool: what a host behind a pooler would give
	// one process.
	PooledMaxConns = 4
)

var (
	bouncerOnce sync.Once
	bouncer     *pgbouncer.Bouncer
	bouncerErr  error
)

// startBouncer starts the binary's bouncer in front of the throwaway cluster.
func startBouncer() (*pgbouncer.Bouncer, error) {
	bouncerOnce.Do(func() {
		if srv.cluster == nil {
			bouncerErr = fmt.Errorf("the PgBouncer tests need the throwaway cluster (this run uses %s)", srv.kind)
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		opts := pgbouncer.Options{
			ServerSocketDir: srv.cluster.SocketDir(), ServerPort: 5432, PoolMode: "transaction",
			MaxClientConn: BouncerMaxClientConn, DefaultPoolSize: BouncerDefaultPoolSize,
		}
		// For experiments only (the runbook's pooler section): a smaller pool, and a server
		// check on every reuse. Tests that hold every server connection at once assume the
		// default size.
		if n, err := strconv.Atoi(os.Getenv("OUTBOX_TEST_BOUNCER_POOL_SIZE")); err == nil && n > 0 {
			opts.DefaultPoolSize = n
		}
		opts.CheckEveryReuse = os.Getenv("OUTBOX_TEST_BOUNCER_CHECK_EVERY_REUSE") == "1"
		bouncer, bouncerErr = pgbouncer.Start(ctx, opts)
	})
	return bouncer, bouncerErr
}

// stopBouncer runs when the binary's tests end.
func stopBouncer() {
	if bouncer != nil {
		bouncer.Stop()
	}
}

// Bouncer returns the binary's PgBouncer, starting it on first use. Without one (PgBouncer not
// installed, or no throwaway cluster) the test fails under CI=true and is skipped otherwise.
func Bouncer(t testing.TB) *pgbouncer.Bouncer {
	t.Helper()
	skipOrFail(t)
	b, err := startBouncer()
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("pgtest: CI=true and no PgBouncer: %v", err)
		}
		t.Skipf("pgtest: no PgBouncer (make deps installs it): %v", err)
	}
	return b
}

// PooledURL is db's superuser connection string through the bouncer, with the one pgx
// execution mode that is safe behind a transaction pooler: default_query_exec_mode=exec
// (see outbox.CheckPoolerSafe).
func PooledURL(t testing.TB, db DB) string {
	t.Helper()
	return Bouncer(t).URL("postgres", db.Name) + "&default_query_exec_mode=exec"
}

// PooledURLAs is PooledURL for another role, which it first lists in the bouncer's auth file.
func PooledURLAs(t testing.TB, db DB, role string) string {
	t.Helper()
	b := Bouncer(t)
	if err := b.AddUser(role); err != nil {
		t.Fatalf("pgtest: add %s to the bouncer: %v", role, err)
	}
	return b.URL(role, db.Name) + "&default_query_exec_mode=exec"
}

// NewPooledPool opens a pool on db through the bouncer (PooledMaxConns connections at most),
// closed when t ends.
func NewPooledPool(t testing.TB, db DB) *pgxpool.Pool {
	t.Helper()
	return PooledPool(t, PooledURL(t, db))
}

// PooledPool opens a pool of PooledMaxConns connections on url, closed when t ends.
func PooledPool(t testing.TB, url string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("pgtest: parse %s: %v", url, err)
	}
	cfg.MaxConns = PooledMaxConns
	return PoolConfig(t, cfg)
}

// Package pgtest gives each test a real, empty, migrated PostgreSQL database.
//
// The server comes from, in order: TEST_DATABASE_URL; a throwaway cluster started from the
// installed initdb/pg_ctl (one per test binary, from TestMain); a postgres:15 container when a
// Docker engine answers a ping. With none of these, tests fail when CI=true and skip
// otherwise. Each test gets its own database, created from a template that already holds the
// outbox module's and the reference host's schemas, so a new database takes milliseconds.
//
// Bouncer (bouncer.go) puts one real PgBouncer, in transaction pooling mode, in front of the
// throwaway cluster for the tests that must show the module works behind a pooler.
//
// StartPair (standby.go) starts a primary of its own and a streaming hot standby of it, for the
// tests of reading from a standby; they can pause its replay, kill it and promote it.
package pgtest

import (
	"context"
	"errors"
	"fmt"
	neturl "net/url"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"fusion/outbox"
	"fusion/outbox/example/taskstore/schema"
	"fusion/outbox/internal/pgcluster"
)

// server is where test databases are created.
type server struct {
	adminURL string             // superuser (or CREATEDB role) on a maintenance database
	cluster  *pgcluster.Cluster // set in throwaway-cluster mode
	kind     string             // "TEST_DATABASE_URL", "cluster" or "docker"
	template string
	close    func()
}

var (
	srv        *server
	unavailble string // why no server could be had
	dbCounter  atomic.Int64
	createMu   sync.Mutex
)

// Main starts the database server for a test binary, runs the tests, checks for leaked
// goroutines, and tears the server down even when tests fail. Call it from TestMain.
func Main(m *testing.M) {
	os.Exit(run(m))
}

func run(m *testing.M) int {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	s, err := start(ctx)
	cancel()
	if err != nil {
		if os.Getenv("CI") == "true" {
			fmt.Fprintf(os.Stderr, "pgtest: CI=true and no PostgreSQL is available: %v\n", err)
			return 1
		}
		unavailble = err.Error()
	}
	srv = s
	code := m.Run()
	stopBouncer() // before the server it points at
	if srv != nil {
		srv.close()
	}
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreCurrent()); err != nil {
			fmt.Fprintf(os.Stderr, "pgtest: leaked goroutines: %v\n", err)
			return 1
		}
	}
	return code
}

func start(ctx context.Context) (*server, error) {
	var s *server
	var reasons []string
	if url := os.Getenv("TEST_DATABASE_URL"); url != "" {
		if _, err := pgx.ParseConfig(url); err != nil {
			return nil, fmt.Errorf("TEST_DATABASE_URL does not parse: %w", err)
		}
		s = &server{adminURL: url, kind: "TEST_DATABASE_URL", close: func() {}}
	} else if c, err := pgcluster.Start(ctx, pgcluster.Options{}); err == nil {
		s = &server{adminURL: c.URL("postgres"), cluster: c, kind: "cluster", close: c.Stop}
	} else {
		reasons = append(reasons, "throwaway cluster: "+err.Error())
		d, err := startDocker(ctx)
		if err != nil {
			reasons = append(reasons, "docker: "+err.Error())
			return nil, errors.New(strings.Join(reasons, "; "))
		}
		s = d
	}
	s.template = fmt.Sprintf("outbox_template_%d", os.Getpid())
	if err := s.buildTemplate(ctx); err != nil {
		s.close()
		return nil, fmt.Errorf("build template database on %s: %w", s.kind, err)
	}
	inner := s.close
	s.close = func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if s.cluster == nil {
			_ = s.exec(ctx, `ALTER DATABASE `+pgx.Identifier{s.template}.Sanitize()+` IS_TEMPLATE false`)
			_ = s.exec(ctx, `DROP DATABASE IF EXISTS `+pgx.Identifier{s.template}.Sanitize()+` WITH (FORCE)`)
		}
		inner()
	}
	return s, nil
}

func (s *server) exec(ctx context.Context, sql string) error {
	conn, err := pgx.Connect(ctx, s.adminURL)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	_, err = conn.Exec(ctx, sql)
	return err
}

func (s *server) buildTemplate(ctx context.Context) error {
	if err := s.exec(ctx, `CREATE DATABASE `+pgx.Identifier{s.template}.Sanitize()); err != nil {
		return err
	}
	url, err := withDatabase(s.adminURL, s.template)
	if err != nil {
		return err
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if _, err := outbox.Migrate(ctx, conn); err != nil {
		return err
	}
	if err := schema.Migrate(ctx, conn); err != nil {
		return err
	}
	return nil
}

// withDatabase returns url pointing at another database, in the syntax url uses.
func withDatabase(url, database string) (string, error) {
	if _, err := pgx.ParseConfig(url); err != nil {
		return "", err
	}
	if strings.HasPrefix(url, "postgres://") || strings.HasPrefix(url, "postgresql://") {
		u, err := neturl.Parse(url)
		if err != nil {
			return "", err
		}
		u.Path = "/" + database
		return u.String(), nil
	}
	return url + " dbname=" + database, nil // the last setting wins
}

// DB is one test's database.
type DB struct {
	Name string
	URL  string // superuser connection string for this database
}

// skipOrFail ends the test when no server is available.
func skipOrFail(t testing.TB) {
	t.Helper()
	if srv != nil {
		return
	}
	if unavailble == "" {
		t.Fatal("pgtest: no server; is TestMain calling pgtest.Main?")
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("pgtest: CI=true and no PostgreSQL is available: %s", unavailble)
	}
	t.Skipf("pgtest: no PostgreSQL available (set TEST_DATABASE_URL, install the server binaries, or run a Docker engine): %s", unavailble)
}

// NewDB creates a fresh migrated database for t and drops it when t ends.
func NewDB(t testing.TB) DB {
	t.Helper()
	skipOrFail(t)
	return newDB(t, srv.template)
}

// NewEmptyDB creates a database with no schema at all, for migration tests.
func NewEmptyDB(t testing.TB) DB {
	t.Helper()
	skipOrFail(t)
	return newDB(t, "template0")
}

func newDB(t testing.TB, template string) DB {
	t.Helper()
	db, drop, err := createDB(template)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Cleanup(func() {
		if err := drop(); err != nil {
			t.Logf("pgtest: %v", err)
		}
	})
	return db
}

// ExampleDB creates a fresh migrated database for a runnable example, which has no testing.T
// to skip or clean up with: it returns the database and a function that drops it. With no
// server it returns an error (under CI=true, Main has failed the binary already).
func ExampleDB() (DB, func() error, error) {
	if srv == nil {
		if unavailble == "" {
			return DB{}, nil, errors.New("pgtest: no server; is TestMain calling pgtest.Main?")
		}
		return DB{}, nil, fmt.Errorf("pgtest: no PostgreSQL available: %s", unavailble)
	}
	return createDB(srv.template)
}

func createDB(template string) (DB, func() error, error) {
	return srv.createDB(template)
}

func (srv *server) createDB(template string) (DB, func() error, error) {
	name := fmt.Sprintf("t%d_%d", os.Getpid(), dbCounter.Add(1))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	createMu.Lock()
	err := srv.exec(ctx, `CREATE DATABASE `+pgx.Identifier{name}.Sanitize()+` TEMPLATE `+pgx.Identifier{template}.Sanitize())
	createMu.Unlock()
	if err != nil {
		return DB{}, nil, fmt.Errorf("create database: %w", err)
	}
	url, err := withDatabase(srv.adminURL, name)
	if err != nil {
		return DB{}, nil, err
	}
	drop := func() error {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := srv.exec(ctx, `DROP DATABASE IF EXISTS `+pgx.Identifier{name}.Sanitize()+` WITH (FORCE)`); err != nil {
			return fmt.Errorf("drop database %s: %w", name, err)
		}
		return nil
	}
	return DB{Name: name, URL: url}, drop, nil
}

// NewPool creates a fresh migrated database and returns a pool on it, closed when t ends.
func NewPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return Pool(t, NewDB(t).URL)
}

// Pool opens another pool on url (one per simulated process) and closes it when t ends.
func Pool(t testing.TB, url string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatalf("pgtest: parse %s: %v", url, err)
	}
	// Tests hold many transactions open at once on purpose; the default of four would deadlock.
	cfg.MaxConns = 32
	return PoolConfig(t, cfg)
}

// PoolConfig opens a pool with cfg and closes it when t ends.
func PoolConfig(t testing.TB, cfg *pgxpool.Config) *pgxpool.Pool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // a failure bound: generous for a busy machine
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatalf("pgtest: open pool: %v", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		t.Fatalf("pgtest: ping: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// AdminURL is the superuser connection string on the server's maintenance database.
func AdminURL(t testing.TB) string {
	t.Helper()
	skipOrFail(t)
	return srv.adminURL
}

// Cluster returns the throwaway cluster, or nil when tests run on TEST_DATABASE_URL or Docker
// (where, for example, the server cannot be restarted by the test).
func Cluster(t testing.TB) *pgcluster.Cluster {
	t.Helper()
	skipOrFail(t)
	return srv.cluster
}

// Kind says where the server came from: "TEST_DATABASE_URL", "cluster" or "docker".
func Kind() string {
	if srv == nil {
		return ""
	}
	return srv.kind
}

// As returns the database's connection string for another role (trust or the same password).
func (db DB) As(role string) string {
	if strings.HasPrefix(db.URL, "postgres://") || strings.HasPrefix(db.URL, "postgresql://") {
		u, err := neturl.Parse(db.URL)
		if err != nil {
			return db.URL
		}
		if pw, ok := u.User.Password(); ok {
			u.User = neturl.UserPassword(role, pw)
		} else {
			u.User = neturl.User(role)
		}
		return u.String()
	}
	return db.URL + " user=" + role
}

// QueryInt runs a query that returns one integer (a count, usually) and fails t on error.
func QueryInt(t testing.TB, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, sql string, args ...any) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var n int
	if err := db.QueryRow(ctx, sql, args...).Scan(&n); err != nil {
		t.Fatalf("pgtest: %s: %v", sql, err)
	}
	return n
}

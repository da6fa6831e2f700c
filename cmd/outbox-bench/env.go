package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"fusion/outbox"
	"fusion/outbox/example/taskstore/schema"
	"fusion/outbox/internal/pgcluster"
)

// Header starts every JSON line.
type Header struct {
	Bench      string `json:"bench"`
	Lib        string `json:"lib"`
	LibVersion string `json:"lib_version"`
	Driver     string `json:"driver"`
	Go         string `json:"go"`
	PG         string `json:"pg"`
	// Durable is true when the server runs with fsync, synchronous_commit and
	// full_page_writes on; figures from a server without them are not comparable.
	Durable bool `json:"durable"`
	// Load1m is the machine's one-minute load average when the case started: the machine is
	// shared, and a busy neighbour shows here.
	Load1m float64 `json:"load_1m"`
	// Roles says as whom the host's deletes, the consumers and retention ran, and who owns
	// the module's objects: "component+owner", a writer, a consumer and an operator role
	// granted as the README says, and an owner that is not a superuser (the ticker, as the
	// sequencer before it, runs as the owner), so that row-level security and column privileges
	// cost what they cost a real host. Lines that say "component" came from builds whose
	// databases the superuser owned, so that the sequencer's statements skipped row-level
	// security. Setup and measurement run as the superuser.
	Roles string `json:"roles"`
	// Commit is the VCS revision the bench was built from ("-dirty" when the tree had
	// changes); empty when the build carries no VCS stamp and make bench passed none. It comes
	// last so that the header's first keys stay as they were.
	Commit string `json:"commit,omitempty"`
}

// Env is where cases run: a server on which each case gets fresh, migrated databases.
type Env struct {
	header Header
	logf   func(format string, a ...any)
	newDB  func(ctx context.Context, label string) (*DB, error)
	close  func()
	// cluster is the throwaway cluster; nil on a -dsn server.
	cluster *pgcluster.Cluster
}

// StartStandby starts a streaming hot standby of the throwaway cluster (pgcluster.StartStandby:
// the cluster's options, hot_standby_feedback on), for cases whose consumers read from one.
// The caller stops it. A -dsn server has none.
func (e *Env) StartStandby(ctx context.Context) (*pgcluster.Cluster, error) {
	if e.cluster == nil {
		return nil, errors.New("a standby needs the throwaway cluster: run without -dsn")
	}
	e.logf("starting a streaming hot standby of the throwaway cluster")
	sb, err := pgcluster.StartStandby(ctx, e.cluster)
	if err != nil {
		return nil, fmt.Errorf("start standby: %w", err)
	}
	return sb, nil
}

// ConsumerDSNOn is a key=value connection string for the database's consumer role on another
// server of the same cluster (a standby listening on the unix socket directory host).
func (d *DB) ConsumerDSNOn(host string) string {
	q := func(v string) string {
		return "'" + strings.ReplaceAll(strings.ReplaceAll(v, `\`, `\\`), "'", `\'`) + "'"
	}
	return fmt.Sprintf("host=%s port=%d dbname=%s user=%s password=%s sslmode=disable", q(host), d.cfg.ConnConfig.Port,
		q(d.Name), q(d.consumer.name), q(d.consumer.password))
}

// SuperuserPoolOn opens a superuser pool of maxConns on the database on another server of the
// same cluster (a standby listening on the unix socket directory host).
func (d *DB) SuperuserPoolOn(ctx context.Context, host string, maxConns int32) (*pgxpool.Pool, error) {
	cfg := d.cfg.Copy()
	cfg.ConnConfig.Host = host
	cfg.MaxConns = maxConns
	return pgxpool.NewWithConfig(ctx, cfg)
}

// DB is one fresh database with the outbox and reference host schemas, and a login role for
// each component that runs on it.
type DB struct {
	Name     string
	cfg      *pgxpool.Config
	drop     func()
	owner    loginRole // owns the database and the module's objects; empty for existingDB
	writer   loginRole
	consumer loginRole
	operator loginRole
}

// loginRole is a role the bench created for one database.
type loginRole struct{ name, password string }

// Header returns the line header for a case.
func (e *Env) Header(bench string) Header {
	h := e.header
	h.Bench = bench
	h.Roles = componentRoles
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		if f := strings.Fields(string(b)); len(f) > 0 {
			h.Load1m, _ = strconv.ParseFloat(f[0], 64)
		}
	}
	return h
}

// Logf reports progress on stderr.
func (e *Env) Logf(format string, a ...any) { e.logf(format, a...) }

// Close stops the throwaway cluster, if any.
func (e *Env) Close() {
	if e.close != nil {
		e.close()
	}
}

// NewDB creates a fresh migrated database; Drop removes it.
func (e *Env) NewDB(ctx context.Context, label string) (*DB, error) { return e.newDB(ctx, label) }

// NewDBPool is NewDB with a pool of maxConns on it; closeDB closes the pool and drops the
// database.
func (e *Env) NewDBPool(ctx context.Context, label string, maxConns int32) (db *DB, pool *pgxpool.Pool, closeDB func(), err error) {
	db, err = e.NewDB(ctx, label)
	if err != nil {
		return nil, nil, nil, err
	}
	pool, err = db.Pool(ctx, maxConns, nil)
	if err != nil {
		db.Drop()
		return nil, nil, nil, err
	}
	return db, pool, func() { pool.Close(); db.Drop() }, nil
}

// Drop removes the database (a no-op for databases the test harness owns).
func (d *DB) Drop() {
	if d.drop != nil {
		d.drop()
	}
}

// Pool opens a pool of at most maxConns connections on the database as the superuser, for
// setup and measurement. tracer may be nil.
func (d *DB) Pool(ctx context.Context, maxConns int32, tracer pgx.QueryTracer) (*pgxpool.Pool, error) {
	return d.rolePool(ctx, loginRole{}, maxConns, tracer)
}

// Pools opens a superuser pool of two connections for setup and a writer role's pool of
// maxConns (with tracer, which may be nil) for the host; closePools closes both.
func (d *DB) Pools(ctx context.Context, maxConns int32, tracer pgx.QueryTracer) (admin, writer *pgxpool.Pool, closePools func(), err error) {
	if admin, err = d.Pool(ctx, 2, nil); err != nil {
		return nil, nil, nil, err
	}
	if writer, err = d.WriterPool(ctx, maxConns, tracer); err != nil {
		admin.Close()
		return nil, nil, nil, err
	}
	return admin, writer, func() { writer.Close(); admin.Close() }, nil
}

// WriterPool opens a pool as the database's writer role: the host's deletes run on it.
func (d *DB) WriterPool(ctx context.Context, maxConns int32, tracer pgx.QueryTracer) (*pgxpool.Pool, error) {
	return d.rolePool(ctx, d.writer, maxConns, tracer)
}

// OperatorPool opens a pool as the database's operator role: retention runs on it.
func (d *DB) OperatorPool(ctx context.Context, maxConns int32, tracer pgx.QueryTracer) (*pgxpool.Pool, error) {
	return d.rolePool(ctx, d.operator, maxConns, tracer)
}

// ConsumerPool opens a pool as the database's consumer role.
func (d *DB) ConsumerPool(ctx context.Context, maxConns int32, tracer pgx.QueryTracer) (*pgxpool.Pool, error) {
	return d.rolePool(ctx, d.consumer, maxConns, tracer)
}

func (d *DB) rolePool(ctx context.Context, role loginRole, maxConns int32, tracer pgx.QueryTracer) (*pgxpool.Pool, error) {
	cfg := d.cfg.Copy()
	cfg.MaxConns = maxConns
	cfg.ConnConfig.Tracer = tracer
	if role.name != "" {
		cfg.ConnConfig.User, cfg.ConnConfig.Password = role.name, role.password
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("open pool on %s: %w", d.Name, err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("ping %s: %w", d.Name, err)
	}
	return pool, nil
}

// libVersion is what lib_version reports when the build carries no module version: a build
// from the module's own tree ("go run ./cmd/outbox-bench") is "(devel)" in debug.ReadBuildInfo,
// so the schema version it was built with is added to make the line traceable.
var libVersionFallback = fmt.Sprintf("(devel)+schema.%d", outbox.SchemaVersion)

// buildCommit is the revision "make bench" passes with -ldflags -X: "go run" stamps no VCS
// information into the binary, so without it every line would say only "(devel)".
var buildCommit string

// versions reads lib_version, driver and commit from the build information.
func versions() (lib, driver, commit string) {
	bi, ok := debug.ReadBuildInfo()
	if !ok {
		return libVersionFallback, "pgx/v5", buildCommit
	}
	lib, driver, commit = versionsFrom(bi)
	if commit == "" {
		commit = buildCommit
	}
	return lib, driver, commit
}

func versionsFrom(bi *debug.BuildInfo) (lib, driver, commit string) {
	lib, driver = libVersionFallback, "pgx/v5"
	var rev, dirty string
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision":
			rev = s.Value
		case "vcs.modified":
			if s.Value == "true" {
				dirty = "-dirty"
			}
		}
	}
	if rev != "" {
		commit = rev + dirty
	}
	if v := bi.Main.Version; v != "" && v != "(devel)" {
		lib = v
	} else if rev != "" {
		if len(rev) > 12 {
			rev = rev[:12]
		}
		lib = "(devel)+" + rev + dirty
	}
	for _, d := range bi.Deps {
		if d.Path == "github.com/jackc/pgx/v5" {
			v := d.Version
			if d.Replace != nil {
				v = d.Replace.Version
			}
			driver = "pgx/v5 " + v
		}
	}
	return lib, driver, commit
}

// newHeader reads the server's version and durability settings.
func newHeader(ctx context.Context, cfg *pgx.ConnConfig) (Header, error) {
	lib, driver, commit := versions()
	h := Header{Lib: "outbox", LibVersion: lib, Commit: commit, Driver: driver, Go: runtime.Version()}
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return h, fmt.Errorf("connect: %w", err)
	}
	defer conn.Close(ctx)
	var fsync, syncCommit, fpw string
	err = conn.QueryRow(ctx, `SELECT current_setting('server_version'), current_setting('fsync'),
		current_setting('synchronous_commit'), current_setting('full_page_writes')`).Scan(&h.PG, &fsync, &syncCommit, &fpw)
	if err != nil {
		return h, fmt.Errorf("read server settings: %w", err)
	}
	h.Durable = fsync == "on" && syncCommit != "off" && fpw == "on"
	return h, nil
}

// statStatementsSettings load pg_stat_statements and have it track the statements that
// functions run too (the ticker and the reader are two), so that the sustained and scale cases can read
// what the server executed. The extension's own cost (a hash lookup and a counter update per
// statement) is in every figure of a run on the throwaway cluster.
var statStatementsSettings = map[string]string{
	"shared_preload_libraries": "pg_stat_statements",
	"pg_stat_statements.track": "all",
}

// clusterOptions are the throwaway cluster's options: durable for measurements; the tests
// start one that is not. The idle curve's 64 consumers hold up to six connections each while
// they start (a pool of four, the LISTEN connection and the ticker's candidate), more than the
// default 300: a run at 39cbb66 failed there with "remaining connection slots are reserved".
func clusterOptions(durable bool) pgcluster.Options {
	return pgcluster.Options{Durable: durable, Settings: statStatementsSettings, MaxConnections: 600}
}

// NewServerEnv runs cases on dsn, or on a throwaway durable cluster when dsn is empty.
func NewServerEnv(ctx context.Context, dsn string, logf func(string, ...any)) (*Env, error) {
	env := &Env{logf: logf}
	if dsn == "" {
		logf("starting a throwaway PostgreSQL cluster (durable settings, pg_stat_statements loaded)")
		c, err := pgcluster.Start(ctx, clusterOptions(true))
		if err != nil {
			return nil, fmt.Errorf("start cluster: %w", err)
		}
		env.close, env.cluster = c.Stop, c
		dsn = c.URL("postgres")
	}
	admin, err := pgx.ParseConfig(dsn)
	if err != nil {
		env.Close()
		return nil, fmt.Errorf("parse -dsn: %w", err)
	}
	if env.header, err = newHeader(ctx, admin); err != nil {
		env.Close()
		return nil, err
	}
	var counter atomic.Int64
	env.newDB = func(ctx context.Context, label string) (*DB, error) {
		name := fmt.Sprintf("bench_%s_%d_%d", strings.ReplaceAll(label, "-", "_"), os.Getpid(), counter.Add(1))
		return createDB(ctx, dsn, admin, name)
	}
	logf("server %s (durable: %t)", env.header.PG, env.header.Durable)
	return env, nil
}

// createDB creates and migrates database name on the server admin points at.
func createDB(ctx context.Context, dsn string, admin *pgx.ConnConfig, name string) (*DB, error) {
	ident := pgx.Identifier{name}.Sanitize()
	adminExec := func(ctx context.Context, sql string) error {
		conn, err := pgx.ConnectConfig(ctx, admin)
		if err != nil {
			return err
		}
		defer conn.Close(ctx)
		_, err = conn.Exec(ctx, sql)
		return err
	}
	if err := adminExec(ctx, "CREATE DATABASE "+ident); err != nil {
		return nil, fmt.Errorf("create database %s: %w", name, err)
	}
	db := &DB{Name: name, drop: func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		_ = adminExec(ctx, "DROP DATABASE IF EXISTS "+ident+" WITH (FORCE)")
	}}
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		db.Drop()
		return nil, fmt.Errorf("parse dsn: %w", err)
	}
	cfg.ConnConfig.Database = name
	db.cfg = cfg
	dropDB := db.drop
	db.drop = func() {
		dropDB()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		var roles []string
		for _, r := range []loginRole{db.owner, db.writer, db.consumer, db.operator} {
			if r.name != "" {
				roles = append(roles, pgx.Identifier{r.name}.Sanitize())
			}
		}
		if len(roles) > 0 {
			_ = adminExec(ctx, "DROP ROLE IF EXISTS "+strings.Join(roles, ", "))
		}
	}
	if err := db.createOwner(ctx); err != nil {
		db.Drop()
		return nil, err
	}
	owner := cfg.ConnConfig.Copy()
	owner.User, owner.Password = db.owner.name, db.owner.password
	if err := migrateDB(ctx, owner); err != nil {
		db.Drop()
		return nil, fmt.Errorf("migrate %s: %w", name, err)
	}
	if err := db.createRoles(ctx); err != nil {
		db.Drop()
		return nil, err
	}
	return db, nil
}

// databaseOID is the connection's database's oid, which names the bench's roles for it.
func databaseOID(ctx context.Context, conn *pgx.Conn) (int64, error) {
	var oid int64
	if err := conn.QueryRow(ctx, "SELECT oid::bigint FROM pg_database WHERE datname = current_database()").Scan(&oid); err != nil {
		return 0, fmt.Errorf("read database oid: %w", err)
	}
	return oid, nil
}

// newLoginRole creates a login role named outbox_bench_<kind>_<suffix> with a random
// password, as the connection's user.
func newLoginRole(ctx context.Context, conn *pgx.Conn, kind string, suffix int64) (loginRole, error) {
	key := make([]byte, 16)
	if _, err := rand.Read(key); err != nil {
		return loginRole{}, fmt.Errorf("role password: %w", err)
	}
	r := loginRole{name: fmt.Sprintf("outbox_bench_%s_%d", kind, suffix), password: hex.EncodeToString(key)}
	// The password is hex, so it needs no quoting beyond the literal's.
	if _, err := conn.Exec(ctx, "CREATE ROLE "+pgx.Identifier{r.name}.Sanitize()+" LOGIN NOSUPERUSER NOBYPASSRLS PASSWORD '"+r.password+"'"); err != nil {
		return loginRole{}, fmt.Errorf("create role %s: %w", r.name, err)
	}
	return r, nil
}

// connectWithOID connects to the database as the superuser and reads its oid, which names the
// login roles made for it.
func (d *DB) connectWithOID(ctx context.Context) (*pgx.Conn, int64, error) {
	conn, err := pgx.ConnectConfig(ctx, d.cfg.ConnConfig)
	if err != nil {
		return nil, 0, fmt.Errorf("connect to %s: %w", d.Name, err)
	}
	oid, err := databaseOID(ctx, conn)
	if err != nil {
		conn.Close(ctx)
		return nil, 0, err
	}
	return conn, oid, nil
}

// createOwner makes a role that is not a superuser the owner of the database, and so of
// its public schema and of everything the migrations create there, as a deployment's schema
// owner is. The ticker runs as that owner (SECURITY DEFINER), and the tables force row-level
// security on it: owned by the superuser, its statements would skip the policies that a
// deployment's ticker pays for.
func (d *DB) createOwner(ctx context.Context) error {
	conn, oid, err := d.connectWithOID(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if d.owner, err = newLoginRole(ctx, conn, "owner", oid); err != nil {
		return err
	}
	owner := pgx.Identifier{d.owner.name}.Sanitize()
	// A role with CREATEROLE that is not a superuser must be a member of the new owner to hand
	// the database to it.
	for _, stmt := range []string{"GRANT " + owner + " TO CURRENT_USER", "ALTER DATABASE " + pgx.Identifier{d.Name}.Sanitize() + " OWNER TO " + owner} {
		if _, err := conn.Exec(ctx, stmt); err != nil {
			return fmt.Errorf("owner of %s: %w", d.Name, err)
		}
	}
	return nil
}

// componentRoles is the Header's Roles: see there.
const componentRoles = "component+owner"

// createRoles creates the database's writer, consumer and operator login roles and grants them
// what the README tells a host to grant, in every project, and on the host's tables what the
// host needs.
func (d *DB) createRoles(ctx context.Context) error {
	conn, oid, err := d.connectWithOID(ctx)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	for kind, r := range map[string]*loginRole{"writer": &d.writer, "consumer": &d.consumer, "operator": &d.operator} {
		if *r, err = newLoginRole(ctx, conn, kind, oid); err != nil {
			return err
		}
	}
	w, c := pgx.Identifier{d.writer.name}.Sanitize(), pgx.Identifier{d.consumer.name}.Sanitize()
	steps := []struct {
		what string
		run  func() error
	}{
		{"writer grants", func() error { return outbox.GrantWriterRole(ctx, conn, d.writer.name, "*") }},
		{"host grants", func() error {
			// The reference host's tables. GRANT takes no parameters: the role is quoted (w).
			_, err := conn.Exec(ctx, "GRANT SELECT, INSERT, UPDATE, DELETE ON tasks, run_audit, mailbox_notices, settings TO "+w)
			return err
		}},
		{"consumer grants", func() error { return outbox.GrantConsumerRole(ctx, conn, d.consumer.name, "bench", "*") }},
		{"consumer identities", func() error { return outbox.GrantConsumerAccess(ctx, conn, d.consumer.name, "*") }},
		{"operator grants", func() error { return outbox.GrantOperatorRole(ctx, conn, d.operator.name, "*") }},
		// Reconciliation reads the live tasks in the consumer's own snapshot, as the consumer role.
		{"consumer's host grants", func() error {
			_, err := conn.Exec(ctx, "GRANT SELECT ON tasks TO "+c)
			return err
		}},
	}
	for _, s := range steps {
		if err := s.run(); err != nil {
			return fmt.Errorf("%s on %s: %w", s.what, d.Name, err)
		}
	}
	return nil
}

func migrateDB(ctx context.Context, cfg *pgx.ConnConfig) error {
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	if _, err := outbox.Migrate(ctx, conn); err != nil {
		return err
	}
	return schema.Migrate(ctx, conn)
}

// existingDB wraps a database someone else created and migrated (the tests' pgtest database).
func existingDB(ctx context.Context, url string) (*DB, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("parse database URL: %w", err)
	}
	db := &DB{Name: cfg.ConnConfig.Database, cfg: cfg}
	return db, db.createRoles(ctx)
}

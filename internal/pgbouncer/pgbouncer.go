// Package pgbouncer starts a throwaway PgBouncer in front of a PostgreSQL server, for tests
// that must show the module works behind a transaction-pooling proxy. Nothing else should use
// it.
//
// The bouncer listens only on a unix socket in a short private directory and forwards every
// database name to the server of the same name (a "*" entry), so each test's own database is
// reachable through it without reconfiguration. PgBouncer refuses to run as root: when the
// current user is root it runs as the "postgres" OS user. A small reaper process holds the read
// end of a pipe from the starting process; when that process ends for any reason (normal exit,
// panic, SIGKILL) the pipe closes and the reaper stops the bouncer and removes its directory, so
// nothing is left running.
package pgbouncer

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"fusion/outbox/internal/pgcluster"
)

// Options configure a bouncer.
type Options struct {
	// ServerSocketDir and ServerPort locate the PostgreSQL server (a unix socket). Required.
	ServerSocketDir string
	ServerPort      int
	// PoolMode is "transaction" (the default), "session" or "statement".
	PoolMode string
	// MaxClientConn is the most client connections the bouncer accepts; more are refused.
	// Defaults to 100.
	MaxClientConn int
	// DefaultPoolSize is the most server connections per (database, user) pair. Defaults to 2:
	// few server connections shared by many clients make session state that leaks from one
	// client to the next show up.
	DefaultPoolSize int
	// Users may connect (auth_type trust still needs them listed). More can be added with
	// AddUser. Defaults to the server's superuser, "postgres".
	Users []string
	// CheckEveryReuse sets server_check_delay = 0: every reuse of a server first runs
	// server_check_query. Only the test that shows why the test bouncer keeps the default
	// delay (30s) sets it (see config).
	CheckEveryReuse bool
	// CheckQuery replaces server_check_query (PgBouncer's default is "select 1"). Only that
	// test sets it, to a query that takes a moment, so that the packets before and after it
	// reach the bouncer apart.
	CheckQuery string
}

// Bouncer is a running PgBouncer.
type Bouncer struct {
	bin     string
	dir     string // private directory: config, auth file, log, socket; removed on Stop
	port    int
	opts    Options
	cred    *syscall.Credential
	cmd     *exec.Cmd
	exited  chan struct{}
	waitErr error

	reaper     *exec.Cmd
	reaperPipe *os.File

	mu      sync.Mutex
	users   []string
	stopped bool
}

// Port is the port number in the bouncer's socket name (.s.PGSQL.<port>).
const Port = 6432

// FindBinary locates the pgbouncer executable: on PATH, else /usr/sbin/pgbouncer (Debian's
// package installs it there, outside a normal user's PATH).
func FindBinary() (string, error) {
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	const debian = "/usr/sbin/pgbouncer"
	if fi, err := os.Stat(debian); err == nil && !fi.IsDir() {
		return debian, nil
	}
	return "", errors.New("pgbouncer is not installed (apt-get install pgbouncer)")
}

// Start writes a configuration and starts the bouncer, waiting until its socket accepts
// connections.
func Start(ctx context.Context, opts Options) (*Bouncer, error) {
	bin, err := FindBinary()
	if err != nil {
		return nil, err
	}
	if opts.ServerSocketDir == "" || opts.ServerPort == 0 {
		return nil, errors.New("pgbouncer: the server's socket directory and port are required")
	}
	if opts.PoolMode == "" {
		opts.PoolMode = "transaction"
	}
	if opts.MaxClientConn == 0 {
		opts.MaxClientConn = 100
	}
	if opts.DefaultPoolSize == 0 {
		opts.DefaultPoolSize = 2
	}
	if len(opts.Users) == 0 {
		opts.Users = []string{"postgres"}
	}
	for _, u := range opts.Users {
		if err := checkUser(u); err != nil {
			return nil, err
		}
	}
	// Unix socket paths are limited to 107 bytes: a short directory directly under /tmp.
	dir, err := os.MkdirTemp("/tmp", "pgb")
	if err != nil {
		return nil, fmt.Errorf("pgbouncer directory: %w", err)
	}
	b := &Bouncer{bin: bin, dir: dir, port: Port, opts: opts, users: slices.Clone(opts.Users), exited: make(chan struct{})}
	cred, err := pgcluster.HandToPostgresUser(dir, "pgbouncer")
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	b.cred = cred
	if err := b.writeFiles(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if err := b.startReaper(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if err := b.start(); err != nil {
		b.Stop()
		return nil, err
	}
	if err := b.waitReady(ctx); err != nil {
		b.Stop()
		return nil, err
	}
	return b, nil
}

// checkUser keeps user names to what the auth file can hold without quoting surprises.
func checkUser(u string) error {
	if u == "" || len(u) > 63 || strings.ContainsAny(u, "\" \t\r\n\\") {
		return fmt.Errorf("pgbouncer: user name %q cannot be listed in the auth file", u)
	}
	return nil
}

func (b *Bouncer) path(name string) string { return filepath.Join(b.dir, name) }

// config is pgbouncer.ini. Every database name goes to the server database of the same name.
func (b *Bouncer) config() string {
	var s strings.Builder
	fmt.Fprintf(&s, "[databases]\n* = host=%s port=%d\n\n[pgbouncer]\n", b.opts.ServerSocketDir, b.opts.ServerPort)
	checkDelay := "30"
	if b.opts.CheckEveryReuse {
		checkDelay = "0"
	}
	settings := [][2]string{
		// No listen_addr: the unix socket only.
		{"unix_socket_dir", b.dir},
		{"listen_port", strconv.Itoa(b.port)},
		{"auth_type", "trust"},
		{"auth_file", b.path("users.txt")},
		{"admin_users", "postgres"},
		{"pool_mode", b.opts.PoolMode},
		{"max_client_conn", strconv.Itoa(b.opts.MaxClientConn)},
		{"default_pool_size", strconv.Itoa(b.opts.DefaultPoolSize)},
		{"reserve_pool_size", "0"},
		{"min_pool_size", "0"},
		{"logfile", b.path("pgbouncer.log")},
		{"pidfile", b.path("pgbouncer.pid")},
		// PgBouncer's default check delay (30s): a server idle that long runs server_check_query
		// before its next client. With 0 every reuse ran it, and a check that never finished
		// stalled the pool: a client waits while any server is being checked, and none was
		// opened for it (seen once in a CI run: two servers, one "used", one "tested", a client
		// waiting). A notification on a server with a LISTEN left on it ends a check early and
		// can leave a later one unfinished (TestServerCheckNeverFinishesAfterAStrayNotification).
		// A server that PostgreSQL closes (a dropped test database, a terminated backend, a
		// restart) is found without a check.
		{"server_check_delay", checkDelay},
		{"server_login_retry", "1"},
		{"log_connections", "0"},
		{"log_disconnections", "0"},
	}
	if b.opts.CheckQuery != "" {
		settings = append(settings, [2]string{"server_check_query", b.opts.CheckQuery})
	}
	for _, kv := range settings {
		fmt.Fprintf(&s, "%s = %s\n", kv[0], kv[1])
	}
	return s.String()
}

func (b *Bouncer) authFile() string {
	var s strings.Builder
	for _, u := range b.users {
		fmt.Fprintf(&s, "%q \"\"\n", u)
	}
	return s.String()
}

// writeFile writes name in the private directory, readable by the bouncer's user, replacing
// it atomically so that a reload never reads half a file.
func (b *Bouncer) writeFile(name, body string) error {
	tmp := b.path("." + name + ".tmp")
	if err := os.WriteFile(tmp, []byte(body), 0o600); err != nil {
		return fmt.Errorf("write %s: %w", name, err)
	}
	if b.cred != nil {
		if err := os.Chown(tmp, int(b.cred.Uid), int(b.cred.Gid)); err != nil {
			return fmt.Errorf("chown %s: %w", name, err)
		}
	}
	if err := os.Rename(tmp, b.path(name)); err != nil {
		return fmt.Errorf("install %s: %w", name, err)
	}
	return nil
}

func (b *Bouncer) writeFiles() error {
	if err := b.writeFile("pgbouncer.ini", b.config()); err != nil {
		return err
	}
	return b.writeFile("users.txt", b.authFile())
}

// startReaper launches the process that stops the bouncer if we die without calling Stop. It
// reads the bouncer's PID as its first line, then waits for the pipe to close.
func (b *Bouncer) startReaper() error {
	cmd, w, err := pgcluster.StartReaper(`read pid; read _ignored; [ -n "$pid" ] && kill -INT "$pid" 2>/dev/null; sleep 0.2; rm -rf "$1"`,
		b.cred, b.dir)
	if err != nil {
		return err
	}
	b.reaper, b.reaperPipe = cmd, w
	return nil
}

func (b *Bouncer) start() error {
	cmd := exec.Command(b.bin, b.path("pgbouncer.ini"))
	cmd.Dir = b.dir
	// Its own process group, so a terminal's Ctrl-C reaches the test binary, which stops it.
	// Pdeathsig is a second line behind the reaper.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: b.cred, Pdeathsig: syscall.SIGINT}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start pgbouncer: %w", err)
	}
	b.cmd = cmd
	if _, err := fmt.Fprintf(b.reaperPipe, "%d\n", cmd.Process.Pid); err != nil {
		return fmt.Errorf("tell the reaper: %w", err)
	}
	go func() {
		b.waitErr = cmd.Wait()
		close(b.exited)
	}()
	return nil
}

func (b *Bouncer) waitReady(ctx context.Context) error {
	deadline := time.Now().Add(30 * time.Second)
	sock := b.path(fmt.Sprintf(".s.PGSQL.%d", b.port))
	for {
		select {
		case <-b.exited:
			return fmt.Errorf("pgbouncer exited at start: %v%s", b.waitErr, b.LogTail())
		default:
		}
		if c, err := net.DialTimeout("unix", sock, time.Second); err == nil {
			_ = c.Close()
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("pgbouncer never listened on %s%s", sock, b.LogTail())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// LogTail is the end of the bouncer's log, for error messages.
func (b *Bouncer) LogTail() string {
	data, err := os.ReadFile(b.path("pgbouncer.log"))
	if err != nil || len(data) == 0 {
		return ""
	}
	if len(data) > 3000 {
		data = data[len(data)-3000:]
	}
	return "\npgbouncer log:\n" + string(data)
}

// LogContains reports whether a line of the bouncer's log contains s.
func (b *Bouncer) LogContains(s string) bool {
	f, err := os.Open(b.path("pgbouncer.log"))
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if strings.Contains(sc.Text(), s) {
			return true
		}
	}
	return false
}

// SocketDir is the directory holding the bouncer's unix socket.
func (b *Bouncer) SocketDir() string { return b.dir }

// Options returns the options the bouncer runs with (defaults applied).
func (b *Bouncer) Options() Options { return b.opts }

// DSN is a keyword/value connection string for user and database through the bouncer.
func (b *Bouncer) DSN(user, database string) string {
	return fmt.Sprintf("host=%s port=%d user=%s dbname=%s sslmode=disable", b.dir, b.port, user, database)
}

// URL is the same connection as DSN in URL form.
func (b *Bouncer) URL(user, database string) string {
	return fmt.Sprintf("postgres://%s@/%s?host=%s&port=%d&sslmode=disable", user, database, b.dir, b.port)
}

// AddUser lists user in the auth file and makes the running bouncer reload it (SIGHUP), so a
// role a test created can connect through the bouncer. It waits until the reload was logged.
func (b *Bouncer) AddUser(user string) error {
	if err := checkUser(user); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.stopped {
		return errors.New("pgbouncer is stopped")
	}
	if slices.Contains(b.users, user) {
		return nil
	}
	b.users = append(b.users, user)
	if err := b.writeFile("users.txt", b.authFile()); err != nil {
		return err
	}
	return b.reload()
}

// reloadLogLine is what PgBouncer logs when SIGHUP makes it re-read its files.
const reloadLogLine = "got SIGHUP, re-reading config"

// reload sends SIGHUP and waits until the bouncer has re-read its files: the log counts
// reloads, so the wait compares the count before and after.
func (b *Bouncer) reload() error {
	before := b.countLog(reloadLogLine)
	if err := b.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		return fmt.Errorf("reload pgbouncer: %w", err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for b.countLog(reloadLogLine) <= before {
		if time.Now().After(deadline) {
			return fmt.Errorf("pgbouncer did not log its reload%s", b.LogTail())
		}
		time.Sleep(10 * time.Millisecond)
	}
	return nil
}

func (b *Bouncer) countLog(s string) int {
	data, err := os.ReadFile(b.path("pgbouncer.log"))
	if err != nil {
		return 0
	}
	return strings.Count(string(data), s)
}

// Stop stops the bouncer (SIGINT: at once, closing every connection) and removes its
// directory. It is safe to call more than once.
func (b *Bouncer) Stop() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.stopped {
		return
	}
	b.stopped = true
	if b.cmd != nil {
		_ = b.cmd.Process.Signal(syscall.SIGINT)
		select {
		case <-b.exited:
		case <-time.After(10 * time.Second):
			_ = b.cmd.Process.Kill()
			<-b.exited
		}
	}
	// Closing the pipe lets the reaper finish; it removes the directory.
	_ = b.reaperPipe.Close()
	_ = b.reaper.Wait()
	_ = os.RemoveAll(b.dir)
}

// ServerStates is the state of each server connection of database's pools, as SHOW SERVERS
// names it ("active", "idle", "used", "tested", "login"), keyed by the server's backend PID.
func (b *Bouncer) ServerStates(ctx context.Context, database string) (map[int]string, error) {
	cfg, err := pgx.ParseConfig(b.DSN("postgres", "pgbouncer"))
	if err != nil {
		return nil, err
	}
	cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("admin console: %w", err)
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(ctx, "SHOW SERVERS")
	if err != nil {
		return nil, fmt.Errorf("show servers: %w", err)
	}
	all, err := pgx.CollectRows(rows, pgx.RowToMap)
	if err != nil {
		return nil, fmt.Errorf("show servers: %w", err)
	}
	out := map[int]string{}
	for _, r := range all {
		if fmt.Sprint(r["database"]) != database {
			continue
		}
		pid, err := strconv.Atoi(fmt.Sprint(r["remote_pid"]))
		if err != nil {
			return nil, fmt.Errorf("show servers: remote_pid %v: %w", r["remote_pid"], err)
		}
		out[pid] = fmt.Sprint(r["state"])
	}
	return out, nil
}

// State is what the admin console says of the pools, server connections and clients, as text,
// for a test to log while something waits on the bouncer. It never fails: an error is part of
// the text.
func (b *Bouncer) State(ctx context.Context) string {
	cfg, err := pgx.ParseConfig(b.DSN("postgres", "pgbouncer"))
	if err != nil {
		return "pgbouncer state: " + err.Error()
	}
	cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol // all the admin console speaks
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return "pgbouncer state: " + err.Error()
	}
	defer conn.Close(context.Background())
	var s strings.Builder
	for _, show := range []string{"SHOW POOLS", "SHOW SERVERS", "SHOW CLIENTS"} {
		fmt.Fprintf(&s, "\n%s:\n", show)
		rows, err := conn.Query(ctx, show)
		if err != nil {
			fmt.Fprintf(&s, "  %v\n", err)
			continue
		}
		names := make([]string, 0, len(rows.FieldDescriptions()))
		for _, f := range rows.FieldDescriptions() {
			names = append(names, f.Name)
		}
		fmt.Fprintf(&s, "  %s\n", strings.Join(names, " | "))
		for rows.Next() {
			vals, err := rows.Values()
			if err != nil {
				fmt.Fprintf(&s, "  %v\n", err)
				break
			}
			cells := make([]string, len(vals))
			for i, v := range vals {
				cells[i] = fmt.Sprint(v)
			}
			fmt.Fprintf(&s, "  %s\n", strings.Join(cells, " | "))
		}
		if err := rows.Err(); err != nil {
			fmt.Fprintf(&s, "  %v\n", err)
		}
	}
	return s.String() + b.LogTail()
}

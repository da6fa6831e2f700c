// Package pgcluster starts a throwaway PostgreSQL cluster from the server binaries installed on
// the machine. Tests, the demo and the benchmarks use it; nothing else should.
//
// The cluster listens only on a unix socket in a short private directory. When the current user
// is root, initdb and pg_ctl run as the "postgres" OS user, because initdb refuses root. A small
// reaper process holds the read end of a pipe from the starting process: when that process ends
// for any reason (normal exit, panic, SIGKILL), the pipe closes and the reaper stops the server
// and removes its directory, so nothing is left running.
package pgcluster

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Options tune a new cluster.
type Options struct {
	// Durable keeps fsync, synchronous_commit and full_page_writes on. Tests leave it off for
	// speed; benchmarks turn it on so their figures mean something.
	Durable bool
	// Settings are extra postgresql.conf parameters, passed as -c name=value.
	Settings map[string]string
	// MaxConnections defaults to 300.
	MaxConnections int
}

// Cluster is a running throwaway PostgreSQL server.
type Cluster struct {
	binDir  string
	baseDir string // removed on Stop
	dataDir string
	sockDir string
	logFile string
	cred    *syscall.Credential // nil when not running as root
	opts    Options
	// primary and slot are set on a standby (StartStandby): the cluster it follows and the
	// replication slot it holds there, dropped by Stop.
	primary *Cluster
	slot    string

	reaper     *exec.Cmd
	reaperPipe *os.File

	mu      sync.Mutex
	stopped bool
}

// Superuser is the name of the cluster's bootstrap superuser.
const Superuser = "postgres"

// FindBinDir locates the directory holding initdb and pg_ctl: first on PATH (resolving
// wrapper scripts to the real server directory when possible), then under
// /usr/lib/postgresql/*/bin, newest version first.
func FindBinDir() (string, error) {
	candidates, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(candidates, func(i, j int) bool {
		return versionOf(candidates[i]) > versionOf(candidates[j])
	})
	if p, err := exec.LookPath("pg_ctl"); err == nil {
		// A symlink on PATH leads to the server's own directory, which also holds the tools
		// that are not linked (pg_resetwal, pg_dump, pgbench).
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		dir := filepath.Dir(p)
		if _, err := os.Stat(filepath.Join(dir, "postgres")); err == nil {
			return dir, nil
		}
		// Debian puts wrapper scripts on PATH; the server binaries live elsewhere.
	}
	for _, dir := range candidates {
		if _, err := os.Stat(filepath.Join(dir, "initdb")); err == nil {
			return dir, nil
		}
	}
	return "", errors.New("no PostgreSQL server binaries: initdb and pg_ctl are neither on PATH nor under /usr/lib/postgresql/*/bin")
}

func versionOf(binDir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return v
}

// Start initialises and starts a new cluster.
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	binDir, err := FindBinDir()
	if err != nil {
		return nil, err
	}
	if opts.MaxConnections == 0 {
		opts.MaxConnections = 300
	}
	// Unix socket paths are limited to 107 bytes, so the base directory lives directly under
	// /tmp (or /dev/shm) rather than under a long TMPDIR. A cluster that need not be durable
	// lives in memory when /dev/shm is there: creating a database creates hundreds of files,
	// and on a slow disk that alone costs a test a quarter of a second.
	parent := "/tmp"
	if !opts.Durable && isDir("/dev/shm") {
		parent = "/dev/shm"
	}
	baseDir, err := os.MkdirTemp(parent, "pg")
	if err != nil {
		return nil, fmt.Errorf("create cluster directory: %w", err)
	}
	c := &Cluster{
		binDir:  binDir,
		baseDir: baseDir,
		dataDir: filepath.Join(baseDir, "data"),
		sockDir: baseDir,
		logFile: filepath.Join(baseDir, "server.log"),
		opts:    opts,
	}
	cred, err := HandToPostgresUser(baseDir, "initdb")
	if err != nil {
		_ = os.RemoveAll(baseDir)
		return nil, err
	}
	c.cred = cred
	if err := c.startReaper(); err != nil {
		_ = os.RemoveAll(baseDir)
		return nil, err
	}
	if err := c.run(ctx, "initdb", "-D", c.dataDir, "-A", "trust", "-U", Superuser,
		"-E", "UTF8", "--locale=C", "--no-sync"); err != nil {
		c.Stop()
		return nil, err
	}
	if err := c.start(ctx); err != nil {
		c.Stop()
		return nil, err
	}
	return c, nil
}

func isDir(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.IsDir()
}

// startReaper launches the process that cleans up after us if we die without calling Stop.
func (c *Cluster) startReaper() error {
	cmd, w, err := StartReaper(`read _ignored; "$1" -D "$2" stop -m immediate >/dev/null 2>&1; rm -rf "$3"`,
		c.cred, filepath.Join(c.binDir, "pg_ctl"), c.dataDir, c.baseDir)
	if err != nil {
		return err
	}
	c.reaper, c.reaperPipe = cmd, w
	return nil
}

func (c *Cluster) serverOptions() string {
	settings := map[string]string{
		"listen_addresses":        "''",
		"max_connections":         strconv.Itoa(c.opts.MaxConnections),
		"unix_socket_directories": c.sockDir,
	}
	if !c.opts.Durable {
		settings["fsync"] = "off"
		settings["synchronous_commit"] = "off"
		settings["full_page_writes"] = "off"
	}
	for k, v := range c.opts.Settings {
		settings[k] = v
	}
	keys := make([]string, 0, len(settings))
	for k := range settings {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, " -c %s=%s", k, settings[k])
	}
	return strings.TrimSpace(b.String())
}

func (c *Cluster) start(ctx context.Context) error {
	return c.run(ctx, "pg_ctl", "start", "-w", "-t", "60", "-D", c.dataDir, "-l", c.logFile, "-o", c.serverOptions())
}

// Restart stops the server with the fast mode (clients are disconnected, transactions rolled
// back) and starts it again on the same socket.
func (c *Cluster) Restart(ctx context.Context) error {
	return c.run(ctx, "pg_ctl", "restart", "-w", "-t", "60", "-m", "fast", "-D", c.dataDir, "-l", c.logFile, "-o", c.serverOptions())
}

// StopServer stops the server cleanly (fast mode) and keeps its data directory, so that a tool
// which needs a cleanly stopped cluster (pg_resetwal) can work on it before StartServer. Stop
// still removes everything afterwards, and the reaper still does if the process dies.
func (c *Cluster) StopServer(ctx context.Context) error {
	return c.run(ctx, "pg_ctl", "stop", "-w", "-t", "60", "-m", "fast", "-D", c.dataDir)
}

// StartServer starts a server stopped by StopServer again, with the same options and socket.
func (c *Cluster) StartServer(ctx context.Context) error {
	return c.start(ctx)
}

// DataDir is the cluster's data directory.
func (c *Cluster) DataDir() string { return c.dataDir }

// Command returns the named tool of the cluster's binary directory (pg_dump, pg_restore,
// pg_resetwal, ...) ready to run as the OS user that owns the data directory: pg_resetwal, like
// initdb, refuses root. The caller sets its standard streams and runs it.
func (c *Cluster) Command(ctx context.Context, tool string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, filepath.Join(c.binDir, tool), args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: c.cred}
	cmd.Dir = c.baseDir
	return cmd
}

func (c *Cluster) run(ctx context.Context, tool string, args ...string) error {
	out, err := c.Command(ctx, tool, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %w: %s%s", tool, err, strings.TrimSpace(string(out)), c.logTail())
	}
	return nil
}

func (c *Cluster) logTail() string {
	b, err := os.ReadFile(c.logFile)
	if err != nil || len(b) == 0 {
		return ""
	}
	if len(b) > 2000 {
		b = b[len(b)-2000:]
	}
	return "\nserver log:\n" + string(b)
}

// SocketDir is the directory holding the server's unix socket.
func (c *Cluster) SocketDir() string { return c.sockDir }

// BinDir is the directory holding the server binaries (pgbench lives there too).
func (c *Cluster) BinDir() string { return c.binDir }

// DSN returns a keyword/value connection string for the superuser and the given database.
func (c *Cluster) DSN(database string) string {
	return fmt.Sprintf("host=%s port=5432 user=%s dbname=%s sslmode=disable", c.sockDir, Superuser, database)
}

// URL returns the same connection as DSN in URL form.
func (c *Cluster) URL(database string) string {
	return fmt.Sprintf("postgres://%s@/%s?host=%s&port=5432&sslmode=disable", Superuser, database, c.sockDir)
}

// Stop stops the server and removes its directory. It is safe to call more than once.
func (c *Cluster) Stop() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopped {
		return
	}
	c.stopped = true
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := os.Stat(filepath.Join(c.dataDir, "postmaster.pid")); err == nil {
		_ = c.run(ctx, "pg_ctl", "stop", "-w", "-m", "immediate", "-D", c.dataDir)
	}
	// Closing the pipe lets the reaper finish; it removes the directory.
	_ = c.reaperPipe.Close()
	_ = c.reaper.Wait()
	_ = os.RemoveAll(c.baseDir)
	if c.primary != nil && c.slot != "" {
		// The slot would keep WAL on the primary for ever. A primary already stopped has
		// nothing left to keep.
		_ = c.primary.dropSlot(ctx, c.slot)
	}
}

// dropSlot drops a replication slot of a standby that is gone, when the server still runs.
func (c *Cluster) dropSlot(ctx context.Context, slot string) error {
	c.mu.Lock()
	stopped := c.stopped
	c.mu.Unlock()
	if stopped {
		return nil
	}
	return c.run(ctx, "psql", "-X", "-q", "-h", c.sockDir, "-p", "5432", "-U", Superuser, "-d", "postgres",
		"-c", "SELECT pg_catalog.pg_drop_replication_slot(slot_name) FROM pg_catalog.pg_replication_slots WHERE slot_name = '"+slot+"'")
}

// HandToPostgresUser prepares dir for server processes run as the "postgres" OS user when the
// current user is root (initdb and pgbouncer refuse root): it chowns dir to that user and
// returns the credential to run them with. Otherwise it returns nil and changes nothing.
func HandToPostgresUser(dir, tool string) (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup(Superuser)
	if err != nil {
		return nil, fmt.Errorf("running as root needs the %q OS user for %s: %w", Superuser, tool, err)
	}
	uid, _ := strconv.ParseUint(u.Uid, 10, 32)
	gid, _ := strconv.ParseUint(u.Gid, 10, 32)
	cred := &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
	if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
		return nil, fmt.Errorf("hand %s directory to %s: %w", tool, Superuser, err)
	}
	return cred, nil
}

// StartReaper launches a shell running script (with args as $1, $2, ...) as cred, with its
// standard input on a pipe. The caller keeps the write end: when the caller's process ends
// for any reason, SIGKILL included, the pipe closes, the script's read returns, and it cleans
// up. Closing the write end on purpose does the same.
func StartReaper(script string, cred *syscall.Credential, args ...string) (*exec.Cmd, *os.File, error) {
	r, w, err := os.Pipe()
	if err != nil {
		return nil, nil, fmt.Errorf("reaper pipe: %w", err)
	}
	cmd := exec.Command("/bin/sh", append([]string{"-c", script, "reaper"}, args...)...)
	cmd.Stdin = r
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Credential: cred}
	if err := cmd.Start(); err != nil {
		_ = r.Close()
		_ = w.Close()
		return nil, nil, fmt.Errorf("start reaper: %w", err)
	}
	_ = r.Close()
	return cmd, w, nil
}

// StartStandby starts a streaming hot standby of primary: a base backup of it (pg_basebackup
// with -R, over primary's unix socket, as the OS user that owns the clusters when running as
// root) in a directory of its own, started with hot_standby and hot_standby_feedback on and
// primary's options, listening on a socket directory of its own. The backup creates a physical
// replication slot on primary, so the standby can be stopped and started again without
// losing WAL; Stop drops it. The standby has a reaper like any cluster: nothing is left
// running. It needs from primary what PostgreSQL 15's defaults give a throwaway cluster
// (wal_level=replica, max_wal_senders > 0, and initdb's trust line for local replication).
func StartStandby(ctx context.Context, primary *Cluster) (*Cluster, error) {
	parent := filepath.Dir(primary.baseDir)
	baseDir, err := os.MkdirTemp(parent, "pgs")
	if err != nil {
		return nil, fmt.Errorf("create standby directory: %w", err)
	}
	opts := primary.opts
	opts.Settings = map[string]string{"hot_standby": "on", "hot_standby_feedback": "on"}
	for k, v := range primary.opts.Settings {
		if _, set := opts.Settings[k]; !set {
			opts.Settings[k] = v
		}
	}
	c := &Cluster{
		binDir:  primary.binDir,
		baseDir: baseDir,
		dataDir: filepath.Join(baseDir, "data"),
		sockDir: baseDir,
		logFile: filepath.Join(baseDir, "server.log"),
		opts:    opts,
		primary: primary,
		slot:    slotName(filepath.Base(baseDir)),
	}
	cred, err := HandToPostgresUser(baseDir, "pg_basebackup")
	if err != nil {
		_ = os.RemoveAll(baseDir)
		return nil, err
	}
	c.cred = cred
	if err := c.startReaper(); err != nil {
		_ = os.RemoveAll(baseDir)
		return nil, err
	}
	if err := c.run(ctx, "pg_basebackup", "-h", primary.sockDir, "-p", "5432", "-U", Superuser,
		"-D", c.dataDir, "-R", "-X", "stream", "-c", "fast", "--no-sync", "-C", "-S", c.slot); err != nil {
		c.slot = "" // nothing to drop, or nothing reachable to drop it on
		c.Stop()
		return nil, err
	}
	if err := c.start(ctx); err != nil {
		c.Stop()
		return nil, err
	}
	return c, nil
}

// slotName makes a replication slot name (lower-case letters, digits, underscores) from a
// directory name.
func slotName(dir string) string {
	return "standby_" + strings.Map(func(r rune) rune {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') {
			return r
		}
		if r >= 'A' && r <= 'Z' {
			return r - 'A' + 'a'
		}
		return '_'
	}, dir)
}

// Promote ends the standby's recovery (pg_ctl promote) and waits until it accepts writes. The
// promoted server no longer follows its primary; the primary's slot for it stays until Stop.
func (c *Cluster) Promote(ctx context.Context) error {
	if c.primary == nil {
		return errors.New("promote: not a standby")
	}
	return c.run(ctx, "pg_ctl", "promote", "-w", "-t", "60", "-D", c.dataDir)
}

// Kill stops the server at once (immediate mode: no shutdown checkpoint, as a crash would) and
// keeps its data directory; StartServer starts it again, through crash recovery. A standby
// started again resumes streaming from its slot.
func (c *Cluster) Kill(ctx context.Context) error {
	return c.run(ctx, "pg_ctl", "stop", "-w", "-t", "60", "-m", "immediate", "-D", c.dataDir)
}

// IsStandby reports whether c was started by StartStandby (promoted or not).
func (c *Cluster) IsStandby() bool { return c.primary != nil }

package faultsuite

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/fx"
	"go.uber.org/zap"

	"fusion/outbox"
	"fusion/outbox/internal/testhost"
)

// The child processes. The suite re-executes its own test binary with FAULTSUITE_ROLE set and
// its arguments in the JSON file FAULTSUITE_ARGS_FILE names;
// each child builds an fx app from outbox.Module and the reference host's module, like an
// engine binary, and reports through stdout lines and an append-only log file.

// roleArgs is passed to a child as JSON in the file FAULTSUITE_ARGS_FILE.
type roleArgs struct {
	Name     string   `json:"name"`     // process label, also its application_name
	DSN      string   `json:"dsn"`      // superuser DSN of the test database
	Scope    string   `json:"scope"`    // settings scope holding its identity (observers)
	Projects []string `json:"projects"` // projects to observe or delete in
	Tasks    []string `json:"tasks"`    // writer: "project/task" to delete, in order
	Rate     float64  `json:"rate"`     // writer: deletes per second
	Log      string   `json:"log"`      // append-only log of what it applied (observers) or deleted (writers)
	Failing  []string `json:"failing"`  // observer: task IDs whose events always fail
	// Through PgBouncer: DSN goes through it, ListenDSN (observers) straight to PostgreSQL.
	Pooled    bool   `json:"pooled,omitempty"`
	ListenDSN string `json:"listenDsn,omitempty"`
	// ChildSocket (observers) serves the observer's event stream to child workers there;
	// Socket and Positions (child workers) are the parent's socket and the file that keeps
	// the worker's position.
	ChildSocket string `json:"childSocket,omitempty"`
	Socket      string `json:"socket,omitempty"`
	Positions   string `json:"positions,omitempty"`
	// ReadDSN (observers) is a hot standby's DSN the consumer reads from (Config.ReadDSN),
	// with ReadMaxLag of a second so that a lagging standby is left within the run.
	ReadDSN string `json:"readDsn,omitempty"`
}

// faultConfig is the deployment config of every child: short leases and a short backoff so
// that faults play out within the run, and the default ten attempts.
func faultConfig() outbox.Config {
	return outbox.Config{
		PollInterval:      200 * time.Millisecond,
		LeaseTTL:          2 * time.Second,
		HeartbeatInterval: 500 * time.Millisecond,
		RetrySchedule:     []time.Duration{20 * time.Millisecond, 40 * time.Millisecond, 80 * time.Millisecond, 160 * time.Millisecond, 200 * time.Millisecond},
		ListenerTimeout:   5 * time.Second,
	}
}

func runRole(role string) int {
	// The stop signal's handler comes before anything else, and stays until the process exits:
	// a child told to stop at any moment (start-up included, which may wait out a PostgreSQL
	// restart) stops cleanly instead of dying of the signal's default action.
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	go func() { <-sig; stop() }()

	var args roleArgs
	b, err := os.ReadFile(os.Getenv("FAULTSUITE_ARGS_FILE"))
	if err == nil {
		err = json.Unmarshal(b, &args)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "faultsuite child: bad FAULTSUITE_ARGS_FILE:", err)
		return 2
	}
	log, _ := zap.NewDevelopment(zap.IncreaseLevel(zap.InfoLevel))
	switch role {
	case "writer":
		err = runWriter(ctx, args, log)
	case "observer":
		err = runObserver(ctx, args, log)
	case "child":
		err = runChildWorker(ctx, args, log)
	case "runtimes":
		err = runRuntimes(ctx, args, log)
	default:
		err = fmt.Errorf("unknown role %q", role)
	}
	if errors.Is(err, errStoppedStarting) {
		fmt.Fprintf(os.Stderr, "faultsuite child %s: %v\n", args.Name, err)
		return 0
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "faultsuite child %s: %v\n", args.Name, err)
		return 1
	}
	return 0
}

// withAppName tags a DSN (URL or keyword form) with application_name, so the suite can find
// a process's backends in pg_stat_activity.
func withAppName(dsn, name string) string {
	if u, err := url.Parse(dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		q := u.Query()
		q.Set("application_name", name)
		u.RawQuery = q.Encode()
		return u.String()
	}
	return dsn + " application_name=" + name
}

func hostConfig(a roleArgs) testhost.HostConfig {
	cfg := faultConfig()
	cfg.TransactionPooler = a.Pooled
	if a.ListenDSN != "" {
		cfg.ListenDSN = withAppName(a.ListenDSN, a.Name)
	}
	if a.ReadDSN != "" {
		cfg.ReadDSN, cfg.ReadMaxLag = withAppName(a.ReadDSN, a.Name), time.Second
	}
	return testhost.HostConfig{DSN: withAppName(a.DSN, a.Name), Projects: a.Projects, SettingsScope: a.Scope,
		Actor: a.Name, Outbox: cfg, SweepInterval: time.Hour, ChildSocket: a.ChildSocket}
}

// errStoppedStarting means the child was told to stop while it was starting: a clean exit.
var errStoppedStarting = errors.New("stopped during start-up")

// startApp starts app, retrying while the database is restarting: a child that happens to
// boot during a PostgreSQL restart waits for it rather than dying. ctx ends when the child is
// told to stop; start-up then gives up at once with errStoppedStarting.
func startApp(ctx context.Context, newApp func() *fx.App) (*fx.App, error) {
	deadline := time.Now().Add(60 * time.Second)
	for {
		app := newApp()
		startCtx, cancel := context.WithTimeout(ctx, 15*time.Second)
		err := app.Start(startCtx)
		cancel()
		if err == nil {
			return app, nil
		}
		stopCtx, cancelStop := context.WithTimeout(context.Background(), 5*time.Second)
		_ = app.Stop(stopCtx)
		cancelStop()
		if ctx.Err() != nil {
			return nil, errStoppedStarting
		}
		if !startRetryable(err) || time.Now().After(deadline) {
			return nil, err
		}
		select {
		case <-ctx.Done():
			return nil, errStoppedStarting
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// startRetryable reports whether a start that failed with err may succeed if tried again: the
// server could not be reached, or it (or PgBouncer in front of it) refused or dropped the
// session while the schedule restarts or terminates backends. PgBouncer refuses logins for a
// while after a failed server login (server_login_retry: SQLSTATE 08P01), an error that can
// reach the app's start through a pool without being a *pgconn.ConnectError.
func startRetryable(err error) bool {
	var connErr *pgconn.ConnectError
	if errors.As(err, &connErr) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch {
		case pgerrcode.IsConnectionException(pgErr.Code):
			return true
		case pgErr.Code == pgerrcode.AdminShutdown, pgErr.Code == pgerrcode.CrashShutdown, pgErr.Code == pgerrcode.CannotConnectNow:
			return true
		}
	}
	return false
}

// stopApp stops app within a minute: a bound for a busy machine, below the two minutes the
// suite waits for a child to exit.
func stopApp(app *fx.App) error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	return app.Stop(ctx)
}

// runWriter deletes its tasks at its rate until its list ends or it is told to stop,
// retrying a delete until it is known to be done: a delete whose commit raced a dropped
// connection is simply found already deleted. A restarted writer walks past the tasks it
// already deleted without waiting for its rate.
func runWriter(ctx context.Context, a roleArgs, log *zap.Logger) error {
	var store *testhost.Store
	app, err := startApp(ctx, func() *fx.App {
		return fx.New(outbox.Module, testhost.Module, fx.Supply(hostConfig(a), log), fx.Populate(&store), fx.NopLogger)
	})
	if err != nil {
		return err
	}
	fmt.Println("ready")
	tick := time.NewTicker(time.Duration(float64(time.Second) / a.Rate))
	defer tick.Stop()
	for _, pt := range a.Tasks {
		if ctx.Err() != nil {
			return stopApp(app) // told to stop while walking past tasks deleted before a restart
		}
		project, task := splitTask(pt)
		for {
			// Not ctx: a delete under way finishes even when the writer is told to stop.
			delCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			res, err := store.Delete(delCtx, project, task)
			cancel()
			if err == nil && !res.Deleted {
				break // deleted before: by this writer before a restart, or by another
			}
			if err != nil {
				fmt.Printf("retry %s: %v\n", pt, err)
			}
			select {
			case <-ctx.Done():
				return stopApp(app)
			case <-tick.C:
			}
			if err == nil {
				break
			}
		}
	}
	fmt.Println("done")
	<-ctx.Done()
	return stopApp(app)
}

func splitTask(pt string) (string, string) {
	for i := range len(pt) {
		if pt[i] == '/' {
			return pt[:i], pt[i+1:]
		}
	}
	return pt, ""
}

// runObserver runs a consumer whose listener is the apply log, and prints its stats.
func runObserver(ctx context.Context, a roleArgs, log *zap.Logger) error {
	al, err := testhost.OpenApplyLog(testhost.ApplyOptions{Path: a.Log, Failing: a.Failing})
	if err != nil {
		return err
	}
	defer func() { _ = al.Close() }()
	var ob *outbox.Outbox
	app, err := startApp(ctx, func() *fx.App {
		return testhost.ObserverApp(hostConfig(a), log, al, fx.Populate(&ob))
	})
	if err != nil {
		return err
	}
	c := ob.Consumer()
	if c == nil {
		return fmt.Errorf("observer has no consumer (state %s)", ob.State())
	}
	fmt.Printf("ready %s\n", c.LeaseOwner())
	done := make(chan struct{})
	go func() {
		t := time.NewTicker(250 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				b, _ := json.Marshal(c.Stats())
				fmt.Printf("stats %s\n", b)
			}
		}
	}()
	<-ctx.Done()
	close(done)
	return stopApp(app)
}

// runChildWorker follows its parent observer's stream over the parent's unix socket, applying
// each event to its log, until it is told to stop.
func runChildWorker(ctx context.Context, a roleArgs, log *zap.Logger) error {
	al, err := testhost.OpenApplyLog(testhost.ApplyOptions{Path: a.Log})
	if err != nil {
		return err
	}
	defer func() { _ = al.Close() }()
	return testhost.RunWorker(ctx, testhost.WorkerOptions{Socket: a.Socket, Positions: a.Positions, Log: al,
		Logger: log.With(zap.String("process", a.Name)), Ready: func() { fmt.Println("ready") }})
}

// runRuntimes is an engine whose project manager starts and stops per-project runtimes while
// it runs, as told by lines on its stdin ("add <project>", "remove <project>"; it answers
// "added <project>" and "removed <project>"). Each project's runtime applies to a log of its
// own, <Log>.<project>, so the suite sees which runtime got what.
func runRuntimes(ctx context.Context, a roleArgs, log *zap.Logger) error {
	runtimes := outbox.NewProjectRuntimes(outbox.ProjectRuntimesOptions{Logger: log})
	var store *testhost.Store
	app, err := startApp(ctx, func() *fx.App {
		return fx.New(outbox.Module, testhost.Module, fx.Supply(hostConfig(a), log),
			fx.Decorate(func(outbox.Projects) outbox.Projects { return runtimes }),
			fx.Provide(outbox.AsListener(func() *outbox.ProjectRuntimes { return runtimes })),
			fx.Populate(&store), fx.NopLogger)
	})
	if err != nil {
		return err
	}
	fmt.Println("ready")
	logs := map[string]*testhost.ApplyLog{}
	defer func() {
		for _, l := range logs {
			_ = l.Close()
		}
	}()
	lines := make(chan string)
	go func() {
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	for {
		var line string
		var open bool
		select {
		case <-ctx.Done():
			return stopApp(app)
		case line, open = <-lines:
		}
		if !open {
			<-ctx.Done()
			return stopApp(app)
		}
		verb, project, _ := strings.Cut(line, " ")
		switch verb {
		case "add":
			l := logs[project]
			if l == nil {
				if l, err = testhost.OpenApplyLog(testhost.ApplyOptions{Path: a.Log + "." + project}); err != nil {
					return err
				}
				l.UseStore(store)
				logs[project] = l
			}
			err = runtimes.Add(ctx, project, l)
		case "remove":
			err = runtimes.Remove(ctx, project)
		default:
			err = fmt.Errorf("unknown command %q", line)
		}
		if err != nil {
			return fmt.Errorf("%s: %w", line, err)
		}
		fmt.Printf("%sed %s\n", strings.TrimSuffix(verb, "e"), project)
	}
}

// shuffle is deterministic for a seed.
func shuffle(r *rand.Rand, s []string) {
	r.Shuffle(len(s), func(i, j int) { s[i], s[j] = s[j], s[i] })
}

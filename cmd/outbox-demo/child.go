package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"go.uber.org/fx"
	"go.uber.org/zap"

	"fusion/outbox"
	"fusion/outbox/internal/testhost"
	"fusion/outbox/web"
)

// The child processes are engine binaries in miniature: each builds its fx app from
// outbox.Module and the reference host's module, exactly as a real deployment would.

// demoOutbox is the demo's deployment configuration: a short backoff so that a poison event is
// parked in seconds, not hours.
func demoOutbox() outbox.Config {
	return outbox.Config{
		PollInterval:      250 * time.Millisecond,
		LeaseTTL:          3 * time.Second,
		HeartbeatInterval: time.Second,
		RetrySchedule:     []time.Duration{200 * time.Millisecond, 400 * time.Millisecond, 800 * time.Millisecond},
		MaxAttempts:       4,
	}
}

func runChild(args []string) error {
	// The stop signal's handler comes before anything else and stays until the process exits:
	// a child told to stop while it is still starting stops cleanly instead of dying of the
	// signal's default action.
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	go func() { <-sig; stop() }()

	if len(args) == 0 {
		return errors.New("child: missing role")
	}
	fs := flag.NewFlagSet("child", flag.ContinueOnError)
	dsn := fs.String("dsn", "", "database")
	projects := fs.String("projects", "alpha,beta", "projects")
	scope := fs.String("scope", "", "settings scope (holds this node's persisted identity)")
	httpAddr := fs.String("http", "", "serve /events, /ops/ and /metrics here")
	applied := fs.String("applied-log", "", "observer: durable log of applied events")
	poison := fs.String("poison", "", "observer: project/task whose event fails until -fixed exists")
	fixed := fs.String("fixed", "", "observer: marker file that means the failing listener was fixed")
	count := fs.Int("count", 300, "writer: tasks to delete per project")
	rate := fs.Float64("rate", 20, "writer: deletes per second")
	childSocket := fs.String("child-socket", "", "observer: serve the event stream to child workers on this unix socket")
	socket := fs.String("socket", "", "worker: the parent's child socket")
	positions := fs.String("positions", "", "worker: the file that keeps the worker's position")
	if err := fs.Parse(args[1:]); err != nil {
		return err
	}
	log, err := zap.NewDevelopment()
	if err != nil {
		return err
	}
	defer func() { _ = log.Sync() }()
	host := testhost.HostConfig{DSN: *dsn, Projects: strings.Split(*projects, ","), SettingsScope: *scope,
		HTTPAddr: *httpAddr, ChildSocket: *childSocket, Actor: args[0] + ":" + *scope, Outbox: demoOutbox(),
		SSE: web.SSEOptions{Retry: 500 * time.Millisecond}, OpsAuthorize: loopbackOnly}

	switch args[0] {
	case "writer":
		return runWriter(ctx, host, log, *count, *rate)
	case "observer":
		al, err := testhost.OpenApplyLog(testhost.ApplyOptions{Path: *applied, Poison: *poison, Fixed: *fixed, Progress: true})
		if err != nil {
			return err
		}
		defer func() { _ = al.Close() }()
		return runObserver(ctx, host, log, al)
	case "worker":
		al, err := testhost.OpenApplyLog(testhost.ApplyOptions{Path: *applied, Progress: true})
		if err != nil {
			return err
		}
		defer func() { _ = al.Close() }()
		return testhost.RunWorker(ctx, testhost.WorkerOptions{Socket: *socket, Positions: *positions, Log: al, Logger: log,
			Ready: func() { fmt.Printf("ready: following the parent's stream on %s\n", *socket) }})
	}
	return fmt.Errorf("child: unknown role %q", args[0])
}

// startApp starts app within 30s; when ctx ends first (the child was told to stop) it undoes
// what started and reports stopped.
func startApp(ctx context.Context, app *fx.App) (stopped bool, err error) {
	startCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	err = app.Start(startCtx)
	if err == nil {
		return false, nil
	}
	if ctx.Err() != nil {
		return true, stopApp(app)
	}
	return false, err
}

func stopApp(app *fx.App) error {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	return app.Stop(ctx)
}

// loopbackOnly lets the operations page's buttons work for requests from this machine only,
// audited as one local operator: the demo's stand-in for a host's own authentication, which a
// real host must have (and which would name the signed-in user).
func loopbackOnly(r *http.Request, _ web.OpsAction) (string, bool) {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return "", false
	}
	ip := net.ParseIP(host)
	return "demo-operator@localhost", ip != nil && ip.IsLoopback()
}

func runObserver(ctx context.Context, host testhost.HostConfig, log *zap.Logger, al *testhost.ApplyLog) error {
	var ob *outbox.Outbox
	app := testhost.ObserverApp(host, log, al, fx.Populate(&ob))
	if stopped, err := startApp(ctx, app); stopped || err != nil {
		return err
	}
	fmt.Printf("ready: observing as %s (state %s)\n", host.SettingsScope, ob.State())
	<-ctx.Done()
	return stopApp(app)
}

func runWriter(ctx context.Context, host testhost.HostConfig, log *zap.Logger, count int, rate float64) error {
	var store *testhost.Store
	var ob *outbox.Outbox
	app := fx.New(outbox.Module, testhost.Module, fx.Supply(host, log), fx.Populate(&store, &ob), fx.NopLogger)
	if stopped, err := startApp(ctx, app); stopped || err != nil {
		return err
	}
	fmt.Printf("ready: writing (consumer state %s)\n", ob.State())
	tick := time.NewTicker(time.Duration(float64(time.Second) / rate))
	defer tick.Stop()
	total := count * len(host.Projects)
	done := 0
	for i := 1; i <= count; i++ {
		for _, p := range host.Projects {
			select {
			case <-ctx.Done():
				return stopApp(app)
			case <-tick.C:
			}
			if _, err := store.Delete(context.Background(), p, fmt.Sprintf("t-%d", i)); err != nil {
				return fmt.Errorf("delete %s/t-%d: %w", p, i, err)
			}
			if done++; done%100 == 0 || done == total {
				fmt.Printf("deleted %d/%d\n", done, total)
			}
		}
	}
	return stopApp(app)
}

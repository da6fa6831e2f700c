package taskstore

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/fx"
	"go.uber.org/zap"

	"fusion/outbox"
	"fusion/outbox/web"
)

// HostConfig is the reference host's per-deployment configuration.
type HostConfig struct {
	// DSN of the shared database.
	DSN string
	// Projects this process observes.
	Projects []string
	// SettingsScope selects this node's persisted settings (where outbox.consumer_id lives).
	SettingsScope string
	// HTTPAddr serves /events (SSE), /ops/ (the operations page), /metrics and /healthz when
	// set, e.g. "127.0.0.1:8080".
	HTTPAddr string
	// ChildSocket, when set, serves the event stream at /events on a unix socket at this path
	// that only this OS user can open, for the host's child workers: each follows it with
	// web.StreamClient and resumes from the position it keeps itself (see the README's
	// "Following a stream"). The socket file is replaced when stale and removed at stop.
	ChildSocket string
	// SSE configures the event stream at /events: its limits, its Authorize hook. The host
	// fills in the pool, the projects (Projects above, unless set) and the logger.
	SSE web.SSEOptions
	// OpsAuthorize, when set, enables the replay and retire buttons of the operations page:
	// it returns who the signed-in operator is (the actor the action is audited under) and
	// whether they may do it. This reference host has no authentication of its own (nor would
	// a real host's HTTP surface be open like this one): a real host mounts /events and /ops/
	// behind its own and decides here what an authenticated operator may do. The page shows
	// only the projects SSE.Authorize allows the request, as the stream does.
	OpsAuthorize func(r *http.Request, a web.OpsAction) (actor string, ok bool)
	// SweepInterval is the self-healing schedule. Defaults to 10m.
	SweepInterval time.Duration
	// Actor names this process in audit rows.
	Actor string
	// Outbox is the module's per-deployment configuration.
	Outbox outbox.Config
}

// Module is the reference host's fx wiring. An engine binary composes itself as
//
//	fx.New(outbox.Module, taskstore.Module, fx.Supply(cfg))
//
// The host owns the pool, the registry, the settings and its seams; the outbox module
// provides the writer hook, the dispatcher, the Outbox that runs the consumer and the retention
// task.
var Module = fx.Module("taskstore",
	fx.Provide(
		newPool,
		func(c HostConfig) outbox.Config { return c.Outbox },
		func(c HostConfig) outbox.Projects { return outbox.StaticProjects(c.Projects) },
		func(pool *pgxpool.Pool, c HostConfig) outbox.Settings { return NewSettings(pool, c.SettingsScope) },
		NewCache,
		func(c *Cache) outbox.TaskCache { return c },
		newStore,
		func(s *Store) outbox.LiveTasks { return s },
		func(s *Store) outbox.AuditSink { return s },
		newRegistry,
		func(r *prometheus.Registry) prometheus.Registerer { return r },
		newSSE,
		outbox.AsListener(func(h *web.SSEHandler) *web.SSEHandler { return h }),
		outbox.AsListener(NewBusBridge),
		newSelfHealing,
	),
	fx.Invoke(
		func(*SelfHealing) {},
		serveHTTP,
		serveChildren,
	),
)

func newPool(lc fx.Lifecycle, c HostConfig) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(c.DSN)
	if err != nil {
		// Not %w: pgx's message can repeat part of a password.
		return nil, fmt.Errorf("database DSN does not parse: %s", outbox.DSNParseReason(err))
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		return nil, fmt.Errorf("open pool: %w", err)
	}
	lc.Append(fx.Hook{
		OnStart: func(ctx context.Context) error { return pool.Ping(ctx) },
		OnStop:  func(context.Context) error { pool.Close(); return nil },
	})
	return pool, nil
}

// newStore builds the store with the outbox writer hook (the module provides the writer on
// its own, from the pool and the config, so the store takes it here while the rest of the
// module takes the store as its cache, live-task source and audit sink) and loads its cache at
// open, before the outbox consumer starts (this hook is registered first because the
// Outbox depends on the store).
func newStore(lc fx.Lifecycle, pool *pgxpool.Pool, cache *Cache, writer *outbox.Writer, c HostConfig, log *zap.Logger) *Store {
	s := New(pool, Options{Writer: writer, Cache: cache, Logger: log, Actor: c.Actor})
	lc.Append(fx.Hook{OnStart: func(ctx context.Context) error { return s.LoadCache(ctx, c.Projects...) }})
	return s
}

func newRegistry() *prometheus.Registry {
	r := prometheus.NewRegistry()
	r.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return r
}

type selfHealingParams struct {
	fx.In
	Lifecycle fx.Lifecycle
	Config    HostConfig
	Logger    *zap.Logger
	Tasks     []outbox.MaintenanceTask `group:"maintenance"`
}

// newSelfHealing runs every maintenance task when the store opens and then on schedule.
func newSelfHealing(p selfHealingParams) *SelfHealing {
	m := NewSelfHealing(p.Tasks, p.Config.SweepInterval, p.Logger)
	p.Lifecycle.Append(fx.Hook{
		OnStart: m.Start,
		OnStop:  m.Stop,
	})
	return m
}

// NewBusBridge forwards observed events to the store's event bus with the payload shape of
// the local task:deleted event, marked observed, so the host's existing listeners (runtime
// forwarding, project manager, scheduler) hear other processes' deletions too.
func NewBusBridge(s *Store) outbox.Listener {
	return outbox.ListenerFunc("bus-bridge", func(ctx context.Context, ev outbox.ObservedEvent) error {
		s.Emitter().Emit(ctx, TaskDeleted{
			ProjectID: ev.ProjectID, TaskID: ev.TaskID, DeletedAt: ev.DeletedAt, Column: ev.PriorColumn,
			Archived: ev.Archived, EventID: ev.EventID, OriginProcessID: ev.WriterProcessID, Observed: true,
		})
		return nil
	})
}

// newSSE builds the event stream on the host's pool, projects and logger.
func newSSE(pool *pgxpool.Pool, c HostConfig, projects outbox.Projects, log *zap.Logger) (*web.SSEHandler, error) {
	o := c.SSE
	o.Pool = pool
	if o.Projects == nil {
		o.Projects = projects
	}
	if o.Logger == nil {
		o.Logger = log
	}
	return web.NewSSEHandler(o)
}

// serveHTTP serves the event stream, the operations page, the metrics and a health check
// when HTTPAddr is set.
func serveHTTP(lc fx.Lifecycle, c HostConfig, sse *web.SSEHandler, admin *outbox.Admin, reg *prometheus.Registry, ob *outbox.Outbox, log *zap.Logger) error {
	if c.HTTPAddr == "" {
		return nil
	}
	ops, err := web.OpsHandler(admin, web.OpsOptions{EventsURL: "/events", Authorize: c.SSE.Authorize,
		AuthorizeAction: c.OpsAuthorize, Logger: log})
	if err != nil {
		return err
	}
	mux := http.NewServeMux()
	mux.Handle("/events", sse)
	mux.Handle("/ops/", http.StripPrefix("/ops", ops))
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintf(w, "ok %s\n", ob.State())
	})
	// Header and idle timeouts bound what a client that opens connections and sends nothing
	// costs. No write timeout: event streams are long-lived, and the SSE handler bounds each
	// write of its own.
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, IdleTimeout: 2 * time.Minute, MaxHeaderBytes: 64 << 10}
	lc.Append(fx.Hook{
		OnStart: func(context.Context) error {
			ln, err := net.Listen("tcp", c.HTTPAddr)
			if err != nil {
				return fmt.Errorf("listen on %s: %w", c.HTTPAddr, err)
			}
			go func() {
				if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
					log.Error("http server stopped", zap.Error(err))
				}
			}()
			log.Info("serving /events, /ops/, /metrics and /healthz", zap.String("addr", ln.Addr().String()))
			return nil
		},
		OnStop: func(ctx context.Context) error {
			// Shutdown closes the listener first and then ends the event streams, so that a
			// browser reconnecting meanwhile finds no listener (and retries) rather than a
			// closing stream handler.
			srv.RegisterOnShutdown(sse.Close)
			return srv.Shutdown(ctx)
		},
	})
	return nil
}

// serveChildren serves the event stream to child workers on ChildSocket when it is set. The
// children get what the browsers get: the same frames, positions and resets, so a child
// that restarts, or outlives a restart of this process, resumes with its last position. A
// slow child costs this process what a slow browser does: a bounded write, then it
// reconnects and replays.
func serveChildren(lc fx.Lifecycle, c HostConfig, sse *web.SSEHandler, log *zap.Logger) {
	if c.ChildSocket == "" {
		return
	}
	mux := http.NewServeMux()
	mux.Handle("/events", sse)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second, IdleTimeout: 2 * time.Minute, MaxHeaderBytes: 64 << 10}
	lc.Append(fx.Hook{
		OnStart: func(context.Context) error {
			ln, err := web.ListenUnix(c.ChildSocket)
			if err != nil {
				return fmt.Errorf("child socket: %w", err)
			}
			go func() {
				if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
					log.Error("child socket server stopped", zap.Error(err))
				}
			}()
			log.Info("serving /events to child workers", zap.String("socket", c.ChildSocket))
			return nil
		},
		OnStop: func(ctx context.Context) error {
			srv.RegisterOnShutdown(sse.Close)
			return srv.Shutdown(ctx)
		},
	})
}

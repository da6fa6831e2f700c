package outbox

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/fx"
	"go.uber.org/zap"
)

// Value group names. Hosts add observed listeners with AsListener and collect maintenance
// tasks (the module contributes its retention sweep) with `group:"maintenance"`.
const (
	ListenersGroup   = "outbox_listeners"
	MaintenanceGroup = "maintenance"
)

// Module wires the outbox into a host's fx graph. It is glue over New: it provides the writer
// hook on its own (it needs only the pool, the Config and the logger, so a host's store can
// take the writer in its constructor), then builds the rest with New from what the host owns
// (the pool, optionally per-component pools, the logger, the Config, the settings, cache,
// live-task, audit and project seams, a Prometheus registerer, a tracer provider, and
// listeners in the "outbox_listeners" group), and runs it on the fx lifecycle. It provides the
// *Outbox (which starts and stops with the fx lifecycle, and says what it decided with State),
// the writer, the dispatcher, the retention sweep (also contributed to the "maintenance" group)
// and the admin calls.
var Module = fx.Module("outbox",
	fx.Provide(provideWriter, provide),
	// The composition root must exist for the consumer to start even when nothing else asks
	// for it.
	fx.Invoke(func(*Outbox) {}),
)

// AsListener annotates a constructor of an observed listener so that it joins the module's
// listener group: fx.Provide(outbox.AsListener(NewDashboardRefresher)).
func AsListener(ctor any) any {
	return fx.Annotate(ctor, fx.As(new(Listener)), fx.ResultTags(`group:"`+ListenersGroup+`"`))
}

// ProvideProjectRuntimes provides, for a host whose project manager starts and stops
// per-project runtimes while it runs, one *ProjectRuntimes (with the graph's logger, if any)
// and makes it both the module's Projects seam and one of its listeners; the module gives it
// the Outbox's RefreshProjects when it builds the Outbox. The project manager takes
// *outbox.ProjectRuntimes and calls Add and Remove. A host that provides a ProjectRuntimes of
// its own does the same with fx.Provide(func(p *ProjectRuntimes) outbox.Projects { return p })
// and outbox.AsListener(func(p *ProjectRuntimes) *ProjectRuntimes { return p }).
var ProvideProjectRuntimes = fx.Provide(
	func(p projectRuntimesParams) *ProjectRuntimes {
		return NewProjectRuntimes(ProjectRuntimesOptions{Logger: p.Logger})
	},
	func(p *ProjectRuntimes) Projects { return p },
	AsListener(func(p *ProjectRuntimes) *ProjectRuntimes { return p }),
)

// projectRuntimesParams is what ProvideProjectRuntimes takes from the graph.
type projectRuntimesParams struct {
	fx.In

	Logger *zap.Logger `optional:"true"`
}

// WriterParams is what the writer takes from the host's graph.
type WriterParams struct {
	fx.In

	Pool   *pgxpool.Pool
	Config Config      `optional:"true"`
	Logger *zap.Logger `optional:"true"`
	// TracerProvider turns tracing on when Config.TracerProvider is not set.
	TracerProvider trace.TracerProvider `optional:"true"`
}

// provideWriter builds the writer and hands the rest of the module the Config it validated:
// the module applies the Config's defaults and validates it once, here.
func provideWriter(p WriterParams) (*Writer, moduleConfig, error) {
	cfg, err := validConfig(graphConfig(p.Config, p.TracerProvider))
	if err != nil {
		return nil, moduleConfig{}, err
	}
	if err := checkPooledDB(cfg, p.Pool); err != nil {
		return nil, moduleConfig{}, err
	}
	w, err := newWriter(p.Pool, cfg.writerOptions(), p.Logger)
	if err != nil {
		return nil, moduleConfig{}, err
	}
	return w, moduleConfig{cfg}, nil
}

// moduleConfig is the module's Config, defaults applied and validated, which the writer's
// provider gives New's.
type moduleConfig struct{ cfg Config }

// graphConfig is the Config the module's parts get: the host's, with the graph's tracer
// provider when the Config names none.
func graphConfig(cfg Config, tp trace.TracerProvider) Config {
	if cfg.TracerProvider == nil {
		cfg.TracerProvider = tp
	}
	return cfg
}

// Params is what the module takes from the host's graph besides the writer and the Config
// (WriterParams). Only the pool is required.
type Params struct {
	fx.In

	Lifecycle fx.Lifecycle
	Writer    *Writer
	// Pool is the host's pool: the writer's wake-ups use it, and every other part unless the
	// host gives it a pool of its own below.
	Pool *pgxpool.Pool
	// ConsumerPool, when the host provides one named "outbox_consumer", is Deps.ConsumerPool.
	ConsumerPool *pgxpool.Pool `name:"outbox_consumer" optional:"true"`
	// OperatorPool, when the host provides one named "outbox_operator", is Deps.OperatorPool.
	OperatorPool *pgxpool.Pool         `name:"outbox_operator" optional:"true"`
	Logger       *zap.Logger           `optional:"true"`
	Settings     Settings              `optional:"true"`
	Cache        TaskCache             `optional:"true"`
	LiveTasks    LiveTasks             `optional:"true"`
	Audit        AuditSink             `optional:"true"`
	Projects     Projects              `optional:"true"`
	Registerer   prometheus.Registerer `optional:"true"`
	Listeners    []Listener            `group:"outbox_listeners"`
}

// Result is what the module gives the host's graph.
type Result struct {
	fx.Out

	Outbox     *Outbox
	Dispatcher *Dispatcher
	Retention  *Retention
	Admin      *Admin
	// Tasks holds the retention sweep, or nothing when the module is disabled.
	Tasks []MaintenanceTask `group:"maintenance,flatten"`
}

func provide(p Params, cfg moduleConfig) (Result, error) {
	o, err := build(p.Pool, cfg.cfg, Deps{
		ConsumerPool: p.ConsumerPool, OperatorPool: p.OperatorPool, Logger: p.Logger, Settings: p.Settings,
		Cache: p.Cache, LiveTasks: p.LiveTasks, Audit: p.Audit, Projects: p.Projects, Registerer: p.Registerer,
		Listeners: p.Listeners, Writer: p.Writer,
	})
	if err != nil {
		return Result{}, err
	}
	// Both bounded by fx's stop context: the consumer first, then the writer's wake-ups.
	p.Lifecycle.Append(fx.Hook{OnStart: o.Start, OnStop: func(ctx context.Context) error { return o.Stop(ctx) }})
	return Result{Outbox: o, Dispatcher: o.Dispatcher(), Retention: o.Retention(), Admin: o.Admin(),
		Tasks: o.MaintenanceTasks()}, nil
}

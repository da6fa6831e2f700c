package outbox

import (
	"context"
	"errors"
	"fmt"
	"sync"

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

// Module wires the outbox into a host's fx graph. It consumes what the host owns (the pool,
// optionally the logger, the Config, the settings, cache, live-task, audit and project seams,
// a Prometheus registerer, and listeners in the "outbox_listeners" group) and provides the
// writer hook, the dispatcher, the consumer runner, the retention sweep (also contributed to
// the "maintenance" group) and the admin calls. Every piece is built by the plain
// constructors, so the module is usable without fx.
var Module = fx.Module("outbox",
	fx.Provide(provide),
	// The runner must exist for the consumer to start even when nothing else asks for it.
	fx.Invoke(func(*Runner) {}),
)

// AsListener annotates a constructor of an observed listener so that it joins the module's
// listener group: fx.Provide(outbox.AsListener(NewDashboardRefresher)).
func AsListener(ctor any) any {
	return fx.Annotate(ctor, fx.As(new(Listener)), fx.ResultTags(`group:"`+ListenersGroup+`"`))
}

// Params is what the module takes from the host's graph. Only the pool is required.
type Params struct {
	fx.In

	Lifecycle fx.Lifecycle
	// Pool is the host's pool: the writer's wake-ups use it, and every other part unless the
	// host gives it a pool of its own below.
	Pool *pgxpool.Pool
	// ConsumerPool, when the host provides one named "outbox_consumer", is the consumer's pool,
	// logged in as a role granted with GrantConsumerRole.
	ConsumerPool *pgxpool.Pool `name:"outbox_consumer" optional:"true"`
	// OperatorPool, when the host provides one named "outbox_operator", is the pool of the
	// retention sweep and the admin calls, logged in as a role granted with GrantOperatorRole.
	// Without these two, Pool's role needs the privileges of all three (GrantRuntimeRole).
	OperatorPool *pgxpool.Pool         `name:"outbox_operator" optional:"true"`
	Config       Config                `optional:"true"`
	Logger       *zap.Logger           `optional:"true"`
	Settings     Settings              `optional:"true"`
	Cache        TaskCache             `optional:"true"`
	LiveTasks    LiveTasks             `optional:"true"`
	Audit        AuditSink             `optional:"true"`
	Projects     Projects              `optional:"true"`
	Registerer   prometheus.Registerer `optional:"true"`
	// TracerProvider turns tracing on when Config.TracerProvider is not set.
	TracerProvider trace.TracerProvider `optional:"true"`
	Listeners      []Listener           `group:"outbox_listeners"`
}

// Result is what the module gives the host's graph.
type Result struct {
	fx.Out

	Writer     *Writer
	Dispatcher *Dispatcher
	Runner     *Runner
	Retention  *Retention
	Admin      *Admin
	// Tasks holds the retention sweep, or nothing when the module is disabled.
	Tasks []MaintenanceTask `group:"maintenance,flatten"`
}

func provide(p Params) (Result, error) {
	cfg := p.Config.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return Result{}, err
	}
	if cfg.TracerProvider == nil {
		cfg.TracerProvider = p.TracerProvider
	}
	log := p.Logger
	if log == nil {
		log = zap.NewNop()
	}
	var metrics *Metrics
	if p.Registerer != nil && !cfg.Disabled {
		m, err := NewMetrics(p.Registerer)
		if err != nil {
			return Result{}, err
		}
		metrics = m
	}
	audit := p.Audit
	if audit == nil {
		audit = TableAuditSink{}
	}
	writer, err := NewWriter(p.Pool, cfg, log)
	if err != nil {
		return Result{}, err
	}
	dispatcher := NewDispatcher(DispatcherOptions{Listeners: p.Listeners, Cache: p.Cache,
		SelfWriterID: writer.ProcessID(), Timeout: cfg.ListenerTimeout, Logger: log})
	consumerPool, operatorPool := p.Pool, p.Pool
	if p.ConsumerPool != nil {
		consumerPool = p.ConsumerPool
	}
	if p.OperatorPool != nil {
		operatorPool = p.OperatorPool
	}
	retention, err := NewRetention(operatorPool, cfg, log, metrics)
	if err != nil {
		return Result{}, err
	}
	runner := &Runner{
		pool: p.Pool, cfg: cfg, log: log.Named("outbox"), settings: p.Settings, projects: p.Projects,
		opts: ConsumerOptions{Pool: consumerPool, Config: cfg, Projects: p.Projects, Dispatcher: dispatcher,
			LiveTasks: p.LiveTasks, Cache: p.Cache, Audit: audit, Metrics: metrics, Logger: log},
	}
	p.Lifecycle.Append(fx.Hook{
		OnStart: runner.Start,
		// Both bounded by fx's stop context: the consumer first, then the writer's wake-ups.
		OnStop: func(ctx context.Context) error {
			return errors.Join(runner.Stop(ctx), writer.Close(ctx))
		},
	})
	res := Result{Writer: writer, Dispatcher: dispatcher, Runner: runner, Retention: retention,
		Admin: NewAdmin(operatorPool, AdminOptions{Audit: audit, Clock: cfg.Clock, Logger: log,
			LockTimeout: cfg.LockTimeout, StatementTimeout: cfg.StatementTimeout})}
	if !cfg.Disabled {
		res.Tasks = []MaintenanceTask{retention.Task()}
	}
	return res, nil
}

// RunnerState says what the runner decided at start.
type RunnerState string

// Runner states.
const (
	StateNotStarted       RunnerState = "not-started"
	StateDisabled         RunnerState = "disabled"          // Config.Disabled
	StateConsumerDisabled RunnerState = "consumer-disabled" // Config.ConsumerDisabled
	StateNoIdentity       RunnerState = "no-identity"       // the identity setting is absent or empty
	StateNoProjects       RunnerState = "no-projects"       // the host provides no project set
	StateRunning          RunnerState = "running"
	StateStopped          RunnerState = "stopped"
)

// Runner decides at start whether this process observes (enabled, a durable identity in the
// named setting, projects to observe) and then runs the consumer. Without fx, build a Consumer
// directly instead.
type Runner struct {
	pool     *pgxpool.Pool
	cfg      Config
	log      *zap.Logger
	settings Settings
	projects Projects
	opts     ConsumerOptions

	mu       sync.Mutex // guards state and consumer: health handlers read them
	state    RunnerState
	consumer *Consumer
}

// State is the runner's decision.
func (r *Runner) State() RunnerState {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.state == "" {
		return StateNotStarted
	}
	return r.state
}

// Consumer is the running consumer, or nil when observation is off.
func (r *Runner) Consumer() *Consumer {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.consumer
}

func (r *Runner) set(state RunnerState, c *Consumer) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.state, r.consumer = state, c
}

// Start verifies (or, with AutoMigrate, applies) the schema, resolves the identity and starts
// the consumer. It returns quickly: delivery runs on the consumer's own goroutines.
func (r *Runner) Start(ctx context.Context) error {
	if r.cfg.Disabled {
		r.set(StateDisabled, nil)
		r.log.Info("outbox disabled by configuration: the writer hook records nothing and no consumer runs")
		return nil
	}
	if r.cfg.AutoMigrate {
		if _, err := Migrate(ctx, r.pool); err != nil {
			return err
		}
	}
	if err := VerifySchema(ctx, r.pool); err != nil {
		if errors.Is(err, ErrSchemaBehind) {
			return fmt.Errorf("%w (apply the migrations with outboxctl migrate, or set AutoMigrate)", err)
		}
		return err
	}
	switch {
	case r.cfg.ConsumerDisabled:
		r.set(StateConsumerDisabled, nil)
		r.log.Info("outbox consumer disabled by configuration; the writer hook records events")
		return nil
	case r.projects == nil:
		r.set(StateNoProjects, nil)
		r.log.Info("observation disabled: the host provides no project set to observe")
		return nil
	}
	id, ok, err := ResolveConsumerID(ctx, r.settings, r.cfg.IdentityField)
	if err != nil {
		return err
	}
	if !ok {
		r.set(StateNoIdentity, nil)
		r.log.Info("observation disabled: no durable consumer identity; set the persisted setting to enable it",
			zap.String("setting", r.cfg.IdentityField))
		return nil
	}
	opts := r.opts
	opts.ID = id
	c, err := NewConsumer(opts)
	if err != nil {
		return err
	}
	if err := c.Start(ctx); err != nil {
		return err
	}
	r.set(StateRunning, c)
	return nil
}

// Stop stops the consumer, bounded by ctx.
func (r *Runner) Stop(ctx context.Context) error {
	c := r.Consumer()
	if c == nil {
		return nil
	}
	r.set(StateStopped, c)
	return c.Stop(ctx)
}

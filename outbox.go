package outbox

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"fusion/outbox/startstop"
)

// Deps are what a host gives the composition root besides its pool and Config: its seams
// (seams.go), its listeners and, optionally, pools of their own for the consumer and the
// operator calls. Every field is optional.
type Deps struct {
	// ConsumerPool is the consumer's pool, logged in as a role granted with GrantConsumerRole.
	// Defaults to the main pool.
	ConsumerPool *pgxpool.Pool
	// OperatorPool is the pool of the retention sweep and the admin calls, logged in as a role
	// granted with GrantOperatorRole. Defaults to the main pool; without these two, the main
	// pool's role needs the grants of all three components, and with the operator's it acts for
	// every consumer identity: give each component its own role and pool instead.
	OperatorPool *pgxpool.Pool
	// Logger defaults to a no-op logger.
	Logger *zap.Logger
	// Settings holds the persisted setting Config.IdentityField names. Without it (or without
	// the setting) the process observes nothing.
	Settings Settings
	// Cache is the host's live-task cache.
	Cache TaskCache
	// LiveTasks reads live tasks for reconciliation.
	LiveTasks LiveTasks
	// Audit writes the module's audit rows. Defaults to TableAuditSink.
	Audit AuditSink
	// Projects says which projects this process observes. Without it the process observes
	// nothing. When it is a ProjectsRefresher (ProjectRuntimes is), New gives it the Outbox's
	// RefreshProjects.
	Projects Projects
	// Registerer, when set, receives the module's Prometheus metrics.
	Registerer prometheus.Registerer
	// Listeners are the host's observed-safe listeners.
	Listeners []Listener
	// Writer is a writer the host built already with NewWriter on the same pool and Config
	// (the fx module does, so that a host's store can take the writer in its constructor).
	// Defaults to one New builds.
	Writer *Writer
}

// Outbox is the composition root: the writer hook, the dispatcher, the consumer runner, the
// retention sweep and the admin calls, built from one Config and the host's seams by New. Start
// and Stop run it; the fx Module is glue over it.
type Outbox struct {
	writer     *Writer
	dispatcher *Dispatcher
	runner     *Runner
	retention  *Retention
	admin      *Admin
	metrics    *Metrics
	disabled   bool
}

// New builds every part of the module from cfg (defaults applied, then validated) and deps,
// as the fx Module does: the writer on pool (or deps.Writer), a dispatcher that knows the
// writer's process ID (SelfWriterID) and applies Config.ListenerTimeout, the consumer runner,
// the retention sweep and the admin calls on the operator pool, and metrics when deps has a
// Registerer. It does not touch the database: Start does.
//
// The schema must be migrated before Start (outboxctl migrate, or Migrate), unless
// Config.AutoMigrate is set.
func New(pool *pgxpool.Pool, cfg Config, deps Deps) (*Outbox, error) {
	if pool == nil {
		return nil, invalid("New.pool", "is nil: New needs the host's pool")
	}
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	log := deps.Logger
	if log == nil {
		log = zap.NewNop()
	}
	var metrics *Metrics
	if deps.Registerer != nil && !cfg.Disabled {
		m, err := NewMetrics(deps.Registerer)
		if err != nil {
			return nil, err
		}
		metrics = m
	}
	audit := deps.Audit
	if audit == nil {
		audit = TableAuditSink{}
	}
	writer := deps.Writer
	if writer == nil {
		w, err := NewWriter(pool, cfg, log)
		if err != nil {
			return nil, err
		}
		writer = w
	}
	dispatcher := NewDispatcher(DispatcherOptions{Listeners: deps.Listeners, Cache: deps.Cache,
		SelfWriterID: writer.ProcessID(), Timeout: cfg.ListenerTimeout, Logger: log})
	consumerPool, operatorPool := pool, pool
	if deps.ConsumerPool != nil {
		consumerPool = deps.ConsumerPool
	}
	if deps.OperatorPool != nil {
		operatorPool = deps.OperatorPool
	}
	retention, err := NewRetention(operatorPool, cfg, log, metrics)
	if err != nil {
		return nil, err
	}
	runner := &Runner{
		pool: pool, cfg: cfg, log: log.Named("outbox"), settings: deps.Settings, projects: deps.Projects,
		opts: ConsumerOptions{Pool: consumerPool, Config: cfg, Projects: deps.Projects, Dispatcher: dispatcher,
			LiveTasks: deps.LiveTasks, Cache: deps.Cache, Audit: audit, Metrics: metrics, Logger: log},
	}
	o := &Outbox{writer: writer, dispatcher: dispatcher, runner: runner, retention: retention, metrics: metrics,
		admin: NewAdmin(operatorPool, AdminOptions{Audit: audit, Clock: cfg.Clock, Logger: log,
			LockTimeout: cfg.LockTimeout, StatementTimeout: cfg.StatementTimeout, TickChannel: cfg.TickChannel}),
		disabled: cfg.Disabled}
	if r, ok := deps.Projects.(ProjectsRefresher); ok {
		r.SetRefresher(o.RefreshProjects)
	}
	return o, nil
}

// Writer is the writer hook the host's delete transaction calls.
func (o *Outbox) Writer() *Writer { return o.writer }

// Dispatcher is the dispatcher the consumer hands events to.
func (o *Outbox) Dispatcher() *Dispatcher { return o.dispatcher }

// Runner decides at Start whether this process observes, and runs the consumer.
func (o *Outbox) Runner() *Runner { return o.runner }

// Retention is the pruning sweep; MaintenanceTasks has it as a task for the host's sweep.
func (o *Outbox) Retention() *Retention { return o.retention }

// Admin is the operator calls: status, dead letters, replay, retirement.
func (o *Outbox) Admin() *Admin { return o.admin }

// Metrics are the module's measurements, or nil without a Registerer.
func (o *Outbox) Metrics() *Metrics { return o.metrics }

// MaintenanceTasks are the tasks the host's self-healing sweep should run: the retention
// sweep, or nothing when the module is disabled.
func (o *Outbox) MaintenanceTasks() []MaintenanceTask {
	if o.disabled {
		return nil
	}
	return []MaintenanceTask{o.retention.Task()}
}

// Start verifies (or, with AutoMigrate, applies) the schema, resolves the consumer identity
// from the persisted setting Config.IdentityField names and starts the consumer. Without an
// identity (or projects, or with the consumer disabled) it succeeds and State says why
// observation is off. It returns quickly: delivery runs on the consumer's own goroutines.
func (o *Outbox) Start(ctx context.Context) error { return o.runner.Start(ctx) }

// Stop stops the consumer and then the writer's wake-ups, both bounded by ctx. It is
// idempotent and safe before Start; after it, Start refuses with ErrConsumerStopped.
func (o *Outbox) Stop(ctx context.Context) error {
	return errors.Join(o.runner.Stop(ctx), o.writer.Close(ctx))
}

// State is what Start decided (see RunnerState).
func (o *Outbox) State() RunnerState { return o.runner.State() }

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
// named setting, projects to observe) and then runs the consumer. New builds it; without
// the composition root, build a Consumer directly instead.
type Runner struct {
	pool     *pgxpool.Pool
	cfg      Config
	log      *zap.Logger
	settings Settings
	projects Projects
	opts     ConsumerOptions

	// lifecycle is the runner's start-up: a Stop cancels a Start in flight and waits for it
	// (bounded by the Stop's context), so that nothing Start began outlives the Stop.
	lifecycle startstop.Base
	// beforeConsumerStart, when set (by tests), runs just before Start starts the consumer,
	// with Start's context: it holds a Start in the middle.
	beforeConsumerStart func(ctx context.Context)

	mu       sync.Mutex // guards state, stopped, consumer and starting: health handlers read them
	state    RunnerState
	stopped  bool
	consumer *Consumer // the consumer once started
	starting *Consumer // the consumer from just before its start: what Stop stops
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

// set records a decision, unless Stop came first (ok is false then).
func (r *Runner) set(state RunnerState) (ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.stopped {
		return false
	}
	r.state = state
	if state == StateRunning {
		r.consumer = r.starting
	}
	return true
}

// record notes the consumer Start is about to start, unless Stop came first (ok is false
// then, and the consumer must not start). From then on a Stop stops it, whether or not its
// start-up has finished.
func (r *Runner) record(c *Consumer) (ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.stopped {
		return false
	}
	r.starting = c
	return true
}

// forget drops a consumer whose start failed, so that a later Start builds a new one.
func (r *Runner) forget(c *Consumer) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.starting == c && !r.stopped {
		r.starting = nil
	}
}

// Start verifies (or, with AutoMigrate, applies) the schema, resolves the identity and starts
// the consumer. It returns quickly: delivery runs on the consumer's own goroutines. A Stop while
// it runs makes it give up (ErrConsumerStopped) and leaves nothing running; after Stop it
// refuses with ErrConsumerStopped. A Start that failed may be tried again.
func (r *Runner) Start(ctx context.Context) error {
	run, err := r.lifecycle.Begin()
	switch {
	case errors.Is(err, startstop.ErrStopped):
		return ErrConsumerStopped
	case err != nil:
		return errors.New("runner already started")
	}
	// Every step talks to the database; a Stop meanwhile cancels it and waits for this Start.
	startCtx, release := run.StartContext(ctx)
	err = r.start(startCtx)
	release()
	switch {
	case run.Stopping():
		// The Stop stops the consumer if one was recorded; none starts after it.
		run.Finished()
		return ErrConsumerStopped
	case err != nil:
		run.Failed()
		return err
	}
	run.Finished() // the start-up is over: the consumer runs on a lifecycle of its own
	return nil
}

func (r *Runner) start(ctx context.Context) error {
	if r.cfg.Disabled {
		r.set(StateDisabled)
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
		r.set(StateConsumerDisabled)
		r.log.Info("outbox consumer disabled by configuration; the writer hook records events")
		return nil
	case r.projects == nil:
		r.set(StateNoProjects)
		r.log.Info("observation disabled: the host provides no project set to observe")
		return nil
	}
	id, ok, err := ResolveConsumerID(ctx, r.settings, r.cfg.IdentityField)
	if err != nil {
		return err
	}
	if !ok {
		r.set(StateNoIdentity)
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
	if !r.record(c) {
		return ErrConsumerStopped
	}
	if r.beforeConsumerStart != nil {
		r.beforeConsumerStart(ctx)
	}
	if err := c.Start(ctx); err != nil {
		r.forget(c)
		return err
	}
	if !r.set(StateRunning) {
		return ErrConsumerStopped // the Stop that came meanwhile stops it
	}
	return nil
}

// Stop stops the consumer and waits for a Start in flight, both bounded by ctx: once it has
// returned nil, no consumer of this runner runs and no event reaches a listener. It is
// idempotent and safe before Start; after it, Start refuses.
func (r *Runner) Stop(ctx context.Context) error {
	r.mu.Lock()
	r.stopped = true
	c := r.starting
	if c != nil {
		r.state = StateStopped
	}
	r.mu.Unlock()
	var errs []error
	if c != nil {
		// First, so that no event is handed over once Stop is called; a consumer still
		// starting gives up its start-up, and Stop waits for it.
		errs = append(errs, c.Stop(ctx))
	}
	if err := r.lifecycle.Stop(ctx); err != nil {
		errs = append(errs, fmt.Errorf("stop runner: wait for its start: %w", err))
	}
	return errors.Join(errs...)
}

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

// Outbox is the composition root: the writer hook, the dispatcher, the consumer, the retention
// sweep and the admin calls, built from one Config and the host's seams by New. Start decides
// whether this process observes and starts the consumer; Stop stops it. The fx Module is glue
// over it.
type Outbox struct {
	writer     *Writer
	dispatcher *Dispatcher
	retention  *Retention
	admin      *Admin
	metrics    *Metrics
	// consumer is built by New, without its identity, which Start reads from the settings; nil
	// when the module or its consumer is disabled, or without a Projects seam.
	consumer *Consumer

	// What Start needs besides the parts.
	pool             *pgxpool.Pool // migrations and the schema check
	settings         Settings
	identityField    string
	disabled         bool
	consumerDisabled bool
	autoMigrate      bool
	log              *zap.Logger

	// lifecycle is the Outbox's start-up: a Stop cancels a Start in flight and waits for it
	// (bounded by the Stop's context), so that nothing Start began outlives the Stop; after a
	// Stop, Start refuses. The consumer runs on a lifecycle of its own, which Stop stops first.
	lifecycle startstop.Base
	// beforeConsumerStart, when set (by tests), runs just before Start starts the consumer,
	// with Start's context: it holds a Start in the middle.
	beforeConsumerStart func(ctx context.Context)

	mu       sync.Mutex // guards state, launched and running: health handlers read them
	state    State
	launched bool      // Start went on to start the consumer, which did not fail: Stop makes the state StateStopped
	running  *Consumer // the consumer once it ran
}

// New builds every part of the module from cfg and deps, as the fx Module does: it applies
// cfg's defaults and validates it, once, and gives each part the options it uses: the writer
// on pool (or deps.Writer), a dispatcher that knows the writer's process ID (SelfWriterID) and
// applies Config.ListenerTimeout, the consumer (on deps.ConsumerPool; its identity is read at
// Start), the retention sweep and the admin calls on the operator pool, and metrics when deps
// has a Registerer. It does not touch the database: Start does.
//
// The schema must be migrated before Start (outboxctl migrate, or Migrate), unless
// Config.AutoMigrate is set.
func New(pool *pgxpool.Pool, cfg Config, deps Deps) (*Outbox, error) {
	if pool == nil {
		return nil, invalid("New.pool", "is nil: New needs the host's pool")
	}
	cfg, err := validConfig(cfg)
	if err != nil {
		return nil, err
	}
	return build(pool, cfg, deps)
}

// validConfig is cfg with its defaults applied, validated: the one place a Config is made
// ready. New and the fx module call it once, before they build the parts; the constructors
// that take a Config (NewWriter, NewRetention, NewConsumer) call it for a host that builds
// the parts one by one.
func validConfig(cfg Config) (Config, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return Config{}, err
	}
	return cfg, nil
}

// build is New on a Config validConfig returned.
func build(pool *pgxpool.Pool, cfg Config, deps Deps) (*Outbox, error) {
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
		if err := checkPooledDB(cfg, pool); err != nil {
			return nil, err
		}
		w, err := newWriter(pool, cfg.writerOptions(), log)
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
	if err := checkPooledDB(cfg, operatorPool); err != nil {
		return nil, err
	}
	o := &Outbox{writer: writer, dispatcher: dispatcher, metrics: metrics,
		retention: newRetention(operatorPool, cfg.retentionConfig(), log, metrics),
		admin: NewAdmin(operatorPool, AdminOptions{Audit: audit, Clock: cfg.Clock, Logger: log,
			LockTimeout: cfg.LockTimeout, StatementTimeout: cfg.StatementTimeout, TickChannel: cfg.TickChannel}),
		pool: pool, settings: deps.Settings, identityField: cfg.IdentityField, disabled: cfg.Disabled,
		consumerDisabled: cfg.ConsumerDisabled, autoMigrate: cfg.AutoMigrate, log: log.Named("outbox")}
	if !cfg.Disabled && !cfg.ConsumerDisabled && deps.Projects != nil {
		if err := checkPooledDB(cfg, consumerPool); err != nil {
			return nil, err
		}
		c, err := newConsumer(ConsumerOptions{Pool: consumerPool, Projects: deps.Projects, Dispatcher: dispatcher,
			LiveTasks: deps.LiveTasks, Cache: deps.Cache, Audit: audit, Metrics: metrics, Logger: log}, cfg.consumerConfig())
		if err != nil {
			return nil, err
		}
		o.consumer = c
	}
	if r, ok := deps.Projects.(ProjectsRefresher); ok {
		r.SetRefresher(o.RefreshProjects)
	}
	return o, nil
}

// Writer is the writer hook the host's delete transaction calls.
func (o *Outbox) Writer() *Writer { return o.writer }

// Dispatcher is the dispatcher the consumer hands events to.
func (o *Outbox) Dispatcher() *Dispatcher { return o.dispatcher }

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

// State says what Start decided.
type State string

// States of an Outbox.
const (
	StateNotStarted       State = "not-started"
	StateDisabled         State = "disabled"          // Config.Disabled
	StateConsumerDisabled State = "consumer-disabled" // Config.ConsumerDisabled
	StateNoIdentity       State = "no-identity"       // the identity setting is absent or empty
	StateNoProjects       State = "no-projects"       // the host provides no project set
	StateRunning          State = "running"
	StateStopped          State = "stopped"
)

// State is what Start decided: whether this process observes, and if not, why.
func (o *Outbox) State() State {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.state == "" {
		return StateNotStarted
	}
	return o.state
}

// Consumer is the consumer once Start has started it, or nil when observation is off.
func (o *Outbox) Consumer() *Consumer {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.running
}

// stopping reports whether Stop has been called: its first step stops the consumer, or, without
// one, the Outbox's lifecycle. o.mu is held.
func (o *Outbox) stopping() bool {
	if o.consumer != nil && o.consumer.lifecycle.Stopped() {
		return true
	}
	return o.lifecycle.Stopped()
}

// set records a decision, unless Stop came first (ok is false then).
func (o *Outbox) set(state State) (ok bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.stopping() {
		return false
	}
	o.state = state
	if state == StateRunning {
		o.running = o.consumer
	}
	return true
}

// launch notes that Start is about to start the consumer, unless Stop came first (ok is false
// then, and the consumer must not start); ok false undoes it, after a start that failed, so
// that a Stop then leaves the decision as it was.
func (o *Outbox) launch(ok bool) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.stopping() {
		return false
	}
	o.launched = ok
	return true
}

// markStopped makes the state StateStopped once the consumer was started.
func (o *Outbox) markStopped() {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.launched || o.state == StateRunning {
		o.state = StateStopped
	}
}

// Start verifies (or, with AutoMigrate, applies) the schema, resolves the consumer identity
// from the persisted setting Config.IdentityField names and starts the consumer. Without an
// identity (or projects, or with the consumer disabled) it succeeds and State says why
// observation is off. It returns quickly: delivery runs on the consumer's own goroutines. A
// Stop while it runs makes it give up (ErrConsumerStopped) and leaves nothing running; after
// Stop it refuses with ErrConsumerStopped. A Start that failed may be tried again.
func (o *Outbox) Start(ctx context.Context) error {
	run, err := o.lifecycle.Begin()
	switch {
	case errors.Is(err, startstop.ErrStopped):
		return ErrConsumerStopped
	case err != nil:
		return errors.New("outbox already started")
	}
	// Every step talks to the database; a Stop meanwhile cancels it and waits for this Start.
	startCtx, release := run.StartContext(ctx)
	err = o.start(startCtx)
	release()
	switch {
	case run.Stopping():
		// The Stop stops the consumer if it started; it starts no more.
		run.Finished()
		return ErrConsumerStopped
	case err != nil:
		run.Failed()
		return err
	}
	run.Finished() // the start-up is over: the consumer runs on a lifecycle of its own
	return nil
}

func (o *Outbox) start(ctx context.Context) error {
	if o.disabled {
		o.set(StateDisabled)
		o.log.Info("outbox disabled by configuration: the writer hook records nothing and no consumer runs")
		return nil
	}
	if o.autoMigrate {
		if _, err := Migrate(ctx, o.pool); err != nil {
			return err
		}
	}
	if err := VerifySchema(ctx, o.pool); err != nil {
		if errors.Is(err, ErrSchemaBehind) {
			return fmt.Errorf("%w (apply the migrations with outboxctl migrate, or set AutoMigrate)", err)
		}
		return err
	}
	switch {
	case o.consumerDisabled:
		o.set(StateConsumerDisabled)
		o.log.Info("outbox consumer disabled by configuration; the writer hook records events")
		return nil
	case o.consumer == nil:
		o.set(StateNoProjects)
		o.log.Info("observation disabled: the host provides no project set to observe")
		return nil
	}
	id, ok, err := ResolveConsumerID(ctx, o.settings, o.identityField)
	if err != nil {
		return err
	}
	if !ok {
		o.set(StateNoIdentity)
		o.log.Info("observation disabled: no durable consumer identity; set the persisted setting to enable it",
			zap.String("setting", o.identityField))
		return nil
	}
	if !o.launch(true) {
		return ErrConsumerStopped
	}
	if o.beforeConsumerStart != nil {
		o.beforeConsumerStart(ctx)
	}
	c := o.consumer
	c.identify(id) // not running: a Start before this one failed, or none came
	if err := c.Start(ctx); err != nil {
		o.launch(false)
		return err
	}
	if !o.set(StateRunning) {
		return ErrConsumerStopped // the Stop that came meanwhile stops it
	}
	return nil
}

// Stop stops the consumer, waits for a Start in flight and then for the writer's wake-ups,
// all bounded by ctx: once it has returned nil, no consumer of this Outbox runs and no event
// reaches a listener. It is idempotent and safe before Start; after it, Start refuses with
// ErrConsumerStopped.
func (o *Outbox) Stop(ctx context.Context) error {
	o.markStopped() // health handlers see it at once; again below, after a start that raced
	var errs []error
	if o.consumer != nil {
		// First, so that no event is handed over once Stop is called; a consumer still
		// starting gives up its start-up, and Stop waits for it.
		errs = append(errs, o.consumer.Stop(ctx))
	}
	if err := o.lifecycle.Stop(ctx); err != nil {
		errs = append(errs, fmt.Errorf("stop outbox: wait for its start: %w", err))
	}
	o.markStopped()
	errs = append(errs, o.writer.Close(ctx))
	return errors.Join(errs...)
}

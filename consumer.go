package outbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"

	"fusion/outbox/startstop"
)

// ConsumerOptions configure a Consumer.
type ConsumerOptions struct {
	// ID is the durable identity, normally from ResolveConsumerID. Required.
	ID ConsumerID
	// Pool is the host's pool. The consumer uses at most three of its connections at a time
	// (the loop, one acknowledgement in flight, the heartbeat), plus one dedicated connection
	// for the ticker's election, and a LISTEN connection it shares with the process's other
	// consumers of this pool (both hijacked from the pool unless Config.ListenDSN).
	Pool *pgxpool.Pool
	// Config is the deployment configuration (defaults applied by NewConsumer).
	Config Config
	// Projects lists the projects this process observes. Required.
	Projects Projects
	// Dispatcher delivers events to the cache and the observed listeners. Required.
	Dispatcher *Dispatcher
	// LiveTasks reads live tasks for reconciliation; without it reconciliation only moves
	// the cursor, and the log says so.
	LiveTasks LiveTasks
	// Cache receives the live set on reconciliation; usually the dispatcher's cache.
	Cache TaskCache
	// Audit writes the poison and replay audit rows. Defaults to TableAuditSink.
	Audit AuditSink
	// Metrics, when set, receives the consumer's measurements.
	Metrics *Metrics
	Logger  *zap.Logger
}

// Consumer replays committed events of its projects, in sequence order, from its durable
// cursors, under fenced leases, and hands them to the dispatcher. Start and Stop control it.
//
// It is made of parts, each a type of its own: the lease keeper (lease.go: the lease table,
// acquire, renew and release, the heartbeat and the fenced transaction), the acknowledger
// (acks.go: cursor writes, one in flight and the rest batched), the delivery store
// (deliveries.go: retry, dead-letter and replay rows), the waker (listen.go: the LISTEN
// connection and its self-test) and the scan loop (loop.go), which owns every stream's state
// and is the only one to hand events to the dispatcher.
type Consumer struct {
	lifecycle startstop.Base

	id      ConsumerID // set by identify
	owner   string     // this instance's lease owner token: per boot, never an identity
	suffix  string     // the owner token's per-boot part
	cfg     consumerConfig
	baseLog *zap.Logger // the consumer's logger before identify names the identity
	log     *zap.Logger
	metrics *Metrics
	status  *statusSource // what the metrics read status through
	stats   *stats

	leases *leaseKeeper
	waker  *waker
	ticker *ticker
	loop   *scanLoop
}

// NewConsumer validates opts and builds a consumer. It does not touch the database.
func NewConsumer(opts ConsumerOptions) (*Consumer, error) {
	cfg, err := validConfig(opts.Config)
	if err != nil {
		return nil, err
	}
	if err := checkPooledDB(cfg, opts.Pool); err != nil {
		return nil, err
	}
	if _, err := ParseConsumerID(string(opts.ID)); err != nil {
		return nil, &ValidationError{Field: "ConsumerOptions.ID", Reason: err.Error()}
	}
	c, err := newConsumer(opts, cfg.consumerConfig())
	if err != nil {
		return nil, err
	}
	c.identify(opts.ID)
	return c, nil
}

// newConsumer builds a consumer's parts from opts (but for its Config and ID) and cfg, from a
// Config the caller validated, without an identity: identify gives it, before Start. New builds the
// consumer this way before the identity is read from the settings (at Start).
func newConsumer(opts ConsumerOptions, cfg consumerConfig) (*Consumer, error) {
	switch {
	case opts.Pool == nil:
		return nil, invalid("ConsumerOptions.Pool", "is nil")
	case opts.Projects == nil:
		return nil, invalid("ConsumerOptions.Projects", "is nil")
	case opts.Dispatcher == nil:
		return nil, invalid("ConsumerOptions.Dispatcher", "is nil")
	}
	if err := opts.Dispatcher.checkConsumer(cfg); err != nil {
		return nil, err
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	if opts.Audit == nil {
		opts.Audit = TableAuditSink{}
	}
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return nil, fmt.Errorf("lease owner token: %w", err)
	}
	log := opts.Logger.Named("outbox.consumer")
	st := &stats{}
	scans := newScanRequests()
	leases := &leaseKeeper{pool: opts.Pool, cfg: cfg, projects: opts.Projects,
		metrics: opts.Metrics, stats: st, gained: scans.request, wake: scans.poke, refreshes: make(chan refreshRequest),
		table: leaseTable{held: map[string]lease{}}}
	loop := &scanLoop{
		pool: opts.Pool, cfg: cfg, metrics: opts.Metrics, trace: newTracing(cfg.TracerProvider),
		dispatch: opts.Dispatcher, leases: leases, scans: scans, stats: st, streams: streams{},
		store: &deliveryStore{cfg: cfg, audit: opts.Audit},
		recon: &reconciler{pool: opts.Pool, cfg: cfg, cache: opts.Cache, live: opts.LiveTasks},
		reads: &readSource{cfg: cfg, metrics: opts.Metrics, stats: st},
	}
	st.onStandby.Store(cfg.ReadDSN != "")
	loop.acks = &acknowledger{pool: opts.Pool, clock: cfg.Clock, apply: loop.applyAcks}
	tk := newTicker(opts.Pool, cfg, log, opts.Metrics, st, scans)
	if tk.campaigns() {
		loop.elected, loop.tickNow = tk.leading.Load, tk.poke
	}
	return &Consumer{
		suffix: hex.EncodeToString(b[:]), cfg: cfg, baseLog: log, log: log, metrics: opts.Metrics, stats: st,
		status: &statusSource{db: opts.Pool, projects: leases.observedProjects, clock: cfg.Clock, log: log},
		leases: leases, loop: loop, ticker: tk,
		waker: &waker{pool: opts.Pool, cfg: cfg, metrics: opts.Metrics, scans: scans},
	}, nil
}

// identify gives the consumer and each of its parts the durable identity id, its lease owner
// token and a logger that names it. The consumer must not be running: New's consumer is
// identified by each Start, before its start-up.
func (c *Consumer) identify(id ConsumerID) {
	owner := string(id) + "@" + c.suffix
	log := c.baseLog.With(zap.String("consumer_id", string(id)))
	c.id, c.owner, c.log, c.status.log = id, owner, log, log
	c.leases.id, c.leases.owner, c.leases.log = id, owner, log
	c.loop.id, c.loop.log = id, log
	c.loop.store.id, c.loop.recon.id = id, id
	c.loop.reads.id, c.loop.reads.log = id, log
	c.loop.acks.id, c.loop.acks.owner = id, owner
	c.waker.id, c.waker.log = id, log
	c.ticker.log = log.Named("ticker")
}

// ID is the consumer's durable identity.
func (c *Consumer) ID() ConsumerID { return c.id }

// LeaseOwner is this instance's lease token, as lifecycle_consumer_cursors.lease_owner shows
// it: the identity and a per-boot suffix, so operators can tell two processes of one identity
// apart.
func (c *Consumer) LeaseOwner() string { return c.owner }

// Start checks the database, takes the leases it can and starts the consumer's goroutines. It
// does not block on event delivery. It fails fast when the database is unreachable or when the
// identity was retired for any observed project (ErrConsumerRetired). A Stop while it runs
// makes it give up; after Stop, Start refuses with ErrConsumerStopped.
func (c *Consumer) Start(ctx context.Context) error {
	run, err := c.lifecycle.Begin()
	switch {
	case errors.Is(err, startstop.ErrStopped):
		return ErrConsumerStopped
	case err != nil:
		return errors.New("consumer already started")
	}
	// Start-up talks to the database; a Stop meanwhile cancels it and waits for the run.
	startCtx, release := run.StartContext(ctx)
	projects, err := c.startUp(startCtx)
	release()
	if run.Stopping() {
		c.leases.release(c.lifecycle.StopContext())
		run.Finished()
		return ErrConsumerStopped
	}
	if err != nil {
		run.Failed() // a failed start may be tried again
		return err
	}
	// The standby's pool connects lazily: a standby down at start is a fallback, not a failure.
	if err := c.loop.reads.open(); err != nil {
		c.leases.release(c.lifecycle.StopContext())
		run.Failed()
		return err
	}

	runCtx := run.Ctx
	c.metrics.watch(c.status) // before the goroutines: their shutdown unwatches
	var wg sync.WaitGroup
	listening := make(chan struct{})
	wg.Add(4)
	go func() { defer wg.Done(); c.leases.heartbeatLoop(runCtx) }()
	go func() { defer wg.Done(); c.ticker.run(runCtx, c.lifecycle.Abandoned()) }()
	go func() {
		defer wg.Done()
		if c.cfg.NotifyDisabled {
			close(listening)
			<-runCtx.Done()
			return
		}
		c.waker.listenLoop(runCtx, listening)
	}()
	go func() {
		defer wg.Done()
		// Listen first, then catch up: the first scan starts once LISTEN is in place (or has
		// failed once), so nothing committed in between is left to the poll interval.
		select {
		case <-listening:
		case <-runCtx.Done():
		}
		c.loop.run(runCtx, c.lifecycle.Abandoned())
	}()
	go func() {
		wg.Wait()
		c.shutdown()
		run.Finished()
	}()
	c.log.Info("consumer started", zap.Int("projects", len(projects)), zap.String("lease_owner", c.owner))
	return nil
}

// startUp checks the identity's cursors and takes the leases it can.
func (c *Consumer) startUp(ctx context.Context) ([]string, error) {
	projects, err := c.leases.observedProjects(ctx)
	if err != nil {
		return nil, err
	}
	if err := c.leases.ensureCursors(ctx, projects); err != nil {
		return nil, err
	}
	if err := c.leases.checkRetired(ctx, projects); err != nil {
		return nil, err
	}
	if _, err := c.leases.acquire(ctx, projects); err != nil {
		return nil, err
	}
	return projects, nil
}

// Stop stops the consumer: no event is handed to a listener after it is called; the one in
// flight may finish within its listener timeout and is acknowledged only if it did; its
// ticker starts no tick, and the one in flight runs to its end. Then it flushes pending
// acknowledgements, releases its leases and waits for its goroutines. All of it is bounded by
// ctx: when ctx ends first, Stop abandons the listener and the tick in flight, the shutdown's
// writes give up (the leases expire instead) and Stop returns ctx's error. It is
// idempotent and safe before Start.
func (c *Consumer) Stop(ctx context.Context) error {
	if err := c.lifecycle.Stop(ctx); err != nil {
		return fmt.Errorf("stop consumer: %w", err)
	}
	return nil
}

// Done is closed when the consumer has stopped.
func (c *Consumer) Done() <-chan struct{} { return c.lifecycle.Done() }

// shutdown runs after every goroutine returned: flush acknowledgements and release leases.
func (c *Consumer) shutdown() {
	ctx := c.lifecycle.StopContext()
	c.loop.acks.await()
	c.loop.acks.flush(ctx, c.loop.streams.pendingAcks())
	c.leases.release(ctx)
	c.loop.reads.close()
	c.metrics.unwatch(c.status)
	c.log.Info("consumer stopped", zap.Int64("delivered", c.stats.delivered.Load()))
}

// Wakeups says whether the consumer's LISTEN wake-ups were proven to work (see WakeupState).
func (c *Consumer) Wakeups() WakeupState {
	if c.cfg.NotifyDisabled {
		return WakeupsDisabled
	}
	return c.waker.check.load()
}

// WakeupsWorking reports whether notifications were seen to reach the LISTEN connection.
func (c *Consumer) WakeupsWorking() bool { return c.Wakeups() == WakeupsWorking }

// Stats are a consumer's counters since it was built.
type Stats struct {
	Delivered       int64 // events the listeners took
	Own             int64 // events this process wrote, not re-delivered to its own listeners
	Suppressed      int64 // re-deliveries this instance had already delivered
	Failures        int64 // failed attempts
	Parked          int64 // events parked as dead letters
	Replayed        int64 // dead letters replayed successfully
	Reconciliations int64
	LeaseLosses     int64
	Scans           int64 // scans of at least one project, each starting with a read of heads
	Ticks           int64 // ticks this instance took as the ticker (or as a fallback)
	Numbered        int64 // events its ticks numbered
	Holes           int64 // missing events found (each reconciled its project)
	// OpenReads counts the scans that read open deliveries (retries, replay requests) on the
	// primary: after a lease was gained, a replay hint, a write whose outcome was unknown, and
	// every TickFallbackInterval. Other scans use what the consumer knows of them.
	OpenReads int64
	// TickHints counts the ticks this consumer, its ticker elected, asked for after a poll
	// found events committed that no tick had numbered (a writer's hint lost).
	TickHints int64
	// SharedReads counts the reads of heads and first batches this consumer took from a
	// statement another consumer on the same pool had in flight, instead of sending its own.
	SharedReads int64
	// TicksHeld counts the ticks this consumer's ticker, elected, held back while the
	// consumer was still busy with the ticks before (Config.TickBusyWait).
	TicksHeld int64
	// TickReads counts the scans' first reads made by tick (after the tick each project's last
	// scan to its head saw); TickReadMisses counts the projects such a read could not serve (a
	// part the read's limit cut, or one that did not come back whole), which read by project.
	TickReads      int64
	TickReadMisses int64
	// TickStarts counts the scans that started with a read of ticks alone, without a read of
	// heads: every stream knew its tick and had nothing else to look at (scanLoop.startByTick).
	TickStarts int64
	// Prefetched counts the batches a stream with a backlog read while it dispatched the batch
	// before and then took: full batches with more to come (scanLoop.prefetch).
	Prefetched int64

	// Reading from a standby (Config.ReadDSN); all zero without one.
	ReadFallbacks      int64         // times the consumer left the standby for the primary (behind by ReadMaxLag, or unreachable)
	ReadReturns        int64         // times it went back to the standby once it had caught up
	ReadConflicts      int64         // standby reads cancelled by a conflict with recovery (retried; never an event's failure)
	StandbyWaits       int64         // scans that waited for the standby to replay the primary's newest tick
	TickChecks         int64         // announced ticks the standby had not replayed, checked on the primary (an announcement is only a hint)
	ReadingFromStandby bool          // scans read from the standby now (false while fallen back)
	StandbyWaiting     bool          // a scan is waiting for the standby now
	StandbyLagTicks    int64         // ticks the primary has that the standby had not replayed, when last compared
	StandbyLag         time.Duration // the primary's newest tick's time minus the standby's, when last compared (0 when caught up)
}

// stats are the counters every part of a consumer adds to.
type stats struct {
	delivered, own, suppressed, failures, parked, replayed, reconciliations, leaseLosses, scans, ticks, numbered, holes atomic.Int64
	openReads, tickHints, sharedReads, ticksHeld, tickReads, tickReadMisses, prefetched, tickStarts                     atomic.Int64

	readFallbacks, readReturns, readConflicts, standbyWaits, tickChecks, lagTicks, lagNanos atomic.Int64
	onStandby, waiting                                                                      atomic.Bool
}

// Stats returns the consumer's counters.
func (c *Consumer) Stats() Stats {
	s := c.stats
	return Stats{
		Delivered: s.delivered.Load(), Own: s.own.Load(), Suppressed: s.suppressed.Load(), Failures: s.failures.Load(),
		Parked: s.parked.Load(), Replayed: s.replayed.Load(), Reconciliations: s.reconciliations.Load(), LeaseLosses: s.leaseLosses.Load(),
		Scans: s.scans.Load(), Ticks: s.ticks.Load(), Numbered: s.numbered.Load(), Holes: s.holes.Load(),
		OpenReads: s.openReads.Load(), TickHints: s.tickHints.Load(), SharedReads: s.sharedReads.Load(), TicksHeld: s.ticksHeld.Load(),
		TickReads: s.tickReads.Load(), TickReadMisses: s.tickReadMisses.Load(), Prefetched: s.prefetched.Load(), TickStarts: s.tickStarts.Load(),
		ReadFallbacks: s.readFallbacks.Load(), ReadReturns: s.readReturns.Load(), ReadConflicts: s.readConflicts.Load(),
		StandbyWaits: s.standbyWaits.Load(), TickChecks: s.tickChecks.Load(), ReadingFromStandby: s.onStandby.Load(), StandbyWaiting: s.waiting.Load(),
		StandbyLagTicks: s.lagTicks.Load(), StandbyLag: time.Duration(s.lagNanos.Load()),
	}
}

// logTransient logs a step that failed and will be tried again, unless it failed because the
// consumer is stopping.
func logTransient(log *zap.Logger, what string, err error) {
	if errors.Is(err, context.Canceled) {
		return
	}
	log.Warn("consumer step failed; retrying on the next scan", zap.String("step", what), zap.Error(err))
}

// shiftedNow is the local clock shifted like the database clock, for lease deadlines and
// retry times.
func shiftedNow(clock Clock) time.Time { return time.Now().Add(clock.Offset()) }

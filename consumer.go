package outbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
)

// ConsumerOptions configure a Consumer.
type ConsumerOptions struct {
	// ID is the durable identity, normally from ResolveConsumerID. Required.
	ID ConsumerID
	// Pool is the host's pool. The consumer uses at most three of its connections at a time
	// (the loop, one acknowledgement in flight, the heartbeat), plus one dedicated LISTEN
	// connection (hijacked from the pool unless Config.ListenDSN).
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
type Consumer struct {
	id       ConsumerID
	owner    string // this instance's lease owner token: per boot, never an identity
	pool     *pgxpool.Pool
	cfg      Config
	projects Projects
	dispatch *Dispatcher
	live     LiveTasks
	cache    TaskCache
	audit    AuditSink
	metrics  *Metrics
	log      *zap.Logger
	clock    Clock
	trace    tracing

	leases *leaseTable
	state  map[string]*streamState // owned by the loop goroutine
	heartbeatControl
	stats stats

	wakeups  wakeupCheck        // the LISTEN self-test's outcome (listen_selftest.go)
	seq      isolatingSequencer // owned by the loop goroutine
	skipLog  logEvery           // owned by the loop goroutine
	inflight *inflightAck       // owned by the loop goroutine (and by shutdown, after it)
	run      dispatchRun        // the loop's listener runner (started on first use) and timeout

	wake    chan struct{}
	dirtyMu sync.Mutex
	dirty   map[string]struct{}

	mu          sync.Mutex
	started     bool
	stopped     bool
	cancel      context.CancelFunc // ends the run (and a start-up in progress)
	done        chan struct{}      // closed when the run, or a start-up that failed, is over
	stopCtx     context.Context    // the first Stop's context: it bounds the shutdown
	abandon     chan struct{}      // closed when a Stop's context ended: abandon a listener in flight
	abandonOnce sync.Once
}

// streamState is the loop's view of one project stream.
type streamState struct {
	project   string
	epoch     int64  // lease epoch this state belongs to; 0 before the first lease
	acked     int64  // durable cursor; -1 when the cursor is NULL (never positioned)
	position  int64  // dispatched through; position > acked means acknowledgements are pending
	lease     uint64 // the lease (leaseTable's grant number) this state belongs to
	delivered int64  // highest sequence this instance delivered: re-deliveries below are suppressed
	// deliveredID is the event delivered at sequence delivered. When a new lease moves the
	// position back below delivered, the event stored there now must still be this one, or
	// the history was rewritten (a restored database) and nothing is suppressed.
	deliveredID    string
	checkDelivered bool
	// retryAt is when the blocked head-of-line event falls due, on the consumer's shifted
	// clock (see now). An absolute time, so a timer re-armed later waits only what is left.
	retryAt time.Time
	blocked bool // the head-of-line event waits for its next attempt
	found   bool // the last scan had events or deliveries to look at
}

// NewConsumer validates opts and builds a consumer. It does not touch the database.
func NewConsumer(opts ConsumerOptions) (*Consumer, error) {
	cfg := opts.Config.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := checkPooledDB(cfg, opts.Pool); err != nil {
		return nil, err
	}
	if _, err := ParseConsumerID(string(opts.ID)); err != nil {
		return nil, &ValidationError{Field: "ConsumerOptions.ID", Reason: err.Error()}
	}
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
	c := &Consumer{
		id: opts.ID, owner: string(opts.ID) + "@" + hex.EncodeToString(b[:]),
		pool: opts.Pool, cfg: cfg, projects: opts.Projects, dispatch: opts.Dispatcher,
		live: opts.LiveTasks, cache: opts.Cache, audit: opts.Audit, metrics: opts.Metrics,
		log:   opts.Logger.Named("outbox.consumer").With(zap.String("consumer_id", string(opts.ID))),
		clock: cfg.Clock, state: map[string]*streamState{}, trace: newTracing(cfg.TracerProvider),
		wake: make(chan struct{}, 1), dirty: map[string]struct{}{},
	}
	c.leases = &leaseTable{held: map[string]lease{}}
	return c, nil
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
	c.mu.Lock()
	switch {
	case c.stopped:
		c.mu.Unlock()
		return ErrConsumerStopped
	case c.started:
		c.mu.Unlock()
		return errors.New("consumer already started")
	}
	runCtx, cancel := context.WithCancel(context.Background())
	done, abandon := make(chan struct{}), make(chan struct{})
	c.started, c.cancel, c.done, c.abandon = true, cancel, done, abandon
	c.mu.Unlock()

	// Start-up talks to the database; a Stop meanwhile cancels it and waits for done.
	startCtx, cancelStart := context.WithCancel(ctx)
	unwatch := context.AfterFunc(runCtx, cancelStart)
	projects, err := c.startUp(startCtx)
	unwatch()
	cancelStart()
	if runCtx.Err() != nil { // stopped during start-up
		c.release(c.stopContext())
		close(done)
		return ErrConsumerStopped
	}
	if err != nil {
		cancel()
		c.mu.Lock()
		c.started = false // a failed start may be tried again
		c.mu.Unlock()
		close(done)
		return err
	}

	c.run = dispatchRun{timeout: c.cfg.ListenerTimeout, abandon: abandon}
	c.metrics.watch(c) // before the goroutines: their shutdown unwatches
	var wg sync.WaitGroup
	listening := make(chan struct{})
	wg.Add(2)
	go func() { defer wg.Done(); c.heartbeatLoop(runCtx) }()
	go func() {
		defer wg.Done()
		if c.cfg.NotifyDisabled {
			close(listening)
			<-runCtx.Done()
			return
		}
		c.listenLoop(runCtx, listening)
	}()
	wg.Add(1)
	go func() {
		defer wg.Done()
		// Listen first, then catch up: the first scan starts once LISTEN is in place (or has
		// failed once), so nothing committed in between is left to the poll interval.
		select {
		case <-listening:
		case <-runCtx.Done():
		}
		c.loop(runCtx)
	}()
	go func() {
		wg.Wait()
		c.shutdown()
		close(done)
	}()
	c.log.Info("consumer started", zap.Int("projects", len(projects)), zap.String("lease_owner", c.owner))
	return nil
}

// startUp checks the identity's cursors and takes the leases it can.
func (c *Consumer) startUp(ctx context.Context) ([]string, error) {
	projects, err := c.observedProjects(ctx)
	if err != nil {
		return nil, err
	}
	if err := c.ensureCursors(ctx, projects); err != nil {
		return nil, err
	}
	if err := c.checkRetired(ctx, projects); err != nil {
		return nil, err
	}
	if _, err := c.acquire(ctx, projects); err != nil {
		return nil, err
	}
	return projects, nil
}

// Stop stops the consumer: no event is handed to a listener after it is called; the one in
// flight may finish within its listener timeout and is acknowledged only if it did. Then it
// flushes pending acknowledgements, releases its leases and waits for its goroutines. All of
// it is bounded by ctx: when ctx ends first, Stop abandons the listener in flight, the
// shutdown's writes give up (the leases expire instead) and Stop returns ctx's error. It is
// idempotent and safe before Start.
func (c *Consumer) Stop(ctx context.Context) error {
	c.mu.Lock()
	first := !c.stopped
	c.stopped = true
	if !c.started {
		c.mu.Unlock()
		return nil
	}
	if first {
		c.stopCtx = ctx
		c.cancel()
	}
	done, abandon := c.done, c.abandon
	c.mu.Unlock()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		c.abandonOnce.Do(func() { close(abandon) })
		return fmt.Errorf("stop consumer: %w", ctx.Err())
	}
}

// Done is closed when the consumer has stopped.
func (c *Consumer) Done() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.done
}

// stopContext is the context the first Stop was given: the shutdown's writes honour it.
func (c *Consumer) stopContext() context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.stopCtx == nil {
		return context.Background() // not reached: only Stop ends a run
	}
	return c.stopCtx
}

// shutdown runs after every goroutine returned: flush acknowledgements, release leases.
func (c *Consumer) shutdown() {
	ctx := c.stopContext()
	c.awaitAck()
	c.flushAcks(ctx, c.pendingAcks())
	c.release(ctx)
	c.metrics.unwatch(c)
	c.log.Info("consumer stopped", zap.Int64("delivered", c.stats.delivered.Load()))
}

func (c *Consumer) observedProjects(ctx context.Context) ([]string, error) {
	ps, err := c.projects.ObservedProjects(ctx)
	if err != nil {
		return nil, fmt.Errorf("observed projects: %w", err)
	}
	out := make([]string, 0, len(ps))
	seen := make(map[string]bool, len(ps))
	for _, p := range ps {
		if err := ValidateProjectID(p); err != nil {
			return nil, fmt.Errorf("observed projects: %w", err)
		}
		if !seen[p] {
			seen[p] = true
			out = append(out, p)
		}
	}
	sort.Strings(out)
	return out, nil
}

// requestScan asks the loop to look at projects soon (all of them when projects is nil).
func (c *Consumer) requestScan(projects ...string) {
	c.dirtyMu.Lock()
	if projects == nil {
		c.dirty[""] = struct{}{}
	}
	for _, p := range projects {
		c.dirty[p] = struct{}{}
	}
	c.dirtyMu.Unlock()
	select {
	case c.wake <- struct{}{}:
	default:
	}
}

// takeDirty returns the projects to scan and whether a full scan was asked for.
func (c *Consumer) takeDirty() (map[string]struct{}, bool) {
	c.dirtyMu.Lock()
	defer c.dirtyMu.Unlock()
	d := c.dirty
	c.dirty = map[string]struct{}{}
	_, all := d[""]
	return d, all
}

// loop is the consumer's single dispatching goroutine. It scans on a notification (the
// notified projects), on the poll interval (every project), when a blocked retry falls due
// (on the injected clock), and soon after a step failed.
func (c *Consumer) loop(ctx context.Context) {
	poll := time.NewTimer(0)
	defer poll.Stop()
	defer func() { c.run.runner.close(); c.run.runner = nil }()
	resetPoll := func(d time.Duration) {
		if !poll.Stop() {
			select {
			case <-poll.C:
			default:
			}
		}
		poll.Reset(d)
	}
	full := true
	wakes := newWakeLimiter(c.cfg.WakeInterval)
	for {
		dirty, all := c.takeDirty()
		full = full || all
		var failed bool
		if full {
			wakes.covered()
			failed = c.iterate(ctx, nil, true)
		} else if scan := wakes.admit(dirty, time.Now()); len(scan) > 0 {
			for p := range scan {
				if st := c.state[p]; st != nil {
					st.found = false // a project the scan skips found nothing
				}
			}
			failed = c.iterate(ctx, scan, false)
			for p := range scan {
				st := c.state[p]
				wakes.scanned(p, st != nil && st.found, time.Now())
			}
		}
		if ctx.Err() != nil {
			return
		}
		switch {
		case failed:
			resetPoll(min(c.cfg.PollInterval, time.Second))
		case full:
			resetPoll(c.cfg.PollInterval)
		}
		full = false

		var retry Timer
		var retryC <-chan time.Time
		if wait, ok := c.nextRetry(); ok {
			retry = c.clock.NewTimer(wait) // fires at once when the retry is already due
			retryC = retry.C()
		}
		var held *time.Timer
		var heldC <-chan time.Time
		if at, ok := wakes.next(); ok {
			held = time.NewTimer(time.Until(at)) // notifications held back by the wake interval
			heldC = held.C
		}
		select {
		case <-ctx.Done():
		case <-poll.C:
			full = true
		case <-c.wake:
		case <-heldC:
		case <-retryC:
			full = true
		}
		if retry != nil {
			retry.Stop()
		}
		if held != nil {
			held.Stop()
		}
		if ctx.Err() != nil {
			return
		}
	}
}

// iterate runs one scan over the held leases of the dirty projects (all of them on a full
// scan). It reports whether a step failed, in which case the loop scans again soon.
func (c *Consumer) iterate(ctx context.Context, dirty map[string]struct{}, full bool) (failed bool) {
	held := c.syncStates()
	if !full {
		scoped := held[:0:0]
		for _, p := range held {
			if _, ok := dirty[p]; ok {
				scoped = append(scoped, p)
			}
		}
		held = scoped
	}
	if len(held) == 0 {
		return false
	}
	c.stats.scans.Add(1)
	// One project's broken rows cost only that project: a step that failed for some projects
	// skips them this scan and the others go on.
	heads, err := c.sequence(ctx, held)
	if held, failed = c.skipFailed("sequence", held, err); len(held) == 0 {
		return failed
	}
	open, err := c.openDeliveries(ctx, held)
	held, stepFailed := c.skipFailed("read open deliveries", held, err)
	failed = failed || stepFailed
	for _, p := range held {
		if ctx.Err() != nil {
			break
		}
		st := c.state[p]
		if err := c.scanProject(ctx, st, heads[p], open[p]); err != nil {
			failed = failed || !errors.Is(err, ErrLeaseLost)
			c.handleStreamError(st, err)
		}
	}
	c.awaitAck()
	c.flushAcks(ctx, c.pendingAcks())
	return failed
}

// scanProject brings one project's stream up to its head, or to its first blocked event.
func (c *Consumer) scanProject(ctx context.Context, st *streamState, head Head, open []delivery) error {
	st.blocked = false
	// Whether this scan had anything to do: the wake limiter holds back notifications only for
	// projects whose last notified scan found nothing.
	st.found = head.Assigned > 0 || head.LastSequence > st.position || len(open) > 0
	for _, d := range open {
		if d.state == stateReplayRequested {
			if err := c.replay(ctx, st, d); err != nil {
				return err
			}
		}
	}
	if err := c.checkPosition(ctx, st, head); err != nil {
		return err
	}
	if st.checkDelivered {
		if err := c.verifyDelivered(ctx, st); err != nil {
			return err
		}
	}
	var retrying *delivery
	for i := range open {
		if open[i].state == stateRetrying {
			retrying = &open[i]
			break
		}
	}
	if retrying != nil && retrying.sequence <= st.position {
		retrying = nil // superseded, for example by a reconciliation
	}
	for st.position < head.LastSequence {
		if ctx.Err() != nil || !c.leases.valid(st.project, st.epoch, c.now()) {
			return nil
		}
		if retrying != nil && retrying.sequence == st.position+1 && !retrying.due {
			st.blocked, st.retryAt = true, c.now().Add(retrying.wait)
			return nil
		}
		batch, err := c.readEvents(ctx, st.project, st.position, c.cfg.BatchSize)
		if err != nil {
			return err
		}
		if len(batch) == 0 {
			return nil
		}
		stop, err := c.dispatchBatch(ctx, st, batch, retrying)
		if err != nil || stop {
			return err
		}
		retrying = nil
		if st.position-st.acked >= int64(c.cfg.BatchSize) {
			c.startAck(ctx, ack{st.project, st.epoch, st.position})
		}
	}
	return nil
}

// dispatchBatch delivers events in order. It stops at the first failure (which it records) or
// when the lease is gone; stop reports that the stream cannot go further this scan.
func (c *Consumer) dispatchBatch(ctx context.Context, st *streamState, batch []storedEvent, retrying *delivery) (stop bool, err error) {
	for _, row := range batch {
		ev := row.Event
		if ev.Sequence != st.position+1 {
			return true, fmt.Errorf("project %s: read sequence %d after %d", st.project, ev.Sequence, st.position)
		}
		if ctx.Err() != nil || !c.leases.valid(st.project, st.epoch, c.now()) {
			return true, nil // stopping, or the lease is gone: nothing more is handed over
		}
		if row.bad != nil {
			// No attempt can decode it: park it now rather than wedge the stream.
			c.flushAcks(ctx, []ack{{st.project, st.epoch, st.position}})
			if _, err := c.parkUndecodable(ctx, st, row); err != nil {
				return true, err
			}
			retrying = nil
			continue
		}
		if ev.Sequence <= st.delivered {
			// Delivered by this instance before a lease change: a re-delivery, not new work.
			st.position = ev.Sequence
			c.stats.suppressed.Add(1)
			continue
		}
		attempt := 1
		if retrying != nil && retrying.sequence == ev.Sequence {
			attempt = retrying.attempts + 1
		}
		started := time.Now()
		pctx, oev, span := c.processSpan(ctx, ObservedEvent{Event: ev, ConsumerID: c.id, Attempt: attempt})
		outcome, class := c.dispatch.dispatch(pctx, oev, &c.run)
		endProcessSpan(span, outcome, class)
		c.metrics.observeDispatch(st.project, string(c.id), outcome, time.Since(started))
		switch outcome {
		case Interrupted:
			return true, nil
		case Failed:
			c.flushAcks(ctx, []ack{{st.project, st.epoch, st.position}})
			parked, err := c.recordFailure(ctx, st, ev, class)
			if err != nil || !parked {
				return true, err
			}
			retrying = nil
			continue // parked: the cursor moved past it, the stream goes on
		case Own:
			c.stats.own.Add(1)
		default:
			c.stats.delivered.Add(1)
		}
		st.position, st.delivered, st.deliveredID = ev.Sequence, ev.Sequence, ev.EventID
		if attempt > 1 {
			// The event that was retrying succeeded: close its delivery with the cursor move.
			if err := c.resolveRetried(ctx, st, ev); err != nil {
				return true, err
			}
		}
	}
	return false, nil
}

// checkPosition positions a never-read cursor and reconciles one whose history is gone.
func (c *Consumer) checkPosition(ctx context.Context, st *streamState, head Head) error {
	switch {
	case st.acked < 0 && c.cfg.NewCursor == NewCursorOldest && head.PrunedThrough == 0:
		// Start before the first event; the position is written with the next acknowledgement
		// batch, so many new cursors cost one statement.
		if st.position == 0 {
			c.log.Debug("new cursor starts at the oldest retained event", zap.String("project_id", st.project))
		}
		return nil
	case st.acked < 0:
		return c.reconcile(ctx, st, ReasonMissingCursor)
	case st.acked > head.LastSequence:
		return c.reconcile(ctx, st, ReasonCursorAheadOfHead)
	case st.acked < head.PrunedThrough:
		return c.reconcile(ctx, st, ReasonCursorBelowPrunedFloor)
	}
	return nil
}

const eventAtSQL = `SELECT task_id, deleted_at FROM lifecycle_outbox WHERE project_id = $1 AND sequence = $2`

// verifyDelivered checks, after a new lease moved the position back, that the event stored at
// the sequence this instance last delivered is still the one it delivered. If it is not (a
// restored database numbers new events with sequences it had delivered before), nothing is
// suppressed as a re-delivery: those events are new.
func (c *Consumer) verifyDelivered(ctx context.Context, st *streamState) error {
	var taskID string
	var deletedAt time.Time
	err := c.pool.QueryRow(ctx, eventAtSQL, st.project, st.delivered).Scan(&taskID, &deletedAt)
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("check delivered event: %w", err)
	}
	st.checkDelivered = false
	if err == nil && TaskDeletedEventID(taskID, deletedAt) == st.deliveredID {
		return nil
	}
	c.log.Warn("the history this instance delivered was rewritten (a restored database?): events are not suppressed as re-deliveries",
		zap.String("project_id", st.project), zap.Int64("delivered", st.delivered), zap.Int64("cursor", st.position))
	st.delivered, st.deliveredID = st.position, ""
	return nil
}

func (c *Consumer) handleStreamError(st *streamState, err error) {
	if errors.Is(err, ErrLeaseLost) {
		if !c.leases.lose(st.project, st.epoch) {
			return // already counted
		}
		c.metrics.leaseLost(st.project, string(c.id))
		c.stats.leaseLosses.Add(1)
		c.log.Warn("lease lost; dispatch stopped for the project until it is re-acquired",
			zap.String("project_id", st.project), zap.Int64("epoch", st.epoch))
		return
	}
	c.logTransient("project "+st.project, err)
}

func (c *Consumer) logTransient(what string, err error) {
	if errors.Is(err, context.Canceled) {
		return
	}
	c.log.Warn("consumer step failed; retrying on the next scan", zap.String("step", what), zap.Error(err))
}

// syncStates aligns the loop's stream states with the lease table and returns the projects
// whose lease is held now, sorted.
func (c *Consumer) syncStates() []string {
	held := c.leases.snapshot()
	out := make([]string, 0, len(held))
	for p, l := range held {
		st := c.state[p]
		if st == nil {
			st = &streamState{project: p}
			c.state[p] = st
		}
		if st.lease != l.grant {
			// A new lease: start from the durable cursor it came with. What this instance
			// delivered beyond it is suppressed, once checked to be still what is stored.
			st.lease, st.epoch, st.acked, st.position = l.grant, l.epoch, l.acked, max(l.acked, 0)
			st.checkDelivered = st.delivered > st.position
		}
		out = append(out, p)
	}
	for p := range c.state {
		if _, ok := held[p]; !ok {
			c.state[p].blocked = false
		}
	}
	sort.Strings(out)
	return out
}

// nextRetry is the wait until the earliest blocked stream falls due; ok is false when no
// stream is blocked. The wait may be zero or negative: the retry is due now.
func (c *Consumer) nextRetry() (wait time.Duration, ok bool) {
	var earliest time.Time
	for _, st := range c.state {
		if st.blocked && (earliest.IsZero() || st.retryAt.Before(earliest)) {
			earliest = st.retryAt
		}
	}
	if earliest.IsZero() {
		return 0, false
	}
	return earliest.Sub(c.now()), true
}

// now is the local clock shifted like the database clock, for lease deadlines.
func (c *Consumer) now() time.Time { return time.Now().Add(c.clock.Offset()) }

// offset is the clock offset passed to every time comparison in SQL.
func (c *Consumer) offset() time.Duration { return c.clock.Offset() }

// eventColumns is what scanEvents decodes, in its order.
const eventColumns = `project_id, sequence, event_type, task_id, deleted_at, coalesce(prior_column, ''), archived,
       writer_process_id, occurred_at, payload_version, coalesce(trace_context, '')`

const readEventsSQL = `SELECT ` + eventColumns + `
FROM lifecycle_outbox
WHERE project_id = $1 AND sequence > $2
ORDER BY sequence
LIMIT $3`

func (c *Consumer) readEvents(ctx context.Context, project string, after int64, limit int) ([]storedEvent, error) {
	rows, err := c.pool.Query(ctx, readEventsSQL, project, after, limit)
	if err != nil {
		return nil, fmt.Errorf("read events: %w", err)
	}
	return scanEvents(rows, limit)
}

// storedEvent is an outbox row as read: the event, or why it cannot be delivered.
type storedEvent struct {
	Event
	// bad is why the row cannot be delivered as it is (a timestamp that is not finite, an
	// identifier the writer would have refused); Event then holds what could be read, its
	// Sequence always.
	bad error
}

// scanEvents decodes outbox rows without reflection (the drain path reads many of them) and
// formats each event's ID from its identity columns. A row that cannot be decoded, or that
// holds what the writer never writes, is returned with its reason instead of failing the batch:
// the consumer parks it as a dead letter and the stream goes on.
func scanEvents(rows pgx.Rows, capacity int) ([]storedEvent, error) {
	defer rows.Close()
	out := make([]storedEvent, 0, capacity)
	var checked rowChecks
	for rows.Next() {
		var e storedEvent
		var version int16
		var deletedAt, occurredAt pgtype.Timestamptz
		if err := rows.Scan(&e.ProjectID, &e.Sequence, &e.EventType, &e.TaskID, &deletedAt,
			&e.PriorColumn, &e.Archived, &e.WriterProcessID, &occurredAt, &version, &e.traceContext); err != nil {
			bad, ok := undecodableRow(rows, err)
			if !ok {
				return nil, fmt.Errorf("decode event: %w", err)
			}
			out = append(out, bad)
			continue
		}
		e.PayloadVersion = int(version)
		e.DeletedAt, e.OccurredAt = deletedAt.Time, occurredAt.Time
		e.bad = checked.check(&e.Event, deletedAt, occurredAt)
		if e.bad == nil {
			e.EventID = TaskDeletedEventID(e.TaskID, e.DeletedAt)
		} else {
			e.EventID = undecodableEventID(e.TaskID, deletedAt)
		}
		out = append(out, e)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("read events: %w", err)
	}
	return out, nil
}

// ack is an acknowledgement to write: the cursor of project under lease epoch.
type ack struct {
	project  string
	epoch    int64
	sequence int64
}

func (c *Consumer) pendingAcks() []ack {
	var out []ack
	for _, st := range c.state {
		if st.position > st.acked && st.epoch > 0 {
			out = append(out, ack{st.project, st.epoch, st.position})
		}
	}
	return out
}

// ROWS FROM spells out the multi-argument unnest, whose shorthand exists only unqualified.
const ackSQL = `
UPDATE lifecycle_consumer_cursors c
SET last_acked_sequence = a.sequence, acked_at = pg_catalog.now()
FROM ROWS FROM (pg_catalog.unnest($3::text[]), pg_catalog.unnest($4::bigint[]), pg_catalog.unnest($5::bigint[])) AS a(project_id, epoch, sequence)
WHERE c.consumer_id = $1 AND c.lease_owner = $2
  AND c.project_id = a.project_id AND c.lease_epoch = a.epoch
  AND c.lease_expires_at > pg_catalog.now() + $6::interval AND c.retired_at IS NULL
  AND (c.last_acked_sequence IS NULL OR c.last_acked_sequence <= a.sequence)
RETURNING c.project_id`

// inflightAck is an acknowledgement written in the background while the loop reads and
// dispatches the next batch, so that the cursor commit's WAL flush overlaps useful work.
type inflightAck struct {
	acks    []ack
	written []string
	err     error
	done    chan struct{}
}

// startAck writes a in the background, after applying the one still in flight: at most one
// is in flight, on a second pool connection.
func (c *Consumer) startAck(ctx context.Context, a ack) {
	c.awaitAck()
	p := &inflightAck{acks: []ack{a}, done: make(chan struct{})}
	c.inflight = p
	go func() {
		defer close(p.done)
		p.written, p.err = c.writeAcks(ctx, p.acks)
	}()
}

// awaitAck waits for the acknowledgement in flight, if any, and applies its outcome.
func (c *Consumer) awaitAck() {
	p := c.inflight
	if p == nil {
		return
	}
	c.inflight = nil
	<-p.done
	c.applyAcks(p.acks, p.written, p.err)
}

// flushAcks writes acknowledgements in one fenced statement, after the one in flight. A
// project whose row did not match lost its lease: nothing was written for it.
func (c *Consumer) flushAcks(ctx context.Context, acks []ack) {
	c.awaitAck()
	if len(acks) == 0 {
		return
	}
	written, err := c.writeAcks(ctx, acks)
	c.applyAcks(acks, written, err)
}

// writeAcks runs the fenced acknowledgement statement and returns the projects it wrote.
func (c *Consumer) writeAcks(ctx context.Context, acks []ack) ([]string, error) {
	projects := make([]string, len(acks))
	epochs := make([]int64, len(acks))
	seqs := make([]int64, len(acks))
	for i, a := range acks {
		projects[i], epochs[i], seqs[i] = a.project, a.epoch, a.sequence
	}
	rows, err := c.pool.Query(ctx, ackSQL, c.id, c.owner, projects, epochs, seqs, c.offset())
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// applyAcks records on the loop's stream states what writeAcks did.
func (c *Consumer) applyAcks(acks []ack, ok []string, err error) {
	if err != nil {
		c.logTransient("acknowledge", err)
		return
	}
	written := make(map[string]bool, len(ok))
	for _, p := range ok {
		written[p] = true
	}
	for _, a := range acks {
		st := c.state[a.project]
		if written[a.project] {
			if st != nil && st.epoch == a.epoch && st.acked < a.sequence {
				st.acked = a.sequence
			}
			continue
		}
		if st != nil {
			c.handleStreamError(st, ErrLeaseLost)
		}
	}
}

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
	Scans           int64 // scans of at least one project, each starting with a sequencer call
}

type stats struct {
	delivered, own, suppressed, failures, parked, replayed, reconciliations, leaseLosses, scans atomic.Int64
}

// Stats returns the consumer's counters.
func (c *Consumer) Stats() Stats {
	s := &c.stats
	return Stats{
		Delivered: s.delivered.Load(), Own: s.own.Load(), Suppressed: s.suppressed.Load(), Failures: s.failures.Load(),
		Parked: s.parked.Load(), Replayed: s.replayed.Load(), Reconciliations: s.reconciliations.Load(), LeaseLosses: s.leaseLosses.Load(),
		Scans: s.scans.Load(),
	}
}

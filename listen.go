package outbox

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"

	"fusion/outbox/internal/safetext"
)

// The wake-up channel (Config.TickChannel). The ticker's function sends, when a tick commits,
// "tick/<tick_id>" and then one notification per project with new events, whose payload is
// the project ID and nothing else (migration 0023; notifications of one transaction arrive in
// the order they were sent). An operator's replay request sends "replay/<consumer>/<project>"
// (Admin.RequestReplay). Neither is a project ID ('/' is not allowed in one), so a consumer of
// an earlier build skips them as not its own.
//
// A notification is only a hint, which anyone who may connect can send. It shortens a
// consumer's wait and causes reads, never a decision: the cursor scan is what delivers, so a
// lost project notification costs at most one poll interval and a forged one one scan; a lost
// replay hint costs at most TickFallbackInterval (the consumer reads its open deliveries again
// that often) and a forged one a read of them; an announced tick only says what a standby
// should have replayed, and is checked on the primary before a standby that has not replayed
// it makes a scan wait long or leave it (standby.go). (Writers notify Config.NotifyChannel,
// which only the elected ticker hears.)

// The payloads of the wake-up channel that are not project IDs.
const (
	tickPayloadPrefix   = "tick/"
	replayPayloadPrefix = "replay/"
)

// parseWakePayload checks a notification payload and returns the project it names. Payloads
// that are not ours (anything but a valid project ID) are an error, which the consumer logs
// and skips.
func parseWakePayload(payload string) (string, error) {
	if err := ValidateProjectID(payload); err != nil {
		return "", fmt.Errorf("wake-up payload is not a project ID: %w", err)
	}
	return payload, nil
}

// parseTickPayload returns the tick a "tick/<tick_id>" payload announces: a positive number
// in its canonical form.
func parseTickPayload(payload string) (int64, bool) {
	digits, ok := strings.CutPrefix(payload, tickPayloadPrefix)
	if !ok {
		return 0, false
	}
	id, err := strconv.ParseInt(digits, 10, 64)
	if err != nil || id < 1 || strconv.FormatInt(id, 10) != digits {
		return 0, false
	}
	return id, true
}

// replayPayload is the hint an operator's replay request sends to the consumer that owns the
// dead letter: it has that consumer read the project's open deliveries again.
func replayPayload(consumer, project string) string {
	return replayPayloadPrefix + consumer + "/" + project
}

// parseReplayPayload returns the consumer and project a "replay/<consumer>/<project>" payload
// names, both valid identifiers.
func parseReplayPayload(payload string) (consumer ConsumerID, project string, ok bool) {
	rest, ok := strings.CutPrefix(payload, replayPayloadPrefix)
	if !ok {
		return "", "", false
	}
	c, p, ok := strings.Cut(rest, "/")
	if !ok {
		return "", "", false
	}
	id, err := ParseConsumerID(c)
	if err != nil || ValidateProjectID(p) != nil {
		return "", "", false
	}
	return id, p, true
}

// waker is the consumer's part of its process's LISTEN connection (listen_hub.go): it keeps
// the consumer's self-test (listen_selftest.go) and asks the scan loop to scan the projects
// notifications name.
type waker struct {
	id      ConsumerID
	pool    *pgxpool.Pool
	cfg     consumerConfig
	metrics *Metrics
	log     *zap.Logger
	scans   *scanRequests
	check   wakeupCheck // the self-test's outcome

	// Set by listenLoop for one run.
	ctx       context.Context
	readyOnce *sync.Once
	listening chan struct{}
	tests     sync.WaitGroup // self-test sends in flight
}

// listenLoop joins the process's LISTEN connection for the consumer's pool and channel until
// ctx ends. After every (re)connection the consumer asks for a full scan, so events committed
// while no one listened are caught up. listening is closed once LISTEN is in place or has
// failed.
func (wk *waker) listenLoop(ctx context.Context, listening chan struct{}) {
	wk.ctx, wk.readyOnce, wk.listening = ctx, &sync.Once{}, listening
	defer wk.ready()
	if wk.cfg.TransactionPooler && wk.cfg.ListenDSN == "" {
		// A LISTEN through a transaction pooler hears nothing, and it stays registered on the
		// server connection that ran it. PgBouncer (1.18 at least) then mistakes a notification
		// for the end of its server check and hands the server on with the check's reply still
		// to come: a client reads another statement's answer, and a later check can wait for
		// ever (the runbook's pooler section). So no LISTEN goes through the pool.
		wk.pollOnly("TransactionPooler (transaction_pooler) is set and ListenDSN (listen_dsn) is not; a LISTEN through the pooler would stay behind on a server connection")
		wk.ready()
		<-ctx.Done()
		return
	}
	h := joinHub(wk)
	<-ctx.Done()
	h.leave(wk)
	wk.stopSelfTest()
	wk.tests.Wait()
}

// ready lets the consumer's first scan start.
func (wk *waker) ready() { wk.readyOnce.Do(func() { close(wk.listening) }) }

// connected: LISTEN is in place (again). The consumer catches up on whatever committed while
// no one was listening, and on replay requests whose hints went unheard meanwhile, and
// proves the channel again. Called under the hub's lock: it must not block.
func (wk *waker) connected() {
	wk.scans.requestRead()
	wk.ready()
	wk.startSelfTest()
}

// lost: the LISTEN connection failed or could not be made; the hub tries again in retryIn,
// and the consumer polls meanwhile. Called under the hub's lock.
func (wk *waker) lost(err error, retryIn time.Duration) {
	wk.ready()
	wk.stopSelfTest()
	wk.metrics.listenReconnect(string(wk.id))
	wk.log.Warn("LISTEN connection lost; reconnecting, and polling meanwhile", zap.Error(err), zap.Duration("retry_in", retryIn))
}

// notified acts on one notification. Called under the hub's lock.
func (wk *waker) notified(channel, payload string) {
	if wk.heard(payload) {
		return
	}
	wk.note(channel, payload)
}

// note acts on a notification: a project's wake-up asks for a scan of it, a tick's
// announcement raises the newest tick the loop was told of, and a replay hint for this
// consumer has the loop read the project's open deliveries on its next scan of it.
func (wk *waker) note(channel, payload string) {
	switch {
	case strings.HasPrefix(payload, tickPayloadPrefix):
		if id, ok := parseTickPayload(payload); ok {
			wk.scans.announce(id)
			return
		}
	case strings.HasPrefix(payload, replayPayloadPrefix):
		if consumer, project, ok := parseReplayPayload(payload); ok {
			if consumer == wk.id {
				wk.scans.requestRead(project)
			}
			return
		}
	default:
		if project, err := parseWakePayload(payload); err == nil {
			wk.scans.request(project)
			return
		}
	}
	wk.log.Debug("skipped a notification that is not ours", zap.String("channel", channel), zap.Int("payload_bytes", len(payload)))
}

// closeDedicated closes a connection dedicatedConn opened, ending its session, within 2s.
func closeDedicated(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}

// dedicatedConn opens a connection for LISTEN and the ticker's election: from listenDSN
// (Config.ListenDSN) when set (a pool behind a transaction-pooling proxy cannot LISTEN), else
// hijacked from the pool so it never returns.
func dedicatedConn(ctx context.Context, pool *pgxpool.Pool, listenDSN string) (*pgx.Conn, error) {
	if listenDSN != "" {
		// Config.Validate parsed it already; a parse error is still never wrapped, since pgx's
		// message can hold part of a password and this one would be logged on every reconnect.
		pcfg, err := pgx.ParseConfig(listenDSN)
		if err != nil {
			return nil, fmt.Errorf("connect for LISTEN: ListenDSN does not parse: %s", safetext.DSNParseReason(err))
		}
		conn, err := pgx.ConnectConfig(ctx, pcfg)
		if err != nil {
			return nil, fmt.Errorf("connect for LISTEN: %w", err)
		}
		return conn, nil
	}
	pc, err := pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("acquire LISTEN connection: %w", err)
	}
	conn := pc.Hijack()
	if conn == nil {
		return nil, errors.New("acquire LISTEN connection: hijack returned nil")
	}
	return conn, nil
}

// scanRequests is how the waker and the lease keeper ask the loop for a scan.
type scanRequests struct {
	wake  chan struct{}
	mu    sync.Mutex
	dirty map[string]struct{}
	// stale are the projects whose open deliveries the loop reads again when it next scans
	// them ("" for every project).
	stale map[string]struct{}
	// announced is the newest tick the ticker's notifications announced: a hint, which the
	// loop checks on the primary before it lets a standby make it wait for it (standby.go).
	announced atomic.Int64
	// busy: the loop is scanning, or was asked to scan and has not started; rested is
	// signalled when it stops being either. The elected ticker paces its ticks by them
	// (ticker.pace).
	busy     atomic.Bool
	rested   chan struct{}
	restedAt atomic.Int64 // when the loop last went idle (UnixNano)
}

func newScanRequests() *scanRequests {
	return &scanRequests{wake: make(chan struct{}, 1), dirty: map[string]struct{}{}, stale: map[string]struct{}{},
		rested: make(chan struct{}, 1)}
}

// request asks the loop to look at projects soon (all of them when projects is nil).
func (r *scanRequests) request(projects ...string) {
	r.mu.Lock()
	markAll(r.dirty, projects)
	r.mu.Unlock()
	r.busy.Store(true) // before the wake: the scan it starts rests after it
	r.poke()
}

// requestRead asks the loop to look at projects soon and to read their open deliveries again
// first (all of them when projects is nil).
func (r *scanRequests) requestRead(projects ...string) {
	r.mu.Lock()
	markAll(r.dirty, projects)
	markAll(r.stale, projects)
	r.mu.Unlock()
	r.busy.Store(true)
	r.poke()
}

// working marks the loop busy: it is about to scan.
func (r *scanRequests) working() { r.busy.Store(true) }

// rest marks the loop idle, unless a wake is pending (a request it has not taken), and then
// tells a waiting ticker. A request marks the loop busy before it wakes it, so busy is never
// left set with nothing to do: the scan the wake starts rests after it. A request that races
// with rest may leave the loop idle for a moment before that wake, which only lets one tick
// through unheld.
func (r *scanRequests) rest() {
	r.restedAt.Store(time.Now().UnixNano())
	r.busy.Store(false)
	if len(r.wake) > 0 {
		r.busy.Store(true)
		return
	}
	select {
	case r.rested <- struct{}{}:
	default:
	}
}

// idleFor is how long the loop has been idle (meaningful while it is).
func (r *scanRequests) idleFor() time.Duration {
	return time.Duration(time.Now().UnixNano() - r.restedAt.Load())
}

// markAll adds projects to set, or "" (every project) when projects is nil.
func markAll(set map[string]struct{}, projects []string) {
	if projects == nil {
		set[""] = struct{}{}
	}
	for _, p := range projects {
		set[p] = struct{}{}
	}
}

// announce raises the newest announced tick to id.
func (r *scanRequests) announce(id int64) {
	for {
		cur := r.announced.Load()
		if id <= cur || r.announced.CompareAndSwap(cur, id) {
			return
		}
	}
}

// poke wakes the loop without asking for a scan: for the work it does on every wake (releasing
// dropped leases).
func (r *scanRequests) poke() {
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// take returns the projects to scan, whether a full scan was asked for, and the projects whose
// open deliveries to read again ("" for all).
func (r *scanRequests) take() (dirty map[string]struct{}, all bool, stale map[string]struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	dirty, stale = r.dirty, r.stale
	r.dirty, r.stale = map[string]struct{}{}, map[string]struct{}{}
	_, all = dirty[""]
	return dirty, all, stale
}

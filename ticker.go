package outbox

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
)

// Ordering by snapshot ticks (migration 0018). Writers insert each event once into the event
// log. A ticker stores the current transaction snapshot as a tick whenever events committed
// since the last one, and counts each tick's batch per project: an event's sequence is its
// project's count so far plus its rank in the tick, worked out when it is read. Consumers only
// read: the ticker numbers once for all of them, and notifies them of what it numbered.

// Head is a project's stream position as the ticker left it.
type Head struct {
	ProjectID     string
	LastSequence  int64 // the last sequence numbered
	PrunedThrough int64 // events at or below this may have been pruned
	Assigned      int   // sequences numbered by the call that returned it (Sequence only)
}

// TickResult is what one call of Tick numbered.
type TickResult struct {
	TickID   int64 // the last tick taken; 0 when nothing had committed since the last tick
	Ticks    int   // how many ticks the call took
	Projects int   // projects with new events, summed over the ticks
	Events   int64 // events numbered
	Adopted  int64 // rows of writers of schema 16 and earlier moved into the log first
}

// ErrXIDTimeline is returned by Tick when the cluster's transaction IDs are behind the last
// tick: the database was moved into another cluster by a logical dump and restore or by
// logical replication. Ticking would then hide events; the error's hint says what to do
// (docs/operations.md, "Moving the database").
var ErrXIDTimeline = errors.New("the transaction ID timeline is behind the last tick")

// tickSQL calls the ticker function; the cast makes it an exact match for the module's.
const tickSQL = `SELECT coalesce(tick_id, 0), projects, events, legacy FROM lifecycle_outbox_tick($1::text)`

// tickerLockSQL waits for the advisory lock that elects the ticker.
const tickerLockSQL = `SELECT pg_catalog.pg_advisory_lock($1)`

// adoptSQL moves rows of older writers into the log.
const adoptSQL = `SELECT lifecycle_outbox_adopt_legacy($1::integer)`

// headsSQL reads the heads of projects.
const headsSQL = `SELECT project_id, last_sequence, pruned_through FROM lifecycle_outbox_head WHERE project_id = ANY ($1::text[])`

// allHeadsSQL reads every head the role may see.
const allHeadsSQL = `SELECT project_id, last_sequence, pruned_through FROM lifecycle_outbox_head`

// adoptBatch is how many rows of older writers one statement adopts.
const adoptBatch = 10000

// Tick numbers every event committed so far: it adopts rows of writers of schema 16 and
// earlier into the log, then takes a tick if anything committed since the last one. It
// announces nothing; the consumers' ticker does (Config.TickChannel). It must not run inside a
// REPEATABLE READ or SERIALIZABLE transaction: the database function refuses. A database whose
// transaction IDs are behind its last tick fails with ErrXIDTimeline.
func Tick(ctx context.Context, db DBTX) (TickResult, error) {
	return tick(ctx, db, "")
}

// tick is Tick, announcing on channel when it is not empty.
func tick(ctx context.Context, db DBTX, channel string) (TickResult, error) {
	var res TickResult
	var ch *string
	if channel != "" {
		ch = &channel
	}
	for round := 0; ; round++ {
		var id int64
		var projects int32
		var events int64
		var legacy bool
		if err := db.QueryRow(ctx, tickSQL, ch).Scan(&id, &projects, &events, &legacy); err != nil {
			return res, tickError(err)
		}
		if id != 0 {
			res.TickID, res.Ticks = id, res.Ticks+1
			res.Projects += int(projects)
			res.Events += events
		}
		if !legacy || round > 0 {
			// Rows adopted in the first round are numbered by this second tick; rows older
			// writers commit meanwhile wait for the next call.
			return res, nil
		}
		for {
			var n int64
			if err := db.QueryRow(ctx, adoptSQL, adoptBatch).Scan(&n); err != nil {
				return res, fmt.Errorf("adopt rows of older writers: %w", err)
			}
			res.Adopted += n
			if n < adoptBatch {
				break
			}
		}
	}
}

// tickError wraps the ticker function's refusal of a broken xid timeline as ErrXIDTimeline,
// keeping the database's message and hint.
func tickError(err error) error {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == sqlstateXIDTimeline {
		return fmt.Errorf("tick: %w: %s (%s)", ErrXIDTimeline, pgErr.Message, pgErr.Hint)
	}
	return fmt.Errorf("tick: %w", err)
}

// Sequence numbers every committed event (see Tick) and returns the heads of projects (every
// project the role may see when projects is nil), with Assigned set to what this call numbered
// in each. limit bounds the rows of older writers adopted per statement (at most 100000).
func Sequence(ctx context.Context, db DBTX, projects []string, limit int) (map[string]Head, error) {
	if limit < 1 || limit > 100000 {
		return nil, fmt.Errorf("sequence: limit %d is not between 1 and 100000", limit)
	}
	before, err := readHeads(ctx, db, projects)
	if err != nil {
		return nil, fmt.Errorf("sequence: %w", err)
	}
	if _, err := Tick(ctx, db); err != nil {
		return nil, fmt.Errorf("sequence: %w", err)
	}
	after, err := readHeads(ctx, db, projects)
	if err != nil {
		return nil, fmt.Errorf("sequence: %w", err)
	}
	for p, h := range after {
		h.Assigned = int(h.LastSequence - before[p].LastSequence)
		after[p] = h
	}
	return after, nil
}

// readHeads reads the heads of projects (every head the role may see when projects is nil).
func readHeads(ctx context.Context, db DBTX, projects []string) (map[string]Head, error) {
	var rows pgx.Rows
	var err error
	if projects == nil {
		rows, err = db.Query(ctx, allHeadsSQL)
	} else {
		rows, err = db.Query(ctx, headsSQL, projects)
	}
	if err != nil {
		return nil, fmt.Errorf("read heads: %w", err)
	}
	got, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (Head, error) {
		var h Head
		return h, row.Scan(&h.ProjectID, &h.LastSequence, &h.PrunedThrough)
	})
	if err != nil {
		return nil, fmt.Errorf("read heads: %w", err)
	}
	heads := make(map[string]Head, len(got))
	for _, h := range got {
		heads[h.ProjectID] = h
	}
	return heads, nil
}

// tickerLockKey is the session advisory lock that elects one ticker among the processes.
const tickerLockKey int64 = 0x6c69666574696b72 // "lifetikr"

// ticker is a consumer's candidacy as the database's ticker. The elected one (holding
// tickerLockKey on its dedicated connection) listens to the writers' hints and ticks on them,
// at most once per TickFloor, and again after each tick that found events until one finds
// none, so a busy stream is ticked every TickFloor whatever the writers' hint gap, unless its
// own consumer falls behind (pace, tickGap: then up to TickBusyWait). The others
// wait for the lock on their own connection, which costs no statement, and take over the moment
// the elected one's session ends. Whoever is elected, every candidate also ticks once per
// TickFallbackInterval if it saw no tick of its own: a session holding the lock without ticking
// (another role can take an advisory lock) slows delivery to that interval and stops nothing.
//
// An event whose writer sent no hint (it died between its commit and its hint, or its
// notification failed) is found by the elected ticker's own consumer: its poll's read of heads
// also says whether events committed that no tick numbered, in any project, and it then asks
// its ticker for a tick (scanLoop.hintTicker). So the elected ticker, idle, ticks only once per
// TickFallbackInterval, and such an event waits about one PollInterval, plus a tick and a scan;
// TickFallbackInterval at most, whatever the consumers do.
type ticker struct {
	pool    *pgxpool.Pool
	cfg     consumerConfig
	log     *zap.Logger
	metrics *Metrics
	stats   *stats
	elected chan bool // tells the tick loop when this candidate is elected or not
	hints   chan struct{}
	own     *scanRequests // its own consumer's loop, which paces its ticks while elected (pace)
	leading atomic.Bool   // the tick loop's view: elected
	calls   atomic.Int64  // tick calls that returned, for tests that must know the first one did
}

func newTicker(pool *pgxpool.Pool, cfg consumerConfig, log *zap.Logger, metrics *Metrics, st *stats, own *scanRequests) *ticker {
	return &ticker{pool: pool, cfg: cfg, log: log.Named("ticker"), metrics: metrics, stats: st,
		elected: make(chan bool, 1), hints: make(chan struct{}, 1), own: own}
}

// campaigns reports whether the candidate campaigns for election: not without notifications
// (NotifyDisabled), nor without a session of its own behind a transaction pooler.
func (t *ticker) campaigns() bool {
	return !t.cfg.NotifyDisabled && !(t.cfg.TransactionPooler && t.cfg.ListenDSN == "")
}

// poke asks the ticker for a tick, as a writer's hint does: the consumer's poll found events
// committed that no tick numbered (scanLoop.hintTicker). Only the elected one ticks on it.
func (t *ticker) poke() {
	select {
	case t.hints <- struct{}{}:
	default: // a tick is already asked for
	}
}

// run campaigns and ticks until ctx ends. A tick in flight then runs to its end, unless
// abandoned is closed (the Stop's own context ended): cutting it off would not stop it, since
// the server runs the statement on until the driver's cancel request reaches it, and a tick
// that commits meanwhile would number events after the consumer stopped, uncounted.
func (t *ticker) run(ctx context.Context, abandoned <-chan struct{}) {
	tickCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	go func() {
		select {
		case <-abandoned:
			cancel()
		case <-tickCtx.Done():
		}
	}()
	if !t.campaigns() {
		// No session of its own to be elected on, or no hints to hear: tick on the poll interval.
		t.loop(ctx, tickCtx, t.cfg.PollInterval)
		return
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		t.campaign(ctx)
	}()
	t.loop(ctx, tickCtx, t.cfg.TickFallbackInterval)
	<-done
}

// loop ticks when elected (on hints and follow-ups) and, elected or not, once per fallback when
// no tick of its own happened for that long. It starts no tick once ctx ended; the ticks run
// on tickCtx (see run).
func (t *ticker) loop(ctx, tickCtx context.Context, fallback time.Duration) {
	elected := false
	last := time.Time{}
	followUp := false
	gap := tickGap{floor: t.cfg.TickFloor, ceiling: t.cfg.TickBusyWait, cur: t.cfg.TickFloor}
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		var wait time.Duration
		switch {
		case elected && followUp:
			wait = gap.cur - time.Since(last)
		case elected:
			// The idle tick, once per TickFallbackInterval without a tick: this consumer's polls
			// ask for a tick when an event committed without a hint (scanLoop.hintTicker), so
			// this only bounds what happens when they cannot.
			wait = t.cfg.TickFallbackInterval - time.Since(last)
		default:
			wait = fallback - time.Since(last)
		}
		timer.Reset(max(wait, 0))
		select {
		case <-ctx.Done():
			return
		case elected = <-t.elected:
			timer.Stop()
			t.leading.Store(elected)
			if elected {
				t.log.Info("elected as the ticker")
			}
			followUp = elected // a new ticker ticks at once: its predecessor may have left work
			continue
		case <-t.hints:
			timer.Stop()
			if !elected {
				continue
			}
			if floor := gap.cur - time.Since(last); floor > 0 {
				if !sleepCtx(ctx, floor) {
					return
				}
			}
			if !t.pace(ctx, last, &gap) {
				return
			}
		case <-timer.C:
			if elected && followUp && !t.pace(ctx, last, &gap) {
				return
			}
		}
		if ctx.Err() != nil {
			return // the select may have taken another ready case: no tick once stopping
		}
		res, err := tick(tickCtx, t.pool, t.cfg.TickChannel)
		last = time.Now()
		t.calls.Add(1)
		if err != nil {
			if ctx.Err() != nil {
				return
			}
			if errors.Is(err, ErrXIDTimeline) {
				t.log.Error("ticking refused: events are held back until the operator fixes the transaction ID timeline", zap.Error(err))
			} else {
				logTransient(t.log, "tick", err)
			}
			followUp = false
			continue
		}
		followUp = elected && res.Events > 0
		if res.Ticks > 0 {
			t.stats.ticks.Add(int64(res.Ticks))
			t.stats.numbered.Add(res.Events)
			t.metrics.ticked(res.Ticks, res.Events)
		}
	}
}

// pace is called when the elected ticker's next tick is due (gap.cur after the last). It holds
// the tick back while its own consumer is still busy with what the ticks before brought, until
// TickBusyWait after the last tick, and moves the gap by what it saw. A tick costs every
// consumer a read whatever it holds: ticking faster than the consumers read adds reads, and
// the server time they take, without bringing any event sooner. While they keep up (the
// consumer rests between ticks) this waits for nothing, and ticks follow every TickFloor. The
// elected one's consumer stands for all of them; one kept busy by a slow listener slows the
// ticks to one per TickBusyWait, not further. It reports false when ctx ended.
func (t *ticker) pace(ctx context.Context, last time.Time, gap *tickGap) bool {
	if t.own.busy.Load() {
		gap.busy()
	} else {
		gap.rested(t.own.idleFor())
	}
	held := false
	for t.own.busy.Load() {
		left := t.cfg.TickBusyWait - time.Since(last)
		if left <= 0 {
			return true
		}
		if !held {
			held = true
			t.stats.ticksHeld.Add(1)
			t.metrics.tickHeld()
		}
		tm := time.NewTimer(left)
		select {
		case <-ctx.Done():
			tm.Stop()
			return false
		case <-t.own.rested: // look again: it may be busy once more
		case <-tm.C:
		}
		tm.Stop()
	}
	return ctx.Err() == nil
}

// tickGap is the elected ticker's shortest time between two ticks while they find events. It is
// TickFloor while its own consumer keeps up. Each time the consumer is still busy when a tick
// falls due, the gap doubles, up to TickBusyWait: the consumers are behind, and fewer ticks
// each bring them more events for the same reads. Each time the consumer had rested for at
// least half the gap, it halves, back down to TickFloor: they have time to spare, and ticks
// come sooner. In between it stays. Owned by the tick loop.
type tickGap struct {
	floor, ceiling, cur time.Duration
}

func (g *tickGap) busy() { g.cur = min(2*g.cur, g.ceiling) }

func (g *tickGap) rested(idle time.Duration) {
	if idle >= g.cur/2 {
		g.cur = max(g.cur/2, g.floor)
	}
}

// campaign keeps a dedicated connection waiting for, then holding, the election lock, and
// listens there to the writers' hints while elected. It tells the loop when it wins or loses.
func (t *ticker) campaign(ctx context.Context) {
	b := newBackoff()
	for {
		err := t.campaignOnce(ctx)
		t.setElected(false)
		if ctx.Err() != nil {
			return
		}
		logTransient(t.log, "ticker election", err)
		if !b.sleep(ctx) {
			return
		}
	}
}

func (t *ticker) campaignOnce(ctx context.Context) error {
	conn, err := dedicatedConn(ctx, t.pool, t.cfg.ListenDSN)
	if err != nil {
		return err
	}
	defer closeDedicated(conn) // ends the session: the lock goes to the next candidate
	// Blocks, without a statement a second, until the elected one's session ends. It listens
	// only once elected: a session that listens without reading holds the server's
	// notification queue back for every listener.
	if _, err := conn.Exec(ctx, tickerLockSQL, tickerLockKey); err != nil {
		return fmt.Errorf("wait for the ticker lock: %w", err)
	}
	// LISTEN takes no parameter: the configured channel is quoted as an identifier.
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{t.cfg.NotifyChannel}.Sanitize()); err != nil {
		return fmt.Errorf("listen for hints: %w", err)
	}
	t.setElected(true) // its first tick covers what committed before the LISTEN
	for {
		if err := conn.PgConn().WaitForNotification(ctx); err != nil {
			return fmt.Errorf("wait for hints: %w", err)
		}
		select {
		case t.hints <- struct{}{}:
		default: // a tick is already asked for; it covers this hint too
		}
	}
}

func (t *ticker) setElected(v bool) {
	select {
	case <-t.elected:
	default:
	}
	t.elected <- v
}

// backoff is the wait between attempts to reconnect (the LISTEN connection, the ticker's
// election, the self-test's send): 100ms, doubled after each wait, up to 5s.
type backoff struct{ wait time.Duration }

func newBackoff() backoff { return backoff{wait: 100 * time.Millisecond} }

// sleep waits b.wait, or until ctx ends (then it reports false), and doubles the next wait.
func (b *backoff) sleep(ctx context.Context) bool {
	if !sleepCtx(ctx, b.wait) {
		return false
	}
	b.wait = min(2*b.wait, 5*time.Second)
	return true
}

// reset starts the waits again from the first: the connection was made.
func (b *backoff) reset() { *b = newBackoff() }

// sleepCtx waits for d or ctx, and reports whether d passed.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-tm.C:
		return true
	}
}

// ProjectErrors is returned by a call that serves several projects when some of them failed
// and the others did not: what it returned holds every other project. One project's broken
// rows cost only that project.
type ProjectErrors struct {
	Op     string           // what failed, e.g. "status"
	Failed map[string]error // by project ID
}

func (e *ProjectErrors) Error() string {
	projects := e.Projects()
	parts := make([]string, len(projects))
	for i, p := range projects {
		parts[i] = fmt.Sprintf("project %s: %v", p, e.Failed[p])
	}
	return fmt.Sprintf("%s: %d of the projects failed: %s", e.Op, len(projects), strings.Join(parts, "; "))
}

// Projects returns the projects that failed, sorted.
func (e *ProjectErrors) Projects() []string {
	out := make([]string, 0, len(e.Failed))
	for p := range e.Failed {
		out = append(out, p)
	}
	sort.Strings(out)
	return out
}

package outbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"

	"fusion/outbox/internal/safetext"
)

// Reading from a hot standby (Config.ReadDSN). A scan reads the heads, the events and a
// reconciliation's snapshot from one source: the standby, or the primary (the consumer's
// pool). Everything the consumer writes or locks stays on the primary, and so does what it
// reads of its own state (open deliveries, cursors, leases).
//
// What keeps it correct:
//   - A scan starts by reading the heads on the standby, or its ticks (scanLoop.startByTick).
//     The standby serves the scan only once it has replayed the tick the scan must see
//     (standbyWant): the newest tick the ticker announced (each tick's notifications start
//     with "tick/<tick_id>", before those of its projects, so the tick whose notification
//     started the scan is known when it starts), the newest the
//     primary showed when the scan also read open deliveries there (openWithTickSQL: at least
//     every TickFallbackInterval, and after the LISTEN connection was lost), and every tick the
//     consumer saw before. So the tick whose notification started the scan is never missed,
//     and a head never goes back below what the stream reached (which would look like a
//     restored database). A scan waits up to ReadMaxLag for the standby to get there, then
//     reads from the primary instead. A scan that the standby serves at once sends the primary
//     no statement.
//   - An announced tick is a hint, which anyone who may NOTIFY can forge. When the standby has
//     not replayed it within standbyGrace, the scan reads the primary's newest tick (one
//     statement) and waits for that instead: a forged announcement costs that read and the
//     grace, never a long wait or a fallback. Only a tick the primary showed makes a scan wait
//     for ReadMaxLag or leave the standby.
//   - Heads and events of a scan come from the same server, so a head never counts events its
//     server does not show. When a read on the standby fails, or finds a hole, the rest of the
//     scan reads from the primary, which holds everything the standby does: a standby never
//     turns into a reconciliation.
//   - The cursor moves only with what was dispatched, whichever server it was read from.
//
// A statement the standby cancels for a conflict with recovery is retried, and after
// readConflictRetries the scan reads from the primary; it never counts against an event. A
// standby that cannot be reached, or that made a scan wait ReadMaxLag, is left: the consumer
// reads from the primary (logged once, counted), probes the standby on each scan, and returns
// to it once it has replayed the primary's newest tick (logged once, counted).

// errNotStandby refuses a connection of the read pool to a server that is not in recovery.
var errNotStandby = errors.New("the ReadDSN (read_dsn) server is not in recovery: not a standby (promoted, or a primary)")

// readConflictRetries is how often a read the standby cancelled for a recovery conflict is
// tried again on the standby before the scan reads from the primary.
const readConflictRetries = 3

// Reasons the consumer reads from the primary instead of the standby (the reason label of
// outbox_read_fallbacks_total).
const (
	fallbackLag         = "lag"         // the standby did not replay the newest tick within ReadMaxLag
	fallbackUnreachable = "unreachable" // the standby could not be reached or failed a read
)

// newestTickSQL reads the newest tick: the standby's probe.
const newestTickSQL = `SELECT n.tick_id, n.ticked_at FROM lifecycle_tick n ORDER BY n.tick_id DESC LIMIT 1`

// newestTick reads db's newest tick (newestTickSQL); pgx.ErrNoRows when it has none.
func newestTick(ctx context.Context, db DBTX) (tick int64, at time.Time, err error) {
	err = db.QueryRow(ctx, newestTickSQL).Scan(&tick, &at)
	return tick, at, err
}

// inRecoverySQL asks a server whether it is a standby.
const inRecoverySQL = `SELECT pg_catalog.pg_is_in_recovery()`

// standbyNewestTickSQL is newestTickSQL with whether the server is a standby, for
// CompareStandby.
const standbyNewestTickSQL = `
SELECT n.tick_id, n.ticked_at, pg_catalog.pg_is_in_recovery() FROM lifecycle_tick n ORDER BY n.tick_id DESC LIMIT 1`

// openWithTickSQL is openDeliveriesSQL (word for word: the prepare test checks) with the newest
// tick on every row, and one row with only the tick when nothing is open: the primary's tick
// costs no statement of its own.
const openWithTickSQL = `
SELECT t.tick_id, t.ticked_at, d.project_id, d.sequence, d.event_id, d.state, d.attempts, d.due, d.wait_seconds
FROM (SELECT n.tick_id, n.ticked_at FROM lifecycle_tick n ORDER BY n.tick_id DESC LIMIT 1) t
LEFT JOIN (
    SELECT project_id, sequence, event_id, state, attempts,
           coalesce(due_at <= pg_catalog.now() + $3::interval + interval '1 millisecond', true),
           CASE WHEN due_at IS NULL OR due_at <= pg_catalog.now() + $3::interval THEN 0
                WHEN due_at >= pg_catalog.now() + $3::interval + interval '1 day' THEN 86400
                ELSE extract(epoch FROM due_at - (pg_catalog.now() + $3::interval))::float8
           END
    FROM (
        SELECT project_id, sequence, event_id, state, attempts,
               least(next_attempt_at, last_failed_at + interval '1 day') AS due_at
        FROM lifecycle_consumer_deliveries
        WHERE consumer_id = $1 AND project_id = ANY ($2::text[]) AND state IN ('retrying', 'replay_requested')
    ) d
    ORDER BY project_id, sequence
) AS d (project_id, sequence, event_id, state, attempts, due, wait_seconds) ON true
ORDER BY d.project_id, d.sequence`

// readSource is where a consumer's scans read: the standby when Config.ReadDSN is set and it
// serves, else the primary. Its fields other than the pool are the loop goroutine's.
type readSource struct {
	cfg     consumerConfig
	id      ConsumerID
	log     *zap.Logger
	metrics *Metrics
	stats   *stats

	standby *pgxpool.Pool // opened at start, closed at shutdown; nil without ReadDSN

	fallen     bool      // reading from the primary until the standby catches up
	probeAfter time.Time // no probe of an unreachable standby before then
	// scanStandby: the scan under way reads from the standby. It only goes from true to false
	// within a scan: the primary holds everything the standby does, not the other way.
	scanStandby bool
}

// configured reports whether a standby was configured.
func (r *readSource) configured() bool { return r != nil && r.cfg.ReadDSN != "" }

// open takes the standby's pool; it connects lazily, so a standby down at start costs nothing
// but the fallback.
func (r *readSource) open() error {
	if !r.configured() {
		return nil
	}
	pool, err := standbyPools.take(r.cfg.ReadDSN, r.cfg.ReadMaxLag)
	if err != nil {
		return err
	}
	r.standby = pool
	return nil
}

func (r *readSource) close() {
	if r != nil && r.standby != nil {
		standbyPools.give(r.cfg.ReadDSN, r.cfg.ReadMaxLag)
		r.standby = nil
	}
}

// The consumers of one process that read from the same standby (the same ReadDSN, so the same
// role) share its pool, as they share the primary's: their reads of heads and first batches
// are then shared too (shared_reads.go), and K consumers cost the standby one read per tick.
// The pool closes when the last of them stops.
var standbyPools = &sharedStandbyPools{pools: map[standbyPoolKey]*standbyPool{}}

type sharedStandbyPools struct {
	mu    sync.Mutex
	pools map[standbyPoolKey]*standbyPool
}

// standbyPoolKey: the DSN and the connect timeout the pool was made with (ReadMaxLag bounds it).
type standbyPoolKey struct {
	dsn     string
	maxWait time.Duration
}

type standbyPool struct {
	pool  *pgxpool.Pool
	users int
}

// standbyPoolConns bounds the shared pool: each consumer's loop reads the heads and a probe at
// once at most, and reads shared between consumers take one connection for all of them.
const standbyPoolConns = 8

// take returns the pool for dsn, opening it for the first user.
func (s *sharedStandbyPools) take(dsn string, maxWait time.Duration) (*pgxpool.Pool, error) {
	key := standbyPoolKey{dsn: dsn, maxWait: maxWait}
	s.mu.Lock()
	defer s.mu.Unlock()
	if sp := s.pools[key]; sp != nil {
		sp.users++
		return sp.pool, nil
	}
	pool, err := openStandbyPool(dsn, maxWait)
	if err != nil {
		return nil, err
	}
	s.pools[key] = &standbyPool{pool: pool, users: 1}
	return pool, nil
}

// give hands back the pool take returned for dsn and maxWait; the last user closes it.
func (s *sharedStandbyPools) give(dsn string, maxWait time.Duration) {
	key := standbyPoolKey{dsn: dsn, maxWait: maxWait}
	s.mu.Lock()
	sp := s.pools[key]
	if sp == nil {
		s.mu.Unlock()
		return
	}
	sp.users--
	last := sp.users == 0
	if last {
		delete(s.pools, key)
	}
	s.mu.Unlock()
	if last {
		sp.pool.Close()
	}
}

// openStandbyPool opens a pool to the standby at dsn, whose connections refuse a server that is
// not in recovery.
func openStandbyPool(dsn string, maxWait time.Duration) (*pgxpool.Pool, error) {
	pcfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("ReadDSN (read_dsn) does not parse: %s", safetext.DSNParseReason(err))
	}
	pcfg.MaxConns = standbyPoolConns
	if pcfg.ConnConfig.ConnectTimeout == 0 || pcfg.ConnConfig.ConnectTimeout > maxWait {
		pcfg.ConnConfig.ConnectTimeout = maxWait
	}
	// A server that is not in recovery is not a standby of the primary (a promoted one, or a
	// primary by mistake): its ticks and events may not be the primary's, so it serves nothing.
	pcfg.AfterConnect = func(ctx context.Context, conn *pgx.Conn) error {
		var inRecovery bool
		if err := conn.QueryRow(ctx, inRecoverySQL).Scan(&inRecovery); err != nil {
			return err
		}
		if !inRecovery {
			return errNotStandby
		}
		return nil
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), pcfg)
	if err != nil {
		return nil, fmt.Errorf("open the standby's pool: %w", err)
	}
	return pool, nil
}

// fallBack makes the consumer read from the primary until the standby catches up: logged
// once, counted.
func (r *readSource) fallBack(reason string, lagTicks int64, lag time.Duration, err error) {
	r.scanStandby = false
	if reason == fallbackUnreachable {
		r.probeAfter = time.Now().Add(r.cfg.ReadMaxLag)
	}
	if r.fallen {
		return
	}
	r.fallen = true
	r.stats.onStandby.Store(false)
	r.stats.readFallbacks.Add(1)
	r.metrics.readFallback(string(r.id), reason)
	fields := []zap.Field{zap.String("reason", reason), zap.Int64("lag_ticks", lagTicks), zap.Duration("lag", lag),
		zap.Duration("read_max_lag", r.cfg.ReadMaxLag)}
	if err != nil {
		fields = append(fields, zap.Error(err))
	}
	r.log.Warn("reading from the primary instead of the standby until the standby catches up", fields...)
}

// returnToStandby makes the next scan read from the standby again: logged once, counted.
func (r *readSource) returnToStandby(tick int64) {
	r.fallen = false
	r.stats.onStandby.Store(true)
	r.stats.readReturns.Add(1)
	r.metrics.readReturn(string(r.id))
	r.log.Info("reading from the standby again: it has replayed the primary's newest tick", zap.Int64("tick", tick))
}

// setLag records how far the standby is behind the primary.
func (r *readSource) setLag(ticks int64, lag time.Duration) {
	ticks, lag = max(ticks, 0), max(lag, 0)
	r.stats.lagTicks.Store(ticks)
	r.stats.lagNanos.Store(int64(lag))
	r.metrics.readLag(string(r.id), ticks, lag)
}

// headsRead is what one read of heads returned: the heads, the source's newest tick and when
// it was taken, and when the tick the loop saw last was taken there (nil when not stored);
// unticked when asked for (see loopHeadsSQL).
type headsRead struct {
	heads    map[string]Head
	newest   int64
	newestAt time.Time
	seenAt   *time.Time
	unticked bool
}

// queryHeads reads the heads of projects on db (loopHeadsSQL) with the newest tick, and
// whether events committed that no tick numbered when unticked is set.
func queryHeads(ctx context.Context, db DBTX, projects []string, seenTick int64, unticked bool) (headsRead, error) {
	sql := loopHeadsSQL
	if unticked {
		sql = loopHeadsUntickedSQL
	}
	rows, err := db.Query(ctx, sql, projects, seenTick)
	if err != nil {
		return headsRead{}, fmt.Errorf("read heads: %w", err)
	}
	hr := headsRead{heads: make(map[string]Head, len(projects))}
	for rows.Next() {
		var project *string
		var h Head
		var last, floor *int64
		dest := []any{&project, &last, &floor, &hr.newest, &hr.newestAt, &hr.seenAt}
		if unticked {
			dest = append(dest, &hr.unticked)
		}
		if err := rows.Scan(dest...); err != nil {
			rows.Close()
			return headsRead{}, fmt.Errorf("read heads: %w", err)
		}
		if project != nil {
			h.ProjectID, h.LastSequence, h.PrunedThrough = *project, *last, *floor
			hr.heads[h.ProjectID] = h
		}
	}
	if err := rows.Err(); err != nil {
		return headsRead{}, fmt.Errorf("read heads: %w", err)
	}
	return hr, nil
}

// openWithTick reads the open deliveries of projects and the primary's newest tick in one
// statement. When it fails, the deliveries are read as without a standby (project by project
// if need be) and the tick is unknown (tick 0).
func (s *deliveryStore) openWithTick(ctx context.Context, db DBTX, projects []string) (open map[string][]delivery, tick int64, tickAt time.Time, err error) {
	rows, err := db.Query(ctx, openWithTickSQL, s.id, projects, s.offset())
	if err == nil {
		open, tick, tickAt, err = scanOpenWithTick(rows, s.cfg.Clock)
	}
	if err == nil || ctx.Err() != nil {
		return open, tick, tickAt, err
	}
	open, err = s.open(ctx, db, projects)
	return open, 0, time.Time{}, err
}

func scanOpenWithTick(rows pgx.Rows, clock Clock) (map[string][]delivery, int64, time.Time, error) {
	defer rows.Close()
	type row struct {
		project string
		d       delivery
		due     bool
		wait    time.Duration
	}
	var got []row
	var tick int64
	var tickAt time.Time
	for rows.Next() {
		var p, eventID, state *string
		var sequence *int64
		var attempts *int
		var due *bool
		var waitSeconds *float64
		if err := rows.Scan(&tick, &tickAt, &p, &sequence, &eventID, &state, &attempts, &due, &waitSeconds); err != nil {
			return nil, 0, time.Time{}, err
		}
		if p == nil {
			continue // nothing open: the row carries the tick alone
		}
		if sequence == nil || eventID == nil || state == nil || attempts == nil || due == nil || waitSeconds == nil {
			return nil, 0, time.Time{}, errors.New("read open deliveries: a delivery row with a NULL column")
		}
		got = append(got, row{project: *p, d: delivery{sequence: *sequence, eventID: *eventID, state: DeliveryState(*state),
			attempts: *attempts}, due: *due, wait: clampWait(*waitSeconds)})
	}
	if err := rows.Err(); err != nil {
		return nil, 0, time.Time{}, err
	}
	readAt := shiftedNow(clock)
	out := map[string][]delivery{}
	for _, r := range got {
		r.d.dueAt = dueAfter(readAt, r.due, r.wait)
		out[r.project] = append(out[r.project], r.d)
	}
	return out, tick, tickAt, nil
}

// scanStart reads what a scan starts from: the heads of held, and the open deliveries of
// reading (those the loop must read, see openToRead), the latter on the primary, the former on
// the scan's source, which it picks (see the top of this file). The heads are applied to the
// stream states as readHeads does; unticked asks the read of heads whether events committed
// that no tick numbered (loopHeadsSQL).
func (l *scanLoop) scanStart(ctx context.Context, held, reading []string, unticked bool) (heads map[string]Head, open map[string][]delivery, headsErr, openErr error) {
	r := l.reads
	r.scanStandby = false
	if !r.configured() {
		var opened chan struct{}
		if len(reading) > 0 {
			opened = make(chan struct{})
			go func() {
				defer close(opened)
				open, openErr = l.store.open(ctx, l.pool, reading)
			}()
		}
		heads, headsErr = l.readHeads(ctx, held, unticked)
		if opened != nil {
			<-opened
		}
		return heads, open, headsErr, openErr
	}
	if r.fallen {
		return l.scanStartFallen(ctx, held, reading, unticked)
	}
	announced := l.scans.announced.Load()
	want, checked := l.standbyWant(announced)
	var wantAt time.Time
	var primaryTick int64
	var primaryTickAt time.Time
	var opened chan struct{}
	if len(reading) > 0 {
		opened = make(chan struct{})
		go func() {
			defer close(opened)
			open, primaryTick, primaryTickAt, openErr = l.store.openWithTick(ctx, l.pool, reading)
		}()
	}
	hr, err := l.standbyHeads(ctx, held, unticked)
	if opened != nil {
		<-opened
		if primaryTick != 0 {
			l.checked(announced, primaryTick)
			want, wantAt, checked = max(primaryTick, l.seenTick), primaryTickAt, true
		}
	}
	switch {
	case ctx.Err() != nil:
		return nil, open, ctx.Err(), openErr
	case err != nil && !standbyDown(err):
		// Cancelled again and again by recovery conflicts, or a failure the primary may share:
		// this scan reads from the primary, the next tries the standby again.
	case err != nil:
		r.fallBack(fallbackUnreachable, 0, 0, err)
	case opened != nil && primaryTick == 0:
		// The primary's tick is unknown (its read failed): this scan reads from the primary.
	default:
		replayed := hr.newest >= want
		if !replayed {
			// The heads are read again once the standby has replayed the tick.
			if _, replayed, err = l.awaitStandby(ctx, hr.newest, hr.newestAt, want, wantAt, checked); replayed {
				hr, err = l.standbyHeads(ctx, held, unticked)
			}
		}
		switch {
		case ctx.Err() != nil:
			return nil, open, ctx.Err(), openErr
		case errors.Is(err, errTickUnchecked):
			// The announced tick could not be checked on the primary: this scan reads there.
		case err != nil && !standbyDown(err):
		case err != nil:
			r.fallBack(fallbackUnreachable, 0, 0, err)
		case replayed:
			r.setLag(0, 0)
			r.scanStandby = true
		default:
			// The wait ran out: awaitStandby left the standby.
		}
	}
	if !r.scanStandby {
		announced := l.scans.announced.Load()
		if hr, err = queryHeads(ctx, l.pool, held, l.seenTick, unticked); err != nil {
			return nil, open, err, openErr
		}
		l.checked(announced, hr.newest)
	}
	return l.applyHeads(hr), open, nil, openErr
}

// standbyWant is the tick a scan on the standby must see, with announced the newest tick
// announced: the newest tick announced or seen. checked: it is no newer than a tick the primary
// showed; otherwise the announcement is checked on the primary when the standby has not
// replayed it within standbyGrace (awaitStandby).
func (l *scanLoop) standbyWant(announced int64) (want int64, checked bool) {
	want = max(announced, l.seenTick)
	return want, want <= max(l.checkedTick, l.seenTick)
}

// checked records that a read of the primary, sent when the newest announcement was
// announced, showed tick as its newest: an announcement up to it needs no check, and the one
// beyond it is dropped (forged, or from before a restore) unless another came since, which the
// read may not have seen.
func (l *scanLoop) checked(announced, tick int64) {
	l.checkedTick = max(l.checkedTick, tick)
	if announced > tick {
		l.scans.announced.CompareAndSwap(announced, tick)
	}
}

// errTickUnchecked: an announced tick the standby had not replayed could not be checked on the
// primary.
var errTickUnchecked = errors.New("the announced tick could not be checked on the primary")

// standbyGrace is how long a scan waits for the standby to replay an announced tick before it
// checks the announcement on the primary: long enough for a standby that keeps up to replay the
// tick whose notification reached the consumer first, short enough that a forged announcement
// costs little.
func standbyGrace(cfg consumerConfig) time.Duration {
	return min(50*time.Millisecond, cfg.ReadMaxLag/2)
}

// primaryTick reads the primary's newest tick, to check an announcement (counted).
func (l *scanLoop) primaryTick(ctx context.Context) (int64, time.Time, error) {
	l.stats.tickChecks.Add(1)
	return newestTick(ctx, l.pool)
}

// scanStartFallen starts a scan that reads from the primary while the standby is behind or
// unreachable, and probes the standby meanwhile: once it has replayed the primary's newest
// tick, the next scan reads from it again.
func (l *scanLoop) scanStartFallen(ctx context.Context, held, reading []string, unticked bool) (heads map[string]Head, open map[string][]delivery, headsErr, openErr error) {
	r := l.reads
	var probe int64
	var probeAt time.Time
	var probeErr error
	probing := time.Now().After(r.probeAfter)
	done := make(chan struct{}, 2)
	go func() {
		defer func() { done <- struct{}{} }()
		if len(reading) > 0 {
			open, openErr = l.store.open(ctx, l.pool, reading)
		}
	}()
	go func() {
		defer func() { done <- struct{}{} }()
		if !probing {
			return
		}
		pctx, cancel := context.WithTimeout(ctx, min(r.cfg.ReadMaxLag, 2*time.Second))
		defer cancel()
		probe, probeAt, probeErr = newestTick(pctx, r.standby)
	}()
	announced := l.scans.announced.Load()
	hr, err := queryHeads(ctx, l.pool, held, l.seenTick, unticked)
	<-done
	<-done
	if err != nil {
		return nil, open, err, openErr
	}
	l.checked(announced, hr.newest)
	switch {
	case !probing:
	case probeErr != nil:
		if ctx.Err() == nil {
			r.probeAfter = time.Now().Add(r.cfg.ReadMaxLag)
		}
	default:
		r.setLag(hr.newest-probe, hr.newestAt.Sub(probeAt))
		if probe >= hr.newest && probe >= l.seenTick {
			r.returnToStandby(probe)
		}
	}
	return l.applyHeads(hr), open, nil, openErr
}

// standbyHeads reads the heads on the standby, trying again a statement cancelled by a
// recovery conflict. A read another consumer of the process has in flight with the same
// arguments is shared (shared_reads.go): how far the standby has replayed is then judged on
// its answer, as on this consumer's own.
func (l *scanLoop) standbyHeads(ctx context.Context, held []string, unticked bool) (hr headsRead, err error) {
	err = l.onStandby(ctx, func() (err error) {
		hr, err = l.headsOn(ctx, l.reads.standby, held, l.seenTick, unticked)
		return err
	})
	return hr, err
}

// awaitStandby waits until the standby has replayed tick want, reading its newest tick
// (newestTickSQL: one probe of the tick key) every few milliseconds (standbyPause), for at most
// ReadMaxLag on the consumer's clock; newest and newestAt are what the scan's last read there
// showed. When want is an announced tick not checked on the primary (checked false), it checks
// it there once standbyGrace has passed, or when the wait runs out first, and waits for the
// primary's newest tick instead: only a tick the primary showed makes it wait on. It returns the
// tick it waited for and whether the standby has replayed it; when the wait ran out, the
// consumer reads from the primary from then on (fallBack). errTickUnchecked: the check failed.
func (l *scanLoop) awaitStandby(ctx context.Context, newest int64, newestAt time.Time, want int64, wantAt time.Time, checked bool) (int64, bool, error) {
	r := l.reads
	r.stats.standbyWaits.Add(1)
	r.stats.waiting.Store(true)
	defer r.stats.waiting.Store(false)
	// The lag is recorded before the wait's timer is armed: whoever sees the consumer waiting
	// sees how far behind the standby is.
	r.setLag(want-newest, wantAt.Sub(newestAt))
	deadline := r.cfg.Clock.NewTimer(r.cfg.ReadMaxLag)
	defer deadline.Stop()
	started := time.Now()
	// check waits for the primary's newest tick in place of an announced one; it reports
	// whether the standby has replayed that.
	check := func() (bool, error) {
		announced := l.scans.announced.Load()
		tick, at, err := l.primaryTick(ctx)
		if err != nil {
			return false, errTickUnchecked
		}
		l.checked(announced, tick)
		want, wantAt, checked = max(tick, l.seenTick), at, true
		return newest >= want, nil
	}
	pause := time.Millisecond
	for {
		if !checked && time.Since(started) >= standbyGrace(r.cfg) {
			if replayed, err := check(); err != nil || replayed {
				return want, replayed, err
			}
			r.setLag(want-newest, wantAt.Sub(newestAt))
		}
		wait := time.NewTimer(pause)
		select {
		case <-ctx.Done():
			wait.Stop()
			return want, false, ctx.Err()
		case <-deadline.C():
			wait.Stop()
			if !checked {
				if replayed, err := check(); err != nil || replayed {
					return want, replayed, err
				}
			}
			r.fallBack(fallbackLag, want-newest, wantAt.Sub(newestAt), nil)
			return want, false, nil
		case <-wait.C:
		}
		pause = standbyPause(pause, time.Since(started), r.cfg)
		tick, at, err := l.standbyNewest(ctx)
		if err != nil {
			return want, false, err
		}
		if newest, newestAt = tick, at; newest >= want {
			return want, true, nil
		}
		r.setLag(want-newest, wantAt.Sub(newestAt))
	}
}

// standbyNewest reads the standby's newest tick (0 when it has none), trying again a statement
// cancelled by a recovery conflict. The consumers of a process that wait for the standby at the
// same moment (woken by the same tick) share the probe in flight: any answer tells a waiting
// scan whether to read or to wait on, and the read checks the tick again.
func (l *scanLoop) standbyNewest(ctx context.Context) (int64, time.Time, error) {
	type newest struct {
		tick int64
		at   time.Time
	}
	v, _, err := shareOf(l.reads.standby).do(ctx, "newest", func() (any, error) {
		var n newest
		err := l.onStandby(ctx, func() (err error) {
			if n.tick, n.at, err = newestTick(ctx, l.reads.standby); errors.Is(err, pgx.ErrNoRows) {
				n, err = newest{}, nil
			}
			return err
		})
		return n, err
	}, func(any) bool { return true })
	if err != nil {
		return 0, time.Time{}, err
	}
	n := v.(newest)
	return n.tick, n.at, nil
}

// onStandby runs fn, a read on the standby, and runs it again while the standby cancels it for
// a recovery conflict, readConflictRetries times at most.
func (l *scanLoop) onStandby(ctx context.Context, fn func() error) error {
	for attempt := 0; ; attempt++ {
		err := fn()
		if err == nil || ctx.Err() != nil || !recoveryConflict(err) || attempt >= readConflictRetries {
			return err
		}
		l.reads.conflict(err)
		conflictPause(ctx, attempt)
	}
}

// standbyPause is the pause after pause between two reads of a standby that a scan waits for,
// waited so far: it doubles from a millisecond up to 4 ms within standbyGrace, where a standby
// that keeps up replays the tick, so a wait ends at most about 4 ms after the replay; then up
// to 20 ms, for a standby that is behind.
func standbyPause(pause, waited time.Duration, cfg consumerConfig) time.Duration {
	if waited < standbyGrace(cfg) {
		return min(pause*2, 4*time.Millisecond)
	}
	return min(pause*2, 20*time.Millisecond)
}

// conflict counts a read the standby cancelled for a conflict with recovery.
func (r *readSource) conflict(err error) {
	r.stats.readConflicts.Add(1)
	r.metrics.readConflict(string(r.id))
	r.log.Debug("a read on the standby was cancelled by recovery; it is tried again", zap.Error(err))
}

// read runs fn on the scan's source. On the standby, a statement cancelled by a recovery
// conflict is tried again (readConflictRetries times); when the standby still fails, fn runs
// on the primary, which serves the rest of the scan, and a standby that could not be reached
// (standbyDown) is left until it catches up.
func (l *scanLoop) read(ctx context.Context, fn func(db *pgxpool.Pool) error) error {
	r := l.reads
	if r == nil || !r.scanStandby {
		return fn(l.pool)
	}
	for attempt := 0; ; attempt++ {
		err := fn(r.standby)
		if err == nil || ctx.Err() != nil {
			return err
		}
		switch {
		case recoveryConflict(err):
			r.conflict(err)
			if attempt < readConflictRetries {
				conflictPause(ctx, attempt)
				continue
			}
			r.scanStandby = false
		case standbyDown(err):
			r.fallBack(fallbackUnreachable, 0, 0, err)
		default:
			// A failure the primary may well share (a broken row, a statement timeout): the
			// rest of this scan reads from the primary, whose answer the loop handles as usual.
			r.scanStandby = false
		}
		return fn(l.pool)
	}
}

// readFromPrimary makes the rest of the scan read from the primary (see scanProject: a hole
// seen on the standby is read again there before anything is reconciled). It reports whether
// the scan was reading from the standby.
func (l *scanLoop) readFromPrimary() bool {
	r := l.reads
	if r == nil || !r.scanStandby {
		return false
	}
	r.scanStandby = false
	return true
}

// recoveryConflict reports whether a standby cancelled the statement (or ended the session)
// for a conflict with recovery: SQLSTATE 40001 (what a read-only statement on a hot standby
// gets for it), or any error whose message says so (a deadlock with the startup process, a
// session ended for it, depending on the server's version).
func recoveryConflict(err error) bool {
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return false
	}
	return pgErr.Code == pgerrcode.SerializationFailure || strings.Contains(pgErr.Message, "conflict with recovery")
}

// standbyDown reports whether err says the standby could not be reached or dropped the
// session: a failed connection, a connection lost, a server shutting down or starting, or one
// that is no standby (errNotStandby).
func standbyDown(err error) bool {
	var ce *pgconn.ConnectError
	if errors.As(err, &ce) || pgconn.SafeToRetry(err) || errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, errNotStandby) ||
		errors.Is(err, net.ErrClosed) {
		return true
	}
	var netErr net.Error
	if errors.As(err, &netErr) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		// Class 08, connection exception; 57P01-57P03, the server shutting down or starting.
		return pgerrcode.IsConnectionException(pgErr.Code) || pgErr.Code == pgerrcode.AdminShutdown ||
			pgErr.Code == pgerrcode.CrashShutdown || pgErr.Code == pgerrcode.CannotConnectNow
	}
	return false
}

// conflictPause lets the replay that cancelled a read go on before the read is tried again.
func conflictPause(ctx context.Context, attempt int) {
	sleepCtx(ctx, time.Duration(attempt+1)*5*time.Millisecond)
}

// StandbyLag is how far a standby is behind its primary, in ticks and in time (CompareStandby).
type StandbyLag struct {
	PrimaryTick   int64     // the primary's newest tick
	PrimaryTickAt time.Time // when it was taken (the primary's clock)
	StandbyTick   int64     // the standby's newest replayed tick
	StandbyTickAt time.Time
	Ticks         int64         // PrimaryTick - StandbyTick, at least 0
	Lag           time.Duration // PrimaryTickAt - StandbyTickAt, at least 0; 0 when caught up
	InRecovery    bool          // the standby is still a standby (false: promoted, or a primary)
}

// CompareStandby reads the newest tick on primary, then on standby, and says how far the standby
// is behind: the figures a consumer with Config.ReadDSN compares before it reads from a standby.
// The time figure is measured between ticks: after a quiet spell, the first new tick shows the
// whole spell until the standby replays it.
func CompareStandby(ctx context.Context, primary, standby DBTX) (StandbyLag, error) {
	var l StandbyLag
	var err error
	if l.PrimaryTick, l.PrimaryTickAt, err = newestTick(ctx, primary); err != nil {
		return l, fmt.Errorf("compare standby: read the primary's newest tick: %w", err)
	}
	err = standby.QueryRow(ctx, standbyNewestTickSQL).Scan(&l.StandbyTick, &l.StandbyTickAt, &l.InRecovery)
	if err != nil {
		return l, fmt.Errorf("compare standby: read the standby's newest tick: %w", err)
	}
	if l.StandbyTick < l.PrimaryTick {
		l.Ticks, l.Lag = l.PrimaryTick-l.StandbyTick, max(l.PrimaryTickAt.Sub(l.StandbyTickAt), 0)
	}
	return l, nil
}

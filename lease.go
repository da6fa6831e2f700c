package outbox

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
)

// A lease gives one process instance the right to advance one (project, consumer) cursor.
// Acquiring bumps lease_epoch; every cursor advance and delivery update names the epoch it was
// given, so a holder that lost its lease (expired while it was frozen, taken over by another
// process with the same identity) writes nothing. Expiry is judged by the database clock.

type lease struct {
	// grant numbers this instance's acquisitions. The epoch cannot tell two of them apart: a
	// restored database hands out an epoch number again.
	grant    uint64
	epoch    int64
	acked    int64     // cursor when acquired; -1 for a cursor never positioned
	deadline time.Time // local, conservative: the lease is treated as lost after it
}

// leaseTable is shared by the heartbeat goroutine, which acquires and renews, and the loop,
// which dispatches only while valid reports true.
type leaseTable struct {
	mu     sync.Mutex
	held   map[string]lease
	grants uint64
	// dropped are the leases of projects no longer observed: gone from held, so that nothing
	// more is handed over under them, and still this instance's in the database until the loop
	// has written their cursors and released them (releaseDropped), or the heartbeat releases
	// them to take the project again (reclaim).
	dropped map[string]lease
	// releasing is closed when the loop has released the dropped leases it took; nil while it
	// releases none.
	releasing chan struct{}
}

func (t *leaseTable) snapshot() map[string]lease {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make(map[string]lease, len(t.held))
	for p, l := range t.held {
		out[p] = l
	}
	return out
}

func (t *leaseTable) valid(project string, epoch int64, now time.Time) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	l, ok := t.held[project]
	return ok && l.epoch == epoch && now.Before(l.deadline)
}

// lose forgets a lease, unless it has been replaced by a newer epoch meanwhile, and reports
// whether it did (so a loss is counted once).
func (t *leaseTable) lose(project string, epoch int64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	if l, ok := t.held[project]; ok && l.epoch == epoch {
		delete(t.held, project)
		return true
	}
	return false
}

// put records a newly acquired lease under a grant number of its own.
func (t *leaseTable) put(project string, l lease) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.grants++
	l.grant = t.grants
	t.held[project] = l
}

func (t *leaseTable) extend(project string, epoch int64, deadline time.Time) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if l, ok := t.held[project]; ok && l.epoch == epoch {
		l.deadline = deadline
		t.held[project] = l
	}
}

// take empties the table: every lease held or dropped, for the consumer's shutdown to release.
func (t *leaseTable) take() map[string]lease {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := t.held
	for p, l := range t.dropped {
		if _, ok := out[p]; !ok {
			out[p] = l
		}
	}
	t.held, t.dropped = map[string]lease{}, nil
	return out
}

// drop moves the lease of project under epoch from held to dropped (unless a newer epoch
// replaced it meanwhile) and reports whether it did.
func (t *leaseTable) drop(project string, epoch int64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	l, ok := t.held[project]
	if !ok || l.epoch != epoch {
		return false
	}
	delete(t.held, project)
	if t.dropped == nil {
		t.dropped = map[string]lease{}
	}
	t.dropped[project] = l
	return true
}

// takeDropped hands the dropped leases to the loop, which releases them and then calls done.
// Until then, releasing is set.
func (t *leaseTable) takeDropped() (dropped map[string]lease, done func()) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.dropped) == 0 {
		return nil, func() {}
	}
	dropped, t.dropped = t.dropped, nil
	ch := make(chan struct{})
	t.releasing = ch
	return dropped, func() {
		t.mu.Lock()
		if t.releasing == ch {
			t.releasing = nil
		}
		t.mu.Unlock()
		close(ch)
	}
}

// reclaim takes back from dropped the leases of projects observed again before the loop
// released them, and returns them with the channel of a release the loop has in progress
// (nil when none is).
func (t *leaseTable) reclaim(projects []string) (reclaimed map[string]lease, releasing <-chan struct{}) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, p := range projects {
		if l, ok := t.dropped[p]; ok {
			if reclaimed == nil {
				reclaimed = map[string]lease{}
			}
			reclaimed[p] = l
			delete(t.dropped, p)
		}
	}
	return reclaimed, t.releasing
}

// undrop puts back leases reclaim took when releasing them failed: the loop tries again.
func (t *leaseTable) undrop(leases map[string]lease) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.dropped == nil {
		t.dropped = map[string]lease{}
	}
	for p, l := range leases {
		t.dropped[p] = l
	}
}

const ensureCursorsSQL = `
INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id)
SELECT p, $1 FROM pg_catalog.unnest($2::text[]) AS p
ON CONFLICT (project_id, consumer_id) DO NOTHING`

const retiredSQL = `
SELECT project_id FROM lifecycle_consumer_cursors
WHERE consumer_id = $1 AND project_id = ANY ($2::text[]) AND retired_at IS NOT NULL
ORDER BY project_id`

// acquireSQL takes, for consumer @consumer and its instance @owner, every lease among
// @projects that is free or expired on the clock shifted by @clock_offset, for @lease_ttl.
const acquireSQL = `
WITH free AS (
    SELECT k.project_id FROM lifecycle_consumer_cursors k
    WHERE k.consumer_id = @consumer AND k.project_id = ANY (@projects::text[]) AND k.retired_at IS NULL
      AND (k.lease_owner IS NULL OR k.lease_expires_at IS NULL OR k.lease_expires_at <= pg_catalog.now() + @clock_offset::interval)
    ORDER BY k.project_id
    FOR NO KEY UPDATE
)
UPDATE lifecycle_consumer_cursors c
SET lease_owner = @owner, lease_epoch = c.lease_epoch + 1,
    lease_expires_at = pg_catalog.now() + @clock_offset::interval + @lease_ttl::interval,
    heartbeat_at = pg_catalog.now() + @clock_offset::interval
FROM free f
WHERE c.consumer_id = @consumer AND c.project_id = f.project_id
RETURNING c.project_id, c.lease_epoch, coalesce(c.last_acked_sequence, -1)`

// renewSQL and releaseSQL, like ackSQL and retireSQL, lock the cursor rows they will write in
// project order before they write any (the CTE named locked). A consumer's acknowledgement and
// its heartbeat each write several of its rows, at once on two connections; taking them in the
// order their arguments came, each could hold a row the other waits for, a deadlock that
// PostgreSQL breaks only after deadlock_timeout (a second by default), while the consumer's
// scans wait.
const renewSQL = `
WITH locked AS (
    SELECT k.project_id FROM lifecycle_consumer_cursors k
    WHERE k.consumer_id = @consumer AND k.lease_owner = @owner AND k.project_id = ANY (@projects::text[])
    ORDER BY k.project_id
    FOR NO KEY UPDATE
)
UPDATE lifecycle_consumer_cursors c
SET lease_expires_at = pg_catalog.now() + @clock_offset::interval + @lease_ttl::interval,
    heartbeat_at = pg_catalog.now() + @clock_offset::interval
FROM ROWS FROM (pg_catalog.unnest(@projects::text[]), pg_catalog.unnest(@epochs::bigint[])) AS h(project_id, epoch)
JOIN locked l ON l.project_id = h.project_id
WHERE c.consumer_id = @consumer AND c.lease_owner = @owner AND c.project_id = h.project_id AND c.lease_epoch = h.epoch
  AND c.lease_expires_at > pg_catalog.now() + @clock_offset::interval AND c.retired_at IS NULL
RETURNING c.project_id`

// releaseSQL gives up the leases of consumer $1's instance $2 on the projects $3, each under
// its epoch in $4.
const releaseSQL = `
WITH locked AS (
    SELECT k.project_id FROM lifecycle_consumer_cursors k
    WHERE k.consumer_id = $1 AND k.lease_owner = $2 AND k.project_id = ANY ($3::text[])
    ORDER BY k.project_id
    FOR NO KEY UPDATE
)
UPDATE lifecycle_consumer_cursors c
SET lease_owner = NULL, lease_expires_at = NULL
FROM ROWS FROM (pg_catalog.unnest($3::text[]), pg_catalog.unnest($4::bigint[])) AS h(project_id, epoch)
JOIN locked l ON l.project_id = h.project_id
WHERE c.consumer_id = $1 AND c.lease_owner = $2 AND c.project_id = h.project_id AND c.lease_epoch = h.epoch`

// leaseKeeper holds the consumer's leases: it creates the cursors, acquires, renews and
// releases leases, runs the heartbeat that follows the observed project set, tells the loop
// (gained) about leases it took so their streams are scanned at once, and runs the fenced
// transaction every delivery write goes through. The loop asks it, before each event, whether
// the stream's lease is still valid.
type leaseKeeper struct {
	id       ConsumerID
	owner    string
	pool     *pgxpool.Pool
	cfg      consumerConfig
	projects Projects
	metrics  *Metrics
	log      *zap.Logger
	stats    *stats
	gained   func(projects ...string)
	wake     func() // wakes the loop, which releases the dropped leases

	// refreshes carries RefreshProjects's requests to the heartbeat goroutine, which serves
	// them between its rounds.
	refreshes chan refreshRequest

	table       leaseTable
	paused      atomic.Bool // tests freeze the heartbeat, standing in for a process stopped past its lease
	retiredSeen sync.Map    // project -> true, once its retirement was logged
}

// now is the local clock shifted like the database clock.
func (k *leaseKeeper) now() time.Time { return shiftedNow(k.cfg.Clock) }

// held is a copy of the leases held now.
func (k *leaseKeeper) held() map[string]lease { return k.table.snapshot() }

// valid reports whether the lease of project under epoch is still held and within its
// conservative local deadline.
func (k *leaseKeeper) valid(project string, epoch int64) bool {
	return k.table.valid(project, epoch, k.now())
}

// lost forgets the lease of project under epoch after a write found it gone, and reports
// whether this was news (so a loss is counted and logged once).
func (k *leaseKeeper) lost(project string, epoch int64) bool {
	if !k.table.lose(project, epoch) {
		return false
	}
	k.metrics.leaseLost(project, string(k.id))
	k.stats.leaseLosses.Add(1)
	return true
}

// observedProjects asks the host which projects to observe: validated, deduplicated, sorted.
func (k *leaseKeeper) observedProjects(ctx context.Context) ([]string, error) {
	ps, err := k.projects.ObservedProjects(ctx)
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

func (k *leaseKeeper) ensureCursors(ctx context.Context, projects []string) error {
	if _, err := k.pool.Exec(ctx, ensureCursorsSQL, k.id, projects); err != nil {
		return fmt.Errorf("create cursors: %w", err)
	}
	return nil
}

// checkRetired refuses to run an identity an operator retired: un-retiring is deliberate.
func (k *leaseKeeper) checkRetired(ctx context.Context, projects []string) error {
	rows, err := k.pool.Query(ctx, retiredSQL, k.id, projects)
	if err != nil {
		return fmt.Errorf("check retirement: %w", err)
	}
	retired, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("check retirement: %w", err)
	}
	if len(retired) > 0 {
		return fmt.Errorf("%w: consumer %q was retired for project(s) %s; choose a new identity or have an operator reinstate it",
			ErrConsumerRetired, k.id, strings.Join(retired, ", "))
	}
	return nil
}

// acquire takes every free or expired lease among projects and returns the projects taken.
func (k *leaseKeeper) acquire(ctx context.Context, projects []string) ([]string, error) {
	if len(projects) == 0 {
		return nil, nil
	}
	sent := k.now()
	rows, err := k.pool.Query(ctx, acquireSQL, pgx.StrictNamedArgs{"consumer": k.id, "owner": k.owner, "projects": projects,
		"lease_ttl": k.cfg.LeaseTTL, "clock_offset": k.cfg.Clock.Offset()})
	if err != nil {
		return nil, fmt.Errorf("acquire leases: %w", err)
	}
	type acquired struct {
		Project string
		Epoch   int64
		Acked   int64
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[acquired])
	if err != nil {
		return nil, fmt.Errorf("acquire leases: %w", err)
	}
	deadline := k.deadlineFrom(sent)
	taken := make([]string, 0, len(got))
	for _, a := range got {
		k.table.put(a.Project, lease{epoch: a.Epoch, acked: a.Acked, deadline: deadline})
		k.metrics.leaseAcquired(a.Project, string(k.id))
		k.log.Info("lease acquired", zap.String("project_id", a.Project), zap.Int64("epoch", a.Epoch), zap.Int64("cursor", a.Acked))
		taken = append(taken, a.Project)
	}
	return taken, nil
}

// deadlineFrom is when a lease granted by a statement sent at sent must be treated as lost:
// the database measured its TTL from a later instant, so this errs on the safe side.
func (k *leaseKeeper) deadlineFrom(sent time.Time) time.Time {
	return sent.Add(k.cfg.LeaseTTL - k.cfg.LeaseTTL/20)
}

// renew extends every held lease in one statement and drops the ones that did not match.
func (k *leaseKeeper) renew(ctx context.Context) error {
	held := k.table.snapshot()
	if len(held) == 0 {
		return nil
	}
	projects, epochs := leaseArrays(held, nil)
	sent := k.now()
	rows, err := k.pool.Query(ctx, renewSQL, pgx.StrictNamedArgs{"consumer": k.id, "owner": k.owner, "projects": projects,
		"epochs": epochs, "lease_ttl": k.cfg.LeaseTTL, "clock_offset": k.cfg.Clock.Offset()})
	if err != nil {
		return fmt.Errorf("renew leases: %w", err)
	}
	renewed, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("renew leases: %w", err)
	}
	ok := make(map[string]bool, len(renewed))
	deadline := k.deadlineFrom(sent)
	for _, p := range renewed {
		ok[p] = true
		k.table.extend(p, held[p].epoch, deadline)
	}
	for p, l := range held {
		if !ok[p] && k.lost(p, l.epoch) {
			k.log.Warn("lease lost at renewal; will try to re-acquire", zap.String("project_id", p), zap.Int64("epoch", l.epoch))
		}
	}
	return nil
}

// leaseArrays lists the projects of held (those keep selects, all when it is nil) and their
// epochs, as the statements' arrays.
func leaseArrays(held map[string]lease, keep func(string) bool) (projects []string, epochs []int64) {
	for p, l := range held {
		if keep == nil || keep(p) {
			projects = append(projects, p)
			epochs = append(epochs, l.epoch)
		}
	}
	return projects, epochs
}

// release gives up every held (or dropped) lease so that another process with this identity
// can take over at once instead of waiting for expiry.
func (k *leaseKeeper) release(ctx context.Context) {
	held := k.table.take()
	if len(held) == 0 {
		return
	}
	if err := k.releaseLeases(ctx, held); err != nil {
		k.log.Warn("leases not released; they will expire", zap.Error(err))
	}
}

// releaseLeases gives up leases in the database, each under its epoch.
func (k *leaseKeeper) releaseLeases(ctx context.Context, leases map[string]lease) error {
	projects, epochs := leaseArrays(leases, nil)
	_, err := k.pool.Exec(ctx, releaseSQL, k.id, k.owner, projects, epochs)
	return err
}

// refreshRequest asks the heartbeat goroutine to follow the observed project set now; reply
// (buffered) gets the outcome.
type refreshRequest struct{ reply chan error }

// heartbeatLoop renews leases, follows the observed project set and retries acquisition. It
// also serves refresh requests, one at a time and never during a round: only this goroutine
// changes the held set.
func (k *leaseKeeper) heartbeatLoop(ctx context.Context) {
	t := time.NewTicker(k.cfg.HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case req := <-k.refreshes:
			err := k.follow(ctx)
			if ctx.Err() != nil {
				err = nil // stopping: the shutdown releases every lease, and a start reads the set again
			}
			req.reply <- err
			continue
		case <-t.C:
		}
		if k.paused.Load() {
			continue
		}
		k.heartbeat(ctx)
	}
}

// refresh has the heartbeat goroutine follow the observed project set now and returns its
// outcome. It returns nil at once when stopped is closed before the request is taken (the
// consumer is not running), and ctx's error when ctx ends first.
func (k *leaseKeeper) refresh(ctx context.Context, stopped <-chan struct{}) error {
	req := refreshRequest{reply: make(chan error, 1)}
	select {
	case k.refreshes <- req:
	case <-stopped:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-req.reply:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

// heartbeat is one round: renew what is held, then follow the observed project set.
func (k *leaseKeeper) heartbeat(ctx context.Context) {
	if err := k.renew(ctx); err != nil {
		logTransient(k.log, "heartbeat", err)
	}
	if err := k.follow(ctx); err != nil {
		logTransient(k.log, "heartbeat", err)
	}
}

// follow brings the leases in line with the observed project set: it drops the leases of
// projects no longer observed (locally, at once: the loop hands nothing more over under them,
// then writes their cursors and releases them) and tries to take those of observed projects
// it does not hold (a lease held by another instance is left to a later round, which is not an
// error). The error is the first step that failed.
func (k *leaseKeeper) follow(ctx context.Context) error {
	projects, err := k.observedProjects(ctx)
	if err != nil {
		return err
	}
	held := k.table.snapshot()
	var missing []string
	observed := make(map[string]bool, len(projects))
	for _, p := range projects {
		observed[p] = true
		if _, ok := held[p]; !ok {
			missing = append(missing, p)
		}
	}
	k.dropUnobserved(held, observed)
	if len(missing) == 0 {
		return nil
	}
	if err := k.reclaim(ctx, missing); err != nil {
		return err
	}
	if err := k.ensureCursors(ctx, missing); err != nil {
		return err
	}
	taken, err := k.acquire(ctx, missing)
	if err != nil {
		return err
	}
	if len(taken) > 0 {
		k.gained(taken...)
	}
	if len(taken) < len(missing) {
		k.noteRetired(ctx, missing)
	}
	return nil
}

// reclaim makes the leases of projects observed again before the loop released them free to
// take: it releases them itself (their cursors keep what was acknowledged; what this instance
// delivered beyond is suppressed when it comes again, see stream.delivered), and waits for
// a release the loop has in progress, which may hold some of them.
func (k *leaseKeeper) reclaim(ctx context.Context, missing []string) error {
	reclaimed, releasing := k.table.reclaim(missing)
	if len(reclaimed) > 0 {
		if err := k.releaseLeases(ctx, reclaimed); err != nil {
			k.table.undrop(reclaimed)
			return fmt.Errorf("release dropped leases: %w", err)
		}
	}
	if releasing != nil {
		select {
		case <-releasing:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// noteRetired logs, once per project, that an operator retired this identity while it ran:
// it stops advancing there and is never silently reinstated.
func (k *leaseKeeper) noteRetired(ctx context.Context, projects []string) {
	rows, err := k.pool.Query(ctx, retiredSQL, k.id, projects)
	if err != nil {
		return
	}
	retired, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return
	}
	for _, p := range retired {
		if _, seen := k.retiredSeen.LoadOrStore(p, true); !seen {
			k.log.Error("consumer identity retired by an operator; it no longer observes this project",
				zap.String("project_id", p), zap.Error(ErrConsumerRetired))
		}
	}
}

// dropUnobserved drops the leases of projects no longer observed: from now on the loop hands
// none of their events over (the one it may be handing over already aside), and it writes
// their cursors and releases them when it next wakes, which this asks for.
func (k *leaseKeeper) dropUnobserved(held map[string]lease, observed map[string]bool) {
	projects, epochs := leaseArrays(held, func(p string) bool { return !observed[p] })
	if len(projects) == 0 {
		return
	}
	for i, p := range projects {
		k.table.drop(p, epochs[i])
	}
	k.wake()
	sort.Strings(projects)
	k.log.Info("stopped observing projects", zap.Strings("projects", projects))
}

// fenceSQL locks the cursor of @project while consumer @consumer's instance @owner holds its
// lease under @epoch, unexpired on the clock shifted by @clock_offset.
const fenceSQL = `
SELECT coalesce(last_acked_sequence, -1) FROM lifecycle_consumer_cursors
WHERE project_id = @project AND consumer_id = @consumer AND lease_owner = @owner AND lease_epoch = @epoch
  AND lease_expires_at > pg_catalog.now() + @clock_offset::interval AND retired_at IS NULL
FOR UPDATE`

// cursorSQL reads the durable cursor of a lease this instance holds.
const cursorSQL = `
SELECT coalesce(last_acked_sequence, -1) FROM lifecycle_consumer_cursors
WHERE project_id = $1 AND consumer_id = $2 AND lease_owner = $3 AND lease_epoch = $4 AND retired_at IS NULL`

// cursor reads the durable cursor of project under the lease epoch (-1 when never
// positioned); ErrLeaseLost when the lease is no longer this instance's.
func (k *leaseKeeper) cursor(ctx context.Context, project string, epoch int64) (int64, error) {
	var cursor int64
	err := k.pool.QueryRow(ctx, cursorSQL, project, k.id, k.owner, epoch).Scan(&cursor)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, ErrLeaseLost
	}
	return cursor, err
}

// fencedTx runs fn in a transaction that first locks the cursor row of project under the
// lease epoch. When the lease no longer matches it returns ErrLeaseLost and fn never runs.
// Holding the row lock until commit keeps a takeover from slipping in between the check and
// the writes.
func (k *leaseKeeper) fencedTx(ctx context.Context, project string, epoch int64, fn func(pgx.Tx) error) error {
	tx, err := k.pool.BeginTx(ctx, k.cfg.txOptions("", ""))
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	var cursor int64
	err = tx.QueryRow(ctx, fenceSQL, pgx.StrictNamedArgs{"project": project, "consumer": k.id, "owner": k.owner,
		"epoch": epoch, "clock_offset": k.cfg.Clock.Offset()}).Scan(&cursor)
	if errors.Is(err, pgx.ErrNoRows) {
		return ErrLeaseLost
	}
	if err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

package outbox

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
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

func (t *leaseTable) take() map[string]lease {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := t.held
	t.held = map[string]lease{}
	return out
}

const ensureCursorsSQL = `
INSERT INTO lifecycle_consumer_cursors (project_id, consumer_id)
SELECT p, $1 FROM pg_catalog.unnest($2::text[]) AS p
ON CONFLICT (project_id, consumer_id) DO NOTHING`

const retiredSQL = `
SELECT project_id FROM lifecycle_consumer_cursors
WHERE consumer_id = $1 AND project_id = ANY ($2::text[]) AND retired_at IS NOT NULL
ORDER BY project_id`

const acquireSQL = `
UPDATE lifecycle_consumer_cursors c
SET lease_owner = $3, lease_epoch = c.lease_epoch + 1,
    lease_expires_at = pg_catalog.now() + $5::interval + $4::interval, heartbeat_at = pg_catalog.now() + $5::interval
WHERE c.consumer_id = $1 AND c.project_id = ANY ($2::text[]) AND c.retired_at IS NULL
  AND (c.lease_owner IS NULL OR c.lease_expires_at IS NULL OR c.lease_expires_at <= pg_catalog.now() + $5::interval)
RETURNING c.project_id, c.lease_epoch, coalesce(c.last_acked_sequence, -1)`

const renewSQL = `
UPDATE lifecycle_consumer_cursors c
SET lease_expires_at = pg_catalog.now() + $4::interval + $3::interval, heartbeat_at = pg_catalog.now() + $4::interval
FROM ROWS FROM (pg_catalog.unnest($5::text[]), pg_catalog.unnest($6::bigint[])) AS h(project_id, epoch)
WHERE c.consumer_id = $1 AND c.lease_owner = $2 AND c.project_id = h.project_id AND c.lease_epoch = h.epoch
  AND c.lease_expires_at > pg_catalog.now() + $4::interval AND c.retired_at IS NULL
RETURNING c.project_id`

const releaseSQL = `
UPDATE lifecycle_consumer_cursors c
SET lease_owner = NULL, lease_expires_at = NULL
FROM ROWS FROM (pg_catalog.unnest($3::text[]), pg_catalog.unnest($4::bigint[])) AS h(project_id, epoch)
WHERE c.consumer_id = $1 AND c.lease_owner = $2 AND c.project_id = h.project_id AND c.lease_epoch = h.epoch`

func (c *Consumer) ensureCursors(ctx context.Context, projects []string) error {
	if _, err := c.pool.Exec(ctx, ensureCursorsSQL, c.id, projects); err != nil {
		return fmt.Errorf("create cursors: %w", err)
	}
	return nil
}

// checkRetired refuses to run an identity an operator retired: un-retiring is deliberate.
func (c *Consumer) checkRetired(ctx context.Context, projects []string) error {
	rows, err := c.pool.Query(ctx, retiredSQL, c.id, projects)
	if err != nil {
		return fmt.Errorf("check retirement: %w", err)
	}
	retired, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("check retirement: %w", err)
	}
	if len(retired) > 0 {
		return fmt.Errorf("%w: consumer %q was retired for project(s) %s; choose a new identity or have an operator reinstate it",
			ErrConsumerRetired, c.id, strings.Join(retired, ", "))
	}
	return nil
}

// acquire takes every free or expired lease among projects and returns the projects taken.
func (c *Consumer) acquire(ctx context.Context, projects []string) ([]string, error) {
	if len(projects) == 0 {
		return nil, nil
	}
	sent := c.now()
	rows, err := c.pool.Query(ctx, acquireSQL, c.id, projects, c.owner, c.cfg.LeaseTTL, c.offset())
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
	deadline := c.deadlineFrom(sent)
	taken := make([]string, 0, len(got))
	for _, a := range got {
		c.leases.put(a.Project, lease{epoch: a.Epoch, acked: a.Acked, deadline: deadline})
		c.metrics.leaseAcquired(a.Project, string(c.id))
		c.log.Info("lease acquired", zap.String("project_id", a.Project), zap.Int64("epoch", a.Epoch), zap.Int64("cursor", a.Acked))
		taken = append(taken, a.Project)
	}
	return taken, nil
}

// deadlineFrom is when a lease granted by a statement sent at sent must be treated as lost:
// the database measured its TTL from a later instant, so this errs on the safe side.
func (c *Consumer) deadlineFrom(sent time.Time) time.Time {
	return sent.Add(c.cfg.LeaseTTL - c.cfg.LeaseTTL/20)
}

// renew extends every held lease in one statement and drops the ones that did not match.
func (c *Consumer) renew(ctx context.Context) error {
	held := c.leases.snapshot()
	if len(held) == 0 {
		return nil
	}
	projects := make([]string, 0, len(held))
	epochs := make([]int64, 0, len(held))
	for p, l := range held {
		projects = append(projects, p)
		epochs = append(epochs, l.epoch)
	}
	sent := c.now()
	rows, err := c.pool.Query(ctx, renewSQL, c.id, c.owner, c.cfg.LeaseTTL, c.offset(), projects, epochs)
	if err != nil {
		return fmt.Errorf("renew leases: %w", err)
	}
	renewed, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("renew leases: %w", err)
	}
	ok := make(map[string]bool, len(renewed))
	deadline := c.deadlineFrom(sent)
	for _, p := range renewed {
		ok[p] = true
		c.leases.extend(p, held[p].epoch, deadline)
	}
	for p, l := range held {
		if !ok[p] && c.leases.lose(p, l.epoch) {
			c.metrics.leaseLost(p, string(c.id))
			c.stats.leaseLosses.Add(1)
			c.log.Warn("lease lost at renewal; will try to re-acquire", zap.String("project_id", p), zap.Int64("epoch", l.epoch))
		}
	}
	return nil
}

// release gives up every held lease so that another process with this identity can take over
// at once instead of waiting for expiry.
func (c *Consumer) release(ctx context.Context) {
	held := c.leases.take()
	if len(held) == 0 {
		return
	}
	projects := make([]string, 0, len(held))
	epochs := make([]int64, 0, len(held))
	for p, l := range held {
		projects = append(projects, p)
		epochs = append(epochs, l.epoch)
	}
	if _, err := c.pool.Exec(ctx, releaseSQL, c.id, c.owner, projects, epochs); err != nil {
		c.log.Warn("leases not released; they will expire", zap.Error(err))
	}
}

// heartbeatLoop renews leases, follows the observed project set and retries acquisition.
func (c *Consumer) heartbeatLoop(ctx context.Context) {
	t := time.NewTicker(c.cfg.HeartbeatInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if c.heartbeatPaused.Load() {
			continue
		}
		c.heartbeat(ctx)
	}
}

// heartbeat is one round: renew what is held, then try to take what is not.
func (c *Consumer) heartbeat(ctx context.Context) {
	if err := c.renew(ctx); err != nil {
		c.logTransient("heartbeat", err)
	}
	projects, err := c.observedProjects(ctx)
	if err != nil {
		c.logTransient("heartbeat", err)
		return
	}
	held := c.leases.snapshot()
	var missing []string
	observed := make(map[string]bool, len(projects))
	for _, p := range projects {
		observed[p] = true
		if _, ok := held[p]; !ok {
			missing = append(missing, p)
		}
	}
	c.dropUnobserved(ctx, held, observed)
	if len(missing) == 0 {
		return
	}
	if err := c.ensureCursors(ctx, missing); err != nil {
		c.logTransient("heartbeat", err)
		return
	}
	taken, err := c.acquire(ctx, missing)
	if err != nil {
		c.logTransient("heartbeat", err)
		return
	}
	if len(taken) > 0 {
		c.requestScan(taken...)
	}
	if len(taken) < len(missing) {
		c.noteRetired(ctx, missing)
	}
}

// noteRetired logs, once per project, that an operator retired this identity while it ran:
// it stops advancing there and is never silently reinstated.
func (c *Consumer) noteRetired(ctx context.Context, projects []string) {
	rows, err := c.pool.Query(ctx, retiredSQL, c.id, projects)
	if err != nil {
		return
	}
	retired, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return
	}
	for _, p := range retired {
		if _, seen := c.retiredSeen.LoadOrStore(p, true); !seen {
			c.log.Error("consumer identity retired by an operator; it no longer observes this project",
				zap.String("project_id", p), zap.Error(ErrConsumerRetired))
		}
	}
}

// dropUnobserved releases the leases of projects no longer observed.
func (c *Consumer) dropUnobserved(ctx context.Context, held map[string]lease, observed map[string]bool) {
	var projects []string
	var epochs []int64
	for p, l := range held {
		if !observed[p] {
			c.leases.lose(p, l.epoch)
			projects = append(projects, p)
			epochs = append(epochs, l.epoch)
		}
	}
	if len(projects) == 0 {
		return
	}
	if _, err := c.pool.Exec(ctx, releaseSQL, c.id, c.owner, projects, epochs); err != nil {
		c.logTransient("release unobserved", err)
	}
	c.log.Info("stopped observing projects", zap.Strings("projects", projects))
}

// heartbeatControl lets tests freeze a consumer's heartbeat, standing in for a process stopped
// past its lease.
type heartbeatControl struct {
	heartbeatPaused atomic.Bool
	retiredSeen     sync.Map // project -> true, once its retirement was logged
}

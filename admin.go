package outbox

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/zap"
)

// Admin holds the operator calls behind outboxctl, usable from a host's own admin surface.
// Mutating calls take an actor and a reason, validate them as identifiers (never prose), and
// audit what they did in the same transaction.
type Admin struct {
	pool        *pgxpool.Pool
	clock       Clock
	audit       AuditSink
	log         *zap.Logger
	lockTimeout time.Duration
	stmtTimeout time.Duration
	tickChannel string
}

// AdminOptions configure an Admin.
type AdminOptions struct {
	Audit  AuditSink // defaults to TableAuditSink
	Clock  Clock     // defaults to RealClock
	Logger *zap.Logger
	// LockTimeout bounds each lock wait of a mutating call, which then fails rather than
	// queue behind a stuck transaction. Defaults to 5s.
	LockTimeout time.Duration
	// StatementTimeout bounds each statement of a mutating call. Defaults to 30s.
	StatementTimeout time.Duration
	// TickChannel is the consumers' Config.TickChannel, on which RequestReplay tells the
	// consumer that owns the dead letter to read its open deliveries. Defaults to the default
	// TickChannel. A consumer that does not hear it picks the request up within its
	// TickFallbackInterval all the same.
	TickChannel string
}

// NewAdmin returns the operator calls on pool.
func NewAdmin(pool *pgxpool.Pool, opts AdminOptions) *Admin {
	if opts.Audit == nil {
		opts.Audit = TableAuditSink{}
	}
	if opts.Clock == nil {
		opts.Clock = RealClock{}
	}
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	if opts.LockTimeout <= 0 {
		opts.LockTimeout = 5 * time.Second
	}
	if opts.StatementTimeout <= 0 {
		opts.StatementTimeout = 30 * time.Second
	}
	if opts.TickChannel == "" {
		opts.TickChannel = Config{}.WithDefaults().TickChannel
	}
	return &Admin{pool: pool, clock: opts.Clock, audit: opts.Audit, log: opts.Logger.Named("outbox.admin"),
		lockTimeout: opts.LockTimeout, stmtTimeout: opts.StatementTimeout, tickChannel: opts.TickChannel}
}

// begin starts a mutating call's transaction with its timeouts.
func (a *Admin) begin(ctx context.Context) (pgx.Tx, error) {
	return a.pool.BeginTx(ctx, boundedTx("", "", a.lockTimeout, a.stmtTimeout))
}

// StatusFilter narrows Status and DeadLetters; empty fields match everything.
type StatusFilter struct {
	ProjectID  string
	ConsumerID string
}

// ConsumerStatus is one (project, consumer) cursor as an operator sees it.
type ConsumerStatus struct {
	ProjectID       string          `json:"projectId"`
	ConsumerID      string          `json:"consumerId"`
	Cursor          *int64          `json:"cursor"` // nil: never positioned (reconciles on start)
	Head            int64           `json:"head"`
	PrunedThrough   int64           `json:"prunedThrough"`
	LagEvents       int64           `json:"lagEvents"`
	LagSeconds      float64         `json:"lagSeconds"` // age of the oldest unacknowledged event
	LeaseOwner      string          `json:"leaseOwner,omitempty"`
	LeaseEpoch      int64           `json:"leaseEpoch"`
	LeaseExpiresAt  *time.Time      `json:"leaseExpiresAt,omitempty"`
	LeaseHeld       bool            `json:"leaseHeld"`
	HeartbeatAt     *time.Time      `json:"heartbeatAt,omitempty"`
	Retired         bool            `json:"retired"`
	RetiredAt       *time.Time      `json:"retiredAt,omitempty"`
	RetiredBy       string          `json:"retiredBy,omitempty"`
	RetiredReason   string          `json:"retiredReason,omitempty"`
	Retrying        int             `json:"retrying"`
	Dead            int             `json:"dead"`
	ReplayRequested int             `json:"replayRequested"`
	ReconciledAt    *time.Time      `json:"reconciledAt,omitempty"`
	ReconcileReason ReconcileReason `json:"reconcileReason,omitempty"`
}

// statusSQL is the status of every cursor of project $2 (every project when empty), consumer
// $3 (every consumer when empty) and the projects in $4 (every project when NULL), on the clock
// shifted by $1.
const statusSQL = `
SELECT c.project_id, c.consumer_id, c.last_acked_sequence,
       coalesce(h.last_sequence, 0), coalesce(h.pruned_through, 0),
       greatest(coalesce(h.last_sequence, 0) - coalesce(c.last_acked_sequence, 0), 0),
       coalesce(greatest(extract(epoch FROM (pg_catalog.now() + $1::interval) - o.occurred_at), 0), 0)::float8,
       coalesce(c.lease_owner, ''), c.lease_epoch, c.lease_expires_at,
       coalesce(c.lease_owner IS NOT NULL AND c.lease_expires_at > pg_catalog.now() + $1::interval, false),
       c.heartbeat_at, c.retired_at IS NOT NULL, c.retired_at, coalesce(c.retired_by, ''), coalesce(c.retired_reason, ''),
       coalesce(d.retrying, 0), coalesce(d.dead, 0), coalesce(d.replay, 0),
       c.reconciled_at, coalesce(c.reconcile_reason, '')
FROM lifecycle_consumer_cursors c
LEFT JOIN lifecycle_outbox_head h ON h.project_id = c.project_id
LEFT JOIN LATERAL (
    SELECT r.occurred_at FROM lifecycle_outbox_read(c.project_id::text, coalesce(c.last_acked_sequence, 0), 1, NULL, NULL, NULL) r
    WHERE coalesce(c.last_acked_sequence, 0) < h.last_sequence
) o ON true
LEFT JOIN LATERAL (
    SELECT pg_catalog.count(*) FILTER (WHERE state = 'retrying')::int AS retrying,
           pg_catalog.count(*) FILTER (WHERE state = 'dead')::int AS dead,
           pg_catalog.count(*) FILTER (WHERE state = 'replay_requested')::int AS replay
    FROM lifecycle_consumer_deliveries d
    WHERE d.project_id = c.project_id AND d.consumer_id = c.consumer_id AND d.state <> 'resolved'
) d ON true
WHERE ($2 = '' OR c.project_id = $2) AND ($3 = '' OR c.consumer_id = $3)
  AND ($4::text[] IS NULL OR c.project_id = ANY ($4::text[]))
ORDER BY c.project_id, c.consumer_id`

// statusProjectsSQL lists the projects a status call covers, for reading them one by one after
// the read of them all failed.
const statusProjectsSQL = `
SELECT DISTINCT project_id FROM lifecycle_consumer_cursors WHERE ($1 = '' OR consumer_id = $1) ORDER BY 1`

// Now is the local clock shifted as the Admin's Clock shifts the database's: the time against
// which the times Status returns (heartbeats, lease expiries) are judged, for a surface that
// shows their ages (the operations page, package web).
func (a *Admin) Now() time.Time { return time.Now().Add(a.clock.Offset()) }

// Status reports every matching cursor: position, head, lag, lease and open deliveries. When
// the rows of some projects cannot be read (a time that is not finite, written before the
// database checked it, say), it returns the other projects' rows with a *ProjectErrors naming
// those left out.
func (a *Admin) Status(ctx context.Context, f StatusFilter) ([]ConsumerStatus, error) {
	return consumerStatus(ctx, a.pool, a.clock, f)
}

func consumerStatus(ctx context.Context, db DBTX, clock Clock, f StatusFilter) ([]ConsumerStatus, error) {
	out, err := queryStatus(ctx, db, statusSQL, clock.Offset(), f.ProjectID, f.ConsumerID, []string(nil))
	if err == nil || f.ProjectID != "" || ctx.Err() != nil || !readIsolatable(err) {
		return out, err
	}
	rows, lerr := db.Query(ctx, statusProjectsSQL, f.ConsumerID)
	if lerr != nil {
		return nil, err
	}
	projects, lerr := pgx.CollectRows(rows, pgx.RowTo[string])
	if lerr != nil {
		return nil, err
	}
	return statusEach(ctx, projects, func(p string) ([]ConsumerStatus, error) {
		return queryStatus(ctx, db, statusSQL, clock.Offset(), p, f.ConsumerID, []string(nil))
	})
}

// projectsStatus is the status of every consumer of projects, isolated per project like Status.
func projectsStatus(ctx context.Context, db DBTX, clock Clock, projects []string) ([]ConsumerStatus, error) {
	out, err := queryStatus(ctx, db, statusSQL, clock.Offset(), "", "", projects)
	if err == nil || len(projects) < 2 || ctx.Err() != nil || !readIsolatable(err) {
		return out, err
	}
	return statusEach(ctx, projects, func(p string) ([]ConsumerStatus, error) {
		return queryStatus(ctx, db, statusSQL, clock.Offset(), p, "", []string(nil))
	})
}

// statusEach reads the status of each project alone, after the read of them all failed.
func statusEach(ctx context.Context, projects []string, read func(project string) ([]ConsumerStatus, error)) ([]ConsumerStatus, error) {
	var out []ConsumerStatus
	failed := map[string]error{}
	for _, p := range projects {
		rows, err := read(p)
		if err != nil {
			if ctx.Err() != nil {
				return nil, fmt.Errorf("status: %w", ctx.Err())
			}
			failed[p] = err
			continue
		}
		out = append(out, rows...)
	}
	if len(failed) > 0 {
		return out, &ProjectErrors{Op: "status", Failed: failed}
	}
	return out, nil
}

func queryStatus(ctx context.Context, db DBTX, sql string, args ...any) ([]ConsumerStatus, error) {
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("status: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[ConsumerStatus])
	if err != nil {
		return nil, fmt.Errorf("status: %w", err)
	}
	return out, nil
}

// DeadLetter is a delivery parked after its last attempt (or awaiting a requested replay).
type DeadLetter struct {
	ProjectID         string        `json:"projectId"`
	ConsumerID        string        `json:"consumerId"`
	Sequence          int64         `json:"sequence"`
	EventID           string        `json:"eventId"`
	State             DeliveryState `json:"state"`
	Attempts          int           `json:"attempts"`
	LastFailureClass  string        `json:"lastFailureClass"`
	ParkedAt          *time.Time    `json:"parkedAt,omitempty"`
	ReplayRequestedAt *time.Time    `json:"replayRequestedAt,omitempty"`
	ReplayRequestedBy string        `json:"replayRequestedBy,omitempty"`
}

const deadLettersSQL = `
SELECT project_id, consumer_id, sequence, event_id, state, attempts, coalesce(last_failure_class, ''),
       parked_at, replay_requested_at, coalesce(replay_requested_by, '')
FROM lifecycle_consumer_deliveries
WHERE state IN ('dead', 'replay_requested')
  AND ($1 = '' OR project_id = $1) AND ($2 = '' OR consumer_id = $2)
ORDER BY project_id, consumer_id, sequence`

// DeadLetters lists unresolved dead letters.
func (a *Admin) DeadLetters(ctx context.Context, f StatusFilter) ([]DeadLetter, error) {
	rows, err := a.pool.Query(ctx, deadLettersSQL, f.ProjectID, f.ConsumerID)
	if err != nil {
		return nil, fmt.Errorf("dead letters: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[DeadLetter])
	if err != nil {
		return nil, fmt.Errorf("dead letters: %w", err)
	}
	return out, nil
}

// actorPattern and reasonPattern keep operator input to identifiers: an audit row must not
// carry free text, which could hold anything.
var (
	actorPattern  = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._@:/-]{0,127}$`)
	reasonPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:/#-]{0,127}$`)
)

// Operator says who asks for a mutation and why.
type Operator struct {
	Actor  string // an identifier: a user name, e-mail or service account
	Reason string // a ticket reference or a short code such as "listener-fixed", not prose
}

// Validate checks that the actor and the reason are identifiers, as audit rows require.
func (o Operator) Validate() error {
	if !actorPattern.MatchString(o.Actor) {
		return invalid("Operator.Actor", "must be an identifier of 1 to 128 characters from [A-Za-z0-9._@:/-] (got %q)", o.Actor)
	}
	if !reasonPattern.MatchString(o.Reason) {
		return invalid("Operator.Reason", "must be a ticket reference or short code of 1 to 128 characters from [A-Za-z0-9._:/#-], not prose (got %q)", o.Reason)
	}
	return nil
}

// ReplayRequest names a dead letter to replay.
type ReplayRequest struct {
	ProjectID  string
	ConsumerID string
	Sequence   int64 // the event's sequence in the project, as DeadLetters lists it
	Operator
}

// requestReplaySQL marks consumer @consumer's dead letter at @sequence of @project for replay,
// by @actor for @reason, at the time of the clock shifted by @clock_offset.
const requestReplaySQL = `
UPDATE lifecycle_consumer_deliveries
SET state = 'replay_requested', replay_requested_at = pg_catalog.now() + @clock_offset::interval,
    replay_requested_by = @actor, replay_reason = @reason
WHERE project_id = @project AND consumer_id = @consumer AND sequence = @sequence AND state = 'dead'
RETURNING event_id`

const deliveryStateSQL = `
SELECT state FROM lifecycle_consumer_deliveries WHERE project_id = $1 AND consumer_id = $2 AND sequence = $3`

const cursorExistsSQL = `
SELECT EXISTS (SELECT 1 FROM lifecycle_consumer_cursors WHERE consumer_id = $1 AND ($2 = '' OR project_id = $2))`

// replayHintSQL tells the consumer that owns a dead letter that a replay of it was requested.
const replayHintSQL = `SELECT pg_catalog.pg_notify($1, $2)`

// RequestReplay marks a dead letter for replay. Only the consumer that owns it re-dispatches
// it: told by a notification on AdminOptions.TickChannel once the request committed, it reads
// its open deliveries of the project on its next scan of it (within TickFallbackInterval if
// the notification is lost); it resolves the dead letter and writes the consumer-replayed audit
// row naming this operator. It returns ErrUnknownConsumer or ErrNotDeadLetter when there is
// nothing to replay.
func (a *Admin) RequestReplay(ctx context.Context, r ReplayRequest) (eventID string, err error) {
	if err := r.Validate(); err != nil {
		return "", err
	}
	if err := ValidateProjectID(r.ProjectID); err != nil {
		return "", &ValidationError{Field: "ReplayRequest.ProjectID", Reason: err.Error()}
	}
	err = a.requestReplay(ctx, r, &eventID)
	if err == nil {
		a.log.Info("replay requested", zap.String("project_id", r.ProjectID), zap.String("consumer_id", r.ConsumerID),
			zap.Int64("sequence", r.Sequence), zap.String("event_id", eventID), zap.String("actor", r.Actor))
		// After the commit, so that the consumer's read sees the request. Only a hint: the
		// request stands whether it is heard or not.
		if _, err := a.pool.Exec(ctx, replayHintSQL, a.tickChannel, replayPayload(r.ConsumerID, r.ProjectID)); err != nil {
			a.log.Warn("the replay was requested but the consumer was not told; it picks the request up within its TickFallbackInterval",
				zap.String("project_id", r.ProjectID), zap.String("consumer_id", r.ConsumerID), zap.Error(err))
		}
		return eventID, nil
	}
	if !errors.Is(err, pgx.ErrNoRows) {
		return "", fmt.Errorf("request replay: %w", err)
	}
	if err := a.requireConsumer(ctx, r.ConsumerID, r.ProjectID); err != nil {
		return "", err
	}
	var state string
	switch err := a.pool.QueryRow(ctx, deliveryStateSQL, r.ProjectID, r.ConsumerID, r.Sequence).Scan(&state); {
	case errors.Is(err, pgx.ErrNoRows):
		return "", fmt.Errorf("%w: consumer %q has no failed delivery at sequence %d of project %q", ErrNotDeadLetter, r.ConsumerID, r.Sequence, r.ProjectID)
	case err != nil:
		return "", fmt.Errorf("request replay: %w", err)
	}
	return "", fmt.Errorf("%w: the delivery at sequence %d of project %q for consumer %q is %s", ErrNotDeadLetter, r.Sequence, r.ProjectID, r.ConsumerID, state)
}

func (a *Admin) requestReplay(ctx context.Context, r ReplayRequest, eventID *string) error {
	tx, err := a.begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if err := tx.QueryRow(ctx, requestReplaySQL, pgx.StrictNamedArgs{"project": r.ProjectID, "consumer": r.ConsumerID, "sequence": r.Sequence,
		"actor": r.Actor, "reason": r.Reason, "clock_offset": a.clock.Offset()}).Scan(eventID); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

func (a *Admin) requireConsumer(ctx context.Context, consumer, project string) error {
	var exists bool
	if err := a.pool.QueryRow(ctx, cursorExistsSQL, consumer, project).Scan(&exists); err != nil {
		return fmt.Errorf("look up consumer: %w", err)
	}
	if !exists {
		if project == "" {
			return fmt.Errorf("%w: no cursor for consumer %q in any project", ErrUnknownConsumer, consumer)
		}
		return fmt.Errorf("%w: no cursor for consumer %q in project %q", ErrUnknownConsumer, consumer, project)
	}
	return nil
}

// RetireRequest names a consumer to retire, in one project or (ProjectID empty) in all.
type RetireRequest struct {
	ConsumerID string
	ProjectID  string
	Operator
}

// retireSQL retires consumer @consumer in @project (every project when empty), by @actor for
// @reason, at the time of the clock shifted by @clock_offset; reinstateSQL undoes that for
// consumer $1 in project $2. Both lock the consumer's rows in project order before they write
// any, as every statement that writes several cursor rows does (see renewSQL): a plain UPDATE
// takes them in whatever order its plan reads them, which a heartbeat writing the same rows in
// project order could deadlock with.
const retireSQL = `
WITH rows AS (
    SELECT k.project_id FROM lifecycle_consumer_cursors k
    WHERE k.consumer_id = @consumer AND (@project = '' OR k.project_id = @project) AND k.retired_at IS NULL
    ORDER BY k.project_id
    FOR NO KEY UPDATE
)
UPDATE lifecycle_consumer_cursors c
SET retired_at = pg_catalog.now() + @clock_offset::interval, retired_by = @actor, retired_reason = @reason,
    lease_owner = NULL, lease_expires_at = NULL
FROM rows r
WHERE c.consumer_id = @consumer AND c.project_id = r.project_id
RETURNING c.project_id`

const reinstateSQL = `
WITH rows AS (
    SELECT k.project_id FROM lifecycle_consumer_cursors k
    WHERE k.consumer_id = $1 AND ($2 = '' OR k.project_id = $2) AND k.retired_at IS NOT NULL
    ORDER BY k.project_id
    FOR NO KEY UPDATE
)
UPDATE lifecycle_consumer_cursors c
SET retired_at = NULL, retired_by = NULL, retired_reason = NULL
FROM rows r
WHERE c.consumer_id = $1 AND c.project_id = r.project_id
RETURNING c.project_id`

// RetireConsumer retires a consumer identity: it stops holding back pruning, its unresolved
// dead letters may be pruned, and it can no longer take a lease (a process starting with it
// gets ErrConsumerRetired). It returns the projects retired now, each with an audit row; a
// missed heartbeat never does this.
func (a *Admin) RetireConsumer(ctx context.Context, r RetireRequest) ([]string, error) {
	return a.setRetired(ctx, r, retireSQL, AuditConsumerRetired)
}

// ReinstateConsumer undoes a retirement, with its own audit row. The reinstated consumer
// reconciles if retention pruned past its cursor meanwhile.
func (a *Admin) ReinstateConsumer(ctx context.Context, r RetireRequest) ([]string, error) {
	return a.setRetired(ctx, r, reinstateSQL, AuditConsumerRestored)
}

func (a *Admin) setRetired(ctx context.Context, r RetireRequest, sql string, action AuditAction) ([]string, error) {
	if err := r.Validate(); err != nil {
		return nil, err
	}
	if _, err := ParseConsumerID(r.ConsumerID); err != nil {
		return nil, &ValidationError{Field: "RetireRequest.ConsumerID", Reason: err.Error()}
	}
	if err := a.requireConsumer(ctx, r.ConsumerID, r.ProjectID); err != nil {
		return nil, err
	}
	tx, err := a.begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", action, err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	args := []any{r.ConsumerID, r.ProjectID}
	if action == AuditConsumerRetired {
		args = []any{pgx.StrictNamedArgs{"consumer": r.ConsumerID, "project": r.ProjectID, "actor": r.Actor, "reason": r.Reason,
			"clock_offset": a.clock.Offset()}}
	}
	rows, err := tx.Query(ctx, sql, args...)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", action, err)
	}
	projects, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("%s: %w", action, err)
	}
	for _, p := range projects {
		if err := a.audit.WriteAuditTx(ctx, tx, AuditRecord{Action: action, ProjectID: p, ConsumerID: ConsumerID(r.ConsumerID),
			Actor: r.Actor, Reason: r.Reason}); err != nil {
			return nil, fmt.Errorf("%s: audit: %w", action, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("%s: %w", action, err)
	}
	a.log.Info(string(action), zap.String("consumer_id", r.ConsumerID), zap.Strings("projects", projects), zap.String("actor", r.Actor), zap.String("reason", r.Reason))
	return projects, nil
}

// Migrate applies the module's missing migrations.
func (a *Admin) Migrate(ctx context.Context) ([]int, error) { return Migrate(ctx, a.pool) }

// VerifySchema checks the module's schema is current.
func (a *Admin) VerifySchema(ctx context.Context) error { return VerifySchema(ctx, a.pool) }

package outbox

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Test hooks, compiled only into this package's tests.

// PauseHeartbeat freezes or thaws a consumer's heartbeat, standing in for a process stopped
// past its lease.
func PauseHeartbeat(c *Consumer, paused bool) { c.leases.paused.Store(paused) }

// HeartbeatNow runs one heartbeat round synchronously.
func HeartbeatNow(ctx context.Context, c *Consumer) { c.leases.heartbeat(ctx) }

// The retention batch's statement, so a test can hold one batch open and show that a delete
// transaction does not wait for it.
const PruneBatchSQL = pruneBatchSQL

// TickerLockKey is the advisory lock that elects the ticker, so a test can hold the election.
const TickerLockKey = tickerLockKey

// Statements is every SQL statement the package runs, by the name of its constant.
var Statements = map[string]string{
	"ackSQL":                   ackSQL,
	"acquireSQL":               acquireSQL,
	"advanceCursorSQL":         advanceCursorSQL,
	"countPrunableSQL":         countPrunableSQL,
	"cursorExistsSQL":          cursorExistsSQL,
	"deadLettersSQL":           deadLettersSQL,
	"deletedSinceSQL":          deletedSinceSQL,
	"deliveryStateSQL":         deliveryStateSQL,
	"ensureCursorsSQL":         ensureCursorsSQL,
	"eventAtSQL":               eventAtSQL,
	"fenceSQL":                 fenceSQL,
	"grantConsumerAccessSQL":   grantConsumerAccessSQL,
	"grantProjectAccessSQL":    grantProjectAccessSQL,
	"analyzeProjectAccessSQL":  analyzeProjectAccessSQL,
	"analyzeConsumerAccessSQL": analyzeConsumerAccessSQL,
	"headSQL":                  headSQL,
	"headsSQL":                 headsSQL,
	"loopHeadsSQL":             loopHeadsSQL,
	"loopHeadsUntickedSQL":     loopHeadsUntickedSQL,
	"untickedSQL":              untickedSQL,
	"insertAuditSQL":           insertAuditSQL,
	"insertEventSQL":           insertEventSQL,
	"lockDeliverySQL":          lockDeliverySQL,
	"moduleSchemaSQL":          moduleSchemaSQL,
	"notifySQL":                notifySQL,
	"openDeliveriesSQL":        openDeliveriesSQL,
	"openWithTickSQL":          openWithTickSQL,
	"newestTickSQL":            newestTickSQL,
	"planSQL":                  planSQL,
	"pruneBatchSQL":            pruneBatchSQL,
	"pruneDeadLettersSQL":      pruneDeadLettersSQL,
	"readEventSQL":             readEventSQL,
	"readEventsSQL":            readEventsSQL,
	"readFirstEventsSQL":       readFirstEventsSQL,
	"readTicksSQL":             readTicksSQL,
	"readTicksSinceSQL":        readTicksSinceSQL,
	"reconcileCursorSQL":       reconcileCursorSQL,
	"reinstateSQL":             reinstateSQL,
	"releaseSQL":               releaseSQL,
	"renewSQL":                 renewSQL,
	"replayFailedSQL":          replayFailedSQL,
	"replayMissingSQL":         replayMissingSQL,
	"replayResolvedSQL":        replayResolvedSQL,
	"replayHintSQL":            replayHintSQL,
	"requestReplaySQL":         requestReplaySQL,
	"resolveRetriedSQL":        resolveRetriedSQL,
	"retiredSQL":               retiredSQL,
	"retireSQL":                retireSQL,
	"revokeAllAccessSQL":       revokeAllAccessSQL,
	"revokeConsumerAccessSQL":  revokeConsumerAccessSQL,
	"revokeProjectAccessSQL":   revokeProjectAccessSQL,
	"schemaDriftSQL":           schemaDriftSQL,
	"selectEventByIDSQL":       selectEventByIDSQL,
	"tickSQL":                  tickSQL,
	"adoptSQL":                 adoptSQL,
	"allHeadsSQL":              allHeadsSQL,
	"statusProjectsSQL":        statusProjectsSQL,
	"statusSQL":                statusSQL,
	"supersedeRetriesSQL":      supersedeRetriesSQL,
	"unvalidatedChecksSQL":     unvalidatedChecksSQL,
	"upsertDeadSQL":            upsertDeadSQL,
	"upsertRetryingSQL":        upsertRetryingSQL,
}

// BeforePruneBatch has a sweep call fn before each batch's transaction, so a test can change
// the cursors between batches.
func BeforePruneBatch(r *Retention, fn func(project string)) { r.beforeBatch = fn }

// TickerElected reports whether the consumer's ticker is the elected one.
func TickerElected(c *Consumer) bool { return c.ticker.leading.Load() }

// TickerCalls is how many tick calls of c's ticker have returned.
func TickerCalls(c *Consumer) int64 { return c.ticker.calls.Load() }

// ScanNow asks a consumer's loop for a full scan, as a poll would.
func ScanNow(c *Consumer) { c.loop.scans.request() }

// ParseWakePayload exposes the check of a notification payload to the fuzz test.
func ParseWakePayload(payload string) (string, error) { return parseWakePayload(payload) }

// SharedWaiters is how many consumers wait for a read another consumer on pool has in flight.
func SharedWaiters(pool *pgxpool.Pool) int {
	s := shareOf(pool)
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, c := range s.calls {
		n += c.waiters
	}
	return n
}

// StandbyPoolUsers is how many consumers of this process read through the shared pool of the
// standby at dsn.
func StandbyPoolUsers(dsn string) int {
	standbyPools.mu.Lock()
	defer standbyPools.mu.Unlock()
	n := 0
	for key, sp := range standbyPools.pools {
		if key.dsn == dsn {
			n += sp.users
		}
	}
	return n
}

// TickServedEvent is an event a read of ticks served, with what identifies it in the log.
type TickServedEvent struct {
	Project  string
	Sequence int64
	TaskID   string
	TxID     string
}

// ServedByTicks reads projects' events in the ticks after tick, up to limit events in all, as a
// scan's first read does, and returns each project's first batch (up to batch events) as
// served from its position (after, in step).
func ServedByTicks(ctx context.Context, db DBTX, projects []string, after []int64, tick int64, limit, batch int) (map[string][]TickServedEvent, error) {
	tr, err := readTickEvents(ctx, db, projects, tick, limit, 0)
	if err != nil {
		return nil, err
	}
	out := map[string][]TickServedEvent{}
	for p, b := range tr.served(projects, after, batch) {
		for _, e := range b.events {
			out[p] = append(out[p], TickServedEvent{e.ProjectID, e.Sequence, e.TaskID, e.key.txid})
		}
	}
	return out, nil
}

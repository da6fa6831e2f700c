package outbox

import (
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"
)

// consumerConfig is what a consumer and its parts take from a validated Config: the fields
// they use, by their Config names. The module-wide switches (Disabled, ConsumerDisabled,
// AutoMigrate), the identity's setting, the writer's label and gap and the retention settings
// are not among them.
type consumerConfig struct {
	PollInterval         time.Duration
	BatchSize            int
	LeaseTTL             time.Duration
	AckInterval          time.Duration
	HeartbeatInterval    time.Duration
	ListenerTimeout      time.Duration
	NotifyDisabled       bool
	NotifyChannel        string
	TickChannel          string
	TickFloor            time.Duration
	TickBusyWait         time.Duration
	TickFallbackInterval time.Duration
	FollowUpInterval     time.Duration
	FollowUpWindow       time.Duration
	WakeInterval         time.Duration
	ListenDSN            string
	ReadDSN              string
	ReadMaxLag           time.Duration
	ListenCheckTimeout   time.Duration
	TransactionPooler    bool
	LockTimeout          time.Duration
	StatementTimeout     time.Duration
	RetrySchedule        []time.Duration
	MaxAttempts          int
	NewCursor            NewCursorPolicy
	TracerProvider       trace.TracerProvider
	Clock                Clock
}

func (c Config) consumerConfig() consumerConfig {
	return consumerConfig{
		PollInterval: c.PollInterval, BatchSize: c.BatchSize, LeaseTTL: c.LeaseTTL, AckInterval: c.AckInterval,
		HeartbeatInterval: c.HeartbeatInterval, ListenerTimeout: c.ListenerTimeout, NotifyDisabled: c.NotifyDisabled,
		NotifyChannel: c.NotifyChannel, TickChannel: c.TickChannel, TickFloor: c.TickFloor, TickBusyWait: c.TickBusyWait,
		TickFallbackInterval: c.TickFallbackInterval, FollowUpInterval: c.FollowUpInterval, FollowUpWindow: c.FollowUpWindow,
		WakeInterval: c.WakeInterval, ListenDSN: c.ListenDSN, ReadDSN: c.ReadDSN, ReadMaxLag: c.ReadMaxLag,
		ListenCheckTimeout: c.ListenCheckTimeout, TransactionPooler: c.TransactionPooler, LockTimeout: c.LockTimeout,
		StatementTimeout: c.StatementTimeout, RetrySchedule: c.RetrySchedule, MaxAttempts: c.MaxAttempts,
		NewCursor: c.NewCursor, TracerProvider: c.TracerProvider, Clock: c.Clock,
	}
}

// retryDelay is the wait after the given number of failed attempts (1 = the first failure).
func (c consumerConfig) retryDelay(attempts int) time.Duration {
	if attempts < 1 {
		attempts = 1
	}
	if attempts > len(c.RetrySchedule) {
		return c.RetrySchedule[len(c.RetrySchedule)-1]
	}
	return c.RetrySchedule[attempts-1]
}

// txOptions are the options of the consumer's own transactions: the lock and statement
// timeouts are set in the BEGIN itself with SET LOCAL, so they cost no round trip and end with
// the transaction (no session state for a pooler to carry to another client).
func (c consumerConfig) txOptions(iso pgx.TxIsoLevel, mode pgx.TxAccessMode) pgx.TxOptions {
	return boundedTx(iso, mode, c.LockTimeout, c.StatementTimeout)
}

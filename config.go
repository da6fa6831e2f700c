package outbox

import (
	"errors"
	"fmt"
	"regexp"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/trace"

	"fusion/outbox/internal/safetext"
)

// Config is the per-deployment configuration of the module. The zero value, after
// WithDefaults, is a working configuration: enabled, consumer on, NOTIFY on.
//
// Hosts load it from YAML or JSON (see LoadConfigFile and testdata/outbox.example.yaml) with
// the keys in the field tags; durations are strings such as "1s" or "250ms", and an unknown
// key is an error. A file is at most MaxConfigFileBytes (64 KiB) and a list at most
// MaxConfigListEntries (100) entries. Validate names a bad field by its Go name and its file
// key; no error repeats a value.
type Config struct {
	// Disabled turns the whole module off: the writer hook records nothing, no consumer or
	// maintenance task starts, and one log line says so. Defaults to false.
	Disabled bool `yaml:"disabled" json:"disabled"`

	// ConsumerDisabled keeps the writer hook but starts no consumer in this process.
	// Defaults to false.
	ConsumerDisabled bool `yaml:"consumer_disabled" json:"consumer_disabled"`

	// IdentityField names the persisted setting that holds this process's durable consumer
	// identity. When the setting is absent or empty, observation is disabled and the log says
	// which field to set. Defaults to "outbox.consumer_id".
	IdentityField string `yaml:"identity_field" json:"identity_field"`

	// WriterLabel prefixes the per-boot writer process ID stamped on events this process
	// writes (an origin label only). Defaults to "writer".
	WriterLabel string `yaml:"writer_label" json:"writer_label"`

	// AckInterval is how long a consumer lets a project's dispatched events go unacknowledged
	// when fewer than BatchSize of them wait: the cursor is written once BatchSize events are
	// dispatched beyond it, or AckInterval after the first of them, whichever comes first, and
	// on Stop. After a crash a project re-delivers at most what was dispatched in that time
	// (listeners are idempotent: delivery is at-least-once). Defaults to 1s; more than 0 and at
	// most LeaseTTL/3.
	AckInterval time.Duration `yaml:"ack_interval" json:"ack_interval"`

	// PollInterval is the longest a consumer waits between scans when no notification
	// arrives. Notifications only shorten it. An idle consumer's poll is one statement, its
	// read of heads; that of the consumer whose ticker is elected also says whether events
	// committed that no tick numbered (a writer's hint lost), and it then ticks, so such an
	// event waits about one PollInterval plus a tick. Defaults to 1s; must be at least 10ms.
	PollInterval time.Duration `yaml:"poll_interval" json:"poll_interval"`

	// BatchSize is how many events of one project a consumer reads in one statement, and how
	// many it dispatches at most before it writes that project's cursor. It does not bound a
	// scan: a scan reads a project batch after batch until it reaches the head it found at
	// the scan's start (or an event waiting for a retry, a lost lease, a stop), so a project
	// far behind is drained in one scan while the scan's other projects wait their turn.
	// Defaults to 1000; 1 to 10000.
	BatchSize int `yaml:"batch_size" json:"batch_size"`

	// LeaseTTL is how long a consumer's lease lasts without a heartbeat, measured by the
	// database clock. Defaults to 30s; must be at least 1s and at least three heartbeats.
	LeaseTTL time.Duration `yaml:"lease_ttl" json:"lease_ttl"`

	// HeartbeatInterval is how often a consumer renews its leases (and retries the ones it
	// could not take). Defaults to LeaseTTL/3.
	HeartbeatInterval time.Duration `yaml:"heartbeat_interval" json:"heartbeat_interval"`

	// ListenerTimeout bounds one event's dispatch to the observed listeners; a listener
	// still running then counts as a listener_timeout failure. It applies to every consumer
	// built with this Config, with fx or without. Defaults to 30s; at least 1ms.
	ListenerTimeout time.Duration `yaml:"listener_timeout" json:"listener_timeout"`

	// NotifyDisabled turns off the LISTEN/NOTIFY wake-up; consumers then rely on polling
	// alone. Defaults to false.
	NotifyDisabled bool `yaml:"notify_disabled" json:"notify_disabled"`

	// NotifyChannel is the LISTEN/NOTIFY channel. The payload is one project ID.
	// Defaults to "lifecycle_outbox".
	NotifyChannel string `yaml:"notify_channel" json:"notify_channel"`

	// TickChannel is the channel on which the ticker announces each tick ("tick/<tick_id>",
	// then one notification per project with new events, whose payload is the project ID);
	// consumers LISTEN on it. Admin.RequestReplay sends "replay/<consumer>/<project>" on it
	// (give AdminOptions.TickChannel the same value). Writers' hints on NotifyChannel are
	// heard by the elected ticker only. Defaults to NotifyChannel + "_tick".
	TickChannel string `yaml:"tick_channel" json:"tick_channel"`

	// TickFloor is the shortest time between two ticks of the elected ticker. A hint after a
	// quiet spell is ticked at once; while ticks keep finding events the ticker ticks again
	// every TickFloor, so under load each tick numbers more events and delivery waits at most
	// about TickFloor for its tick. Defaults to 2ms; 1ms to PollInterval.
	TickFloor time.Duration `yaml:"tick_floor" json:"tick_floor"`

	// TickBusyWait is the longest the elected ticker holds a tick back while its own consumer
	// is still busy with what the ticks before brought (scanning, or asked to scan). While the
	// consumers keep up, ticks follow every TickFloor. Once they fall behind, each tick waits
	// for the elected one's consumer to finish, or TickBusyWait after the last tick, and the
	// gap between ticks doubles each time the consumer is found busy, up to TickBusyWait (it
	// halves again once the consumer rests half of it), so that every consumer's read covers
	// more events instead of adding reads it cannot keep up with. Set it to TickFloor to tick
	// every TickFloor whatever the consumer does. Defaults to 25ms; TickFloor to PollInterval.
	TickBusyWait time.Duration `yaml:"tick_busy_wait" json:"tick_busy_wait"`

	// TickFallbackInterval bounds what a lost hint costs. Every consumer ticks when it took
	// no tick of its own for that long (the elected ticker when it heard no hint, the others
	// anyway): a session that holds the election lock without ticking then slows delivery to
	// this interval instead of stopping it. A consumer reads its open deliveries (retries,
	// replay requests) again at least this often, on its Clock, so a replay request whose
	// notification it did not hear waits at most this long plus a poll; with ReadDSN that read
	// also shows the primary's newest tick. Defaults to 5 × PollInterval; at least
	// PollInterval.
	TickFallbackInterval time.Duration `yaml:"tick_fallback_interval" json:"tick_fallback_interval"`

	// NotifyGap is the shortest time between two wake-up notifications sent by one writer
	// process. A commit after a quiet spell is announced at once; commits within the gap
	// share the next notification, sent when the gap has passed. Each notification is a
	// transaction of its own, so the gap bounds their cost under load; the elected ticker
	// finds the commits in between, since it ticks again every TickFloor while its ticks find
	// events. Defaults to 20ms; at most 1s.
	NotifyGap time.Duration `yaml:"notify_gap" json:"notify_gap"`

	// FollowUpInterval is how soon a consumer scans a project again after a scan of it found
	// events, while FollowUpWindow is set. Defaults to 2ms; 1ms to PollInterval.
	FollowUpInterval time.Duration `yaml:"follow_up_interval" json:"follow_up_interval"`

	// FollowUpWindow, when set, keeps a consumer scanning a project every FollowUpInterval
	// for this long after its last scan that found events, without waiting for a tick's
	// notification. Every tick that numbers a project's events notifies its consumers, so
	// follow-up scans only help where ticks are taken without notifying (outbox.Tick called
	// by a tool); each costs the statements of a scan. Defaults to 0 (none); at most
	// PollInterval.
	FollowUpWindow time.Duration `yaml:"follow_up_window" json:"follow_up_window"`

	// WakeInterval bounds the scans that notifications start for nothing. After a notified scan
	// of a project found nothing to do, further notifications for it within WakeInterval are
	// coalesced into one scan when the interval has passed, so a flood of NOTIFYs (any role can
	// send them) costs at most one empty scan per project per WakeInterval; a notified scan
	// that found events does not defer the next one. Defaults to 10ms; between 1ms and
	// PollInterval.
	WakeInterval time.Duration `yaml:"wake_interval" json:"wake_interval"`

	// ListenDSN, when set, is used for the consumer's LISTEN connection (shared by the
	// process's consumers with the same ListenDSN) and its ticker's election instead of
	// connections taken from the pool, for pools behind a transaction-pooling proxy. It must
	// parse as a PostgreSQL URL or key=value string; errors about it never repeat it, since it
	// may hold a password. Defaults to empty (use the pool's configuration).
	ListenDSN string `yaml:"listen_dsn" json:"listen_dsn"`

	// ReadDSN, when set, is a connection string to a hot standby of the database (streaming
	// replication) from which the consumer reads what it delivers: ticks, heads, events, and
	// the snapshot of a reconciliation. Everything it writes or locks stays on the pool (leases,
	// cursors, acknowledgements, deliveries, dead letters, audit rows), and so does LISTEN and
	// the ticker. Each scan reads from the standby only once it has replayed the newest tick
	// the consumer knows the primary has (announced by the ticker's notifications, checked on
	// the primary before a standby that has not replayed it holds a scan back; waiting up to
	// ReadMaxLag for it); otherwise, and while the standby is unreachable, the consumer reads
	// from the primary and returns to the standby when it has caught up. A scan the standby
	// serves sends the primary no statement. It must parse as a PostgreSQL URL or key=value string;
	// errors about it never repeat it. With TransactionPooler, it must be safe behind the pooler
	// too. Defaults to empty (read from the pool). See the runbook's section on standbys.
	ReadDSN string `yaml:"read_dsn" json:"read_dsn"`

	// ReadMaxLag is how long a scan waits for the standby (ReadDSN) to replay the newest tick
	// before it reads from the primary instead. An announced tick the standby has not replayed
	// after min(50ms, ReadMaxLag/2) is first checked on the primary. Defaults to 5s; 10ms to
	// 10m.
	ReadMaxLag time.Duration `yaml:"read_max_lag" json:"read_max_lag"`

	// ListenCheckTimeout bounds the consumer's wake-up self-test: after each LISTEN it sends
	// itself a notification through the pool and expects it on the LISTEN connection within
	// this time; when it does not arrive (a LISTEN through a transaction-pooling proxy) the
	// consumer logs what to set and runs on polling alone until a notification arrives.
	// Defaults to 2s; 10ms to 1m.
	ListenCheckTimeout time.Duration `yaml:"listen_check_timeout" json:"listen_check_timeout"`

	// TransactionPooler says the pool reaches PostgreSQL through a transaction-pooling proxy
	// such as PgBouncer with pool_mode = transaction. The module then refuses, at construction,
	// a *pgxpool.Pool whose connections would use named prepared statements or a describe
	// round trip of its own (see CheckPoolerSafe): set default_query_exec_mode=exec in the
	// DSN. Defaults to false (the pool is not checked).
	TransactionPooler bool `yaml:"transaction_pooler" json:"transaction_pooler"`

	// LockTimeout bounds every lock wait of the module's own transactions (the consumer's
	// fenced writes and reconciliation, retention batches), set with SET LOCAL so that nothing
	// stays behind on a pooled connection. A transaction that waits longer fails and is retried
	// on the next scan or sweep. Defaults to 5s; between 1ms and 10m.
	LockTimeout time.Duration `yaml:"lock_timeout" json:"lock_timeout"`

	// StatementTimeout bounds every statement of those transactions, likewise. Defaults to
	// 30s; between 1ms and 1h.
	StatementTimeout time.Duration `yaml:"statement_timeout" json:"statement_timeout"`

	// RetrySchedule is the wait before each retry of a failed event: the first entry after the
	// first failure, and so on; the last entry repeats. Defaults to 1s, 5s, 30s, 5m, 15m; at
	// most MaxConfigListEntries (100) entries, each between 0 and 24h.
	RetrySchedule []time.Duration `yaml:"retry_schedule" json:"retry_schedule"`

	// MaxAttempts is how many times an event is tried before it is parked as a dead letter.
	// Defaults to 10; 1 to 1000.
	MaxAttempts int `yaml:"max_attempts" json:"max_attempts"`

	// NewCursor says where a consumer starts in a project it has never read: "reconcile"
	// rebuilds the local cache from live tasks and starts at the head; "oldest" replays the
	// retained history (and reconciles if part of it was pruned). Defaults to "reconcile".
	NewCursor NewCursorPolicy `yaml:"new_cursor" json:"new_cursor"`

	// RetentionWindow is how long an acknowledged event is kept. Defaults to 720h (30 days);
	// at least 1h.
	RetentionWindow time.Duration `yaml:"retention_window" json:"retention_window"`

	// DeadLetterRetention is how long a resolved dead letter is kept. Unresolved ones are
	// kept until resolved or their consumer is retired. Defaults to 720h; at least 1h.
	DeadLetterRetention time.Duration `yaml:"dead_letter_retention" json:"dead_letter_retention"`

	// RetentionBatchSize is how many rows one pruning transaction deletes. Defaults to 5000;
	// 1 to 100000.
	RetentionBatchSize int `yaml:"retention_batch_size" json:"retention_batch_size"`

	// RetentionBudget is the most rows one sweep prunes before it stops and reports that it
	// was cut short; the next sweep continues. Defaults to 500000; at least RetentionBatchSize.
	RetentionBudget int `yaml:"retention_budget" json:"retention_budget"`

	// AutoMigrate applies the module's migrations at start. When false the module only
	// verifies the schema and refuses to start if it is behind. Defaults to false.
	AutoMigrate bool `yaml:"auto_migrate" json:"auto_migrate"`

	// TracerProvider, when set, turns on OpenTelemetry tracing (see tracing.go): the writer
	// hook stores the W3C trace context of its span with each event, and consumers start one
	// span per dispatch attempt linked to it, plus spans for reconciliation and retention. It is
	// set in code, never from a file. With fx, a trace.TracerProvider in the graph fills it.
	// Defaults to nil: no tracing, and no cost beyond a nil check.
	TracerProvider trace.TracerProvider `yaml:"-" json:"-"`

	// Clock moves time in tests. Defaults to RealClock.
	Clock Clock `yaml:"-" json:"-"`
}

// NewCursorPolicy says where a consumer starts in a project it has never read
// (Config.NewCursor).
type NewCursorPolicy string

// Cursor start positions for Config.NewCursor.
const (
	NewCursorReconcile NewCursorPolicy = "reconcile"
	NewCursorOldest    NewCursorPolicy = "oldest"
)

// DefaultRetrySchedule is the backoff of the contract: 1s, 5s, 30s, 5m, then 15m.
var DefaultRetrySchedule = []time.Duration{time.Second, 5 * time.Second, 30 * time.Second, 5 * time.Minute, 15 * time.Minute}

var channelPattern = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// WithDefaults returns a copy of c with every unset field given its default.
func (c Config) WithDefaults() Config {
	def := func(d *time.Duration, v time.Duration) {
		if *d == 0 {
			*d = v
		}
	}
	defInt := func(i *int, v int) {
		if *i == 0 {
			*i = v
		}
	}
	if c.IdentityField == "" {
		c.IdentityField = "outbox.consumer_id"
	}
	if c.WriterLabel == "" {
		c.WriterLabel = "writer"
	}
	def(&c.PollInterval, time.Second)
	defInt(&c.BatchSize, 1000)
	def(&c.LeaseTTL, 30*time.Second)
	def(&c.AckInterval, min(time.Second, c.LeaseTTL/3))
	def(&c.HeartbeatInterval, c.LeaseTTL/3)
	def(&c.ListenerTimeout, 30*time.Second)
	if c.NotifyChannel == "" {
		c.NotifyChannel = "lifecycle_outbox"
	}
	if c.TickChannel == "" {
		c.TickChannel = c.NotifyChannel + "_tick"
	}
	def(&c.TickFloor, min(2*time.Millisecond, c.PollInterval))
	def(&c.TickBusyWait, min(max(25*time.Millisecond, c.TickFloor), c.PollInterval))
	def(&c.TickFallbackInterval, 5*c.PollInterval)
	def(&c.NotifyGap, 20*time.Millisecond)
	def(&c.FollowUpInterval, min(2*time.Millisecond, c.PollInterval))
	def(&c.ListenCheckTimeout, 2*time.Second)
	def(&c.ReadMaxLag, 5*time.Second)
	def(&c.WakeInterval, min(10*time.Millisecond, c.PollInterval))
	def(&c.LockTimeout, 5*time.Second)
	def(&c.StatementTimeout, 30*time.Second)
	if len(c.RetrySchedule) == 0 {
		c.RetrySchedule = append([]time.Duration(nil), DefaultRetrySchedule...)
	}
	defInt(&c.MaxAttempts, 10)
	if c.NewCursor == "" {
		c.NewCursor = NewCursorReconcile
	}
	def(&c.RetentionWindow, 30*24*time.Hour)
	def(&c.DeadLetterRetention, 30*24*time.Hour)
	defInt(&c.RetentionBatchSize, 5000)
	defInt(&c.RetentionBudget, 500000)
	if c.Clock == nil {
		c.Clock = RealClock{}
	}
	return c
}

// Validate reports every invalid field of c (after WithDefaults), each error naming its field
// by its Go field path and its file key, as in
// "Config.PollInterval (poll_interval): must be at least 10ms". An error says what the field
// must be, never what it is: a value in the wrong key can be a password.
func (c Config) Validate() error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, invalid(fieldLabel(field), format, args...))
	}
	if checkID("identity field", c.IdentityField) != nil {
		bad("IdentityField", "must be 1 to %d characters from [A-Za-z0-9._:-], starting with a letter or digit", maxIDLen)
	}
	if err := checkID("writer label", c.WriterLabel); err != nil || len(c.WriterLabel) > maxIDLen-17 {
		bad("WriterLabel", "must be 1 to %d characters from [A-Za-z0-9._:-]", maxIDLen-17)
	}
	if c.PollInterval < 10*time.Millisecond {
		bad("PollInterval", "must be at least 10ms")
	}
	if c.BatchSize < 1 || c.BatchSize > 10000 {
		bad("BatchSize", "must be between 1 and 10000")
	}
	if c.AckInterval <= 0 || c.AckInterval*3 > c.LeaseTTL {
		bad("AckInterval", "must be positive and at most a third of LeaseTTL")
	}
	if c.LeaseTTL < time.Second {
		bad("LeaseTTL", "must be at least 1s")
	}
	if c.HeartbeatInterval <= 0 || c.HeartbeatInterval*3 > c.LeaseTTL {
		bad("HeartbeatInterval", "must be positive and at most a third of LeaseTTL")
	}
	if c.ListenerTimeout < time.Millisecond {
		bad("ListenerTimeout", "must be at least 1ms")
	}
	if !channelPattern.MatchString(c.NotifyChannel) {
		bad("NotifyChannel", "must be a lower-case identifier of at most 63 characters")
	}
	if !channelPattern.MatchString(c.TickChannel) || c.TickChannel == c.NotifyChannel {
		bad("TickChannel", "must be a lower-case identifier of at most 63 characters, not NotifyChannel")
	}
	if c.TickFloor < time.Millisecond || c.TickFloor > c.PollInterval {
		bad("TickFloor", "must be between 1ms and PollInterval")
	}
	if c.TickBusyWait < c.TickFloor || c.TickBusyWait > c.PollInterval {
		bad("TickBusyWait", "must be between TickFloor and PollInterval")
	}
	if c.TickFallbackInterval < c.PollInterval {
		bad("TickFallbackInterval", "must be at least PollInterval")
	}
	if c.NotifyGap <= 0 || c.NotifyGap > time.Second {
		bad("NotifyGap", "must be between 0 and 1s")
	}
	if c.ListenCheckTimeout < 10*time.Millisecond || c.ListenCheckTimeout > time.Minute {
		bad("ListenCheckTimeout", "must be between 10ms and 1m")
	}
	if c.FollowUpInterval < time.Millisecond || c.FollowUpInterval > c.PollInterval {
		bad("FollowUpInterval", "must be between 1ms and PollInterval")
	}
	if c.FollowUpWindow < 0 || c.FollowUpWindow > c.PollInterval {
		bad("FollowUpWindow", "must be between 0 and PollInterval")
	}
	if c.WakeInterval < time.Millisecond || c.WakeInterval > c.PollInterval {
		bad("WakeInterval", "must be between 1ms and PollInterval")
	}
	if c.ListenDSN != "" {
		if _, err := pgx.ParseConfig(c.ListenDSN); err != nil {
			bad("ListenDSN", "does not parse: %s (the value is not shown: it may hold a password)", safetext.DSNParseReason(err))
		}
	}
	if c.ReadDSN != "" {
		if pcfg, err := pgx.ParseConfig(c.ReadDSN); err != nil {
			bad("ReadDSN", "does not parse: %s (the value is not shown: it may hold a password)", safetext.DSNParseReason(err))
		} else if c.TransactionPooler {
			if err := CheckPoolerSafe(pcfg); err != nil {
				bad("ReadDSN", "is not safe behind a transaction pooler (TransactionPooler is set): add default_query_exec_mode=exec")
			}
		}
	}
	if c.ReadMaxLag < 10*time.Millisecond || c.ReadMaxLag > 10*time.Minute {
		bad("ReadMaxLag", "must be between 10ms and 10m")
	}
	if c.LockTimeout < time.Millisecond || c.LockTimeout > 10*time.Minute {
		bad("LockTimeout", "must be between 1ms and 10m")
	}
	if c.StatementTimeout < time.Millisecond || c.StatementTimeout > time.Hour {
		bad("StatementTimeout", "must be between 1ms and 1h")
	}
	if len(c.RetrySchedule) > MaxConfigListEntries {
		bad("RetrySchedule", "has more than %d entries, the limit (MaxConfigListEntries)", MaxConfigListEntries)
	} else {
		for i, d := range c.RetrySchedule {
			if d <= 0 || d > 24*time.Hour {
				bad("RetrySchedule", "entry %d must be between 0 and 24h", i)
			}
		}
	}
	if c.MaxAttempts < 1 || c.MaxAttempts > 1000 {
		bad("MaxAttempts", "must be between 1 and 1000")
	}
	if c.NewCursor != NewCursorReconcile && c.NewCursor != NewCursorOldest {
		bad("NewCursor", "must be %q or %q", NewCursorReconcile, NewCursorOldest)
	}
	if c.RetentionWindow < time.Hour {
		bad("RetentionWindow", "must be at least 1h")
	}
	if c.DeadLetterRetention < time.Hour {
		bad("DeadLetterRetention", "must be at least 1h")
	}
	if c.RetentionBatchSize < 1 || c.RetentionBatchSize > 100000 {
		bad("RetentionBatchSize", "must be between 1 and 100000")
	}
	if c.RetentionBudget < c.RetentionBatchSize {
		bad("RetentionBudget", "must be at least RetentionBatchSize")
	}
	if c.Clock == nil {
		bad("Clock", "is nil; call WithDefaults first")
	}
	if len(errs) > 0 {
		return fmt.Errorf("outbox config: %w", errors.Join(errs...))
	}
	return nil
}

// boundedTx are the options of the module's own transactions: the lock and statement timeouts
// are set in the BEGIN itself with SET LOCAL, so they cost no round trip and end with the
// transaction (no session state for a pooler to carry to another client).
func boundedTx(iso pgx.TxIsoLevel, mode pgx.TxAccessMode, lock, stmt time.Duration) pgx.TxOptions {
	begin := "BEGIN"
	if iso != "" {
		begin += " ISOLATION LEVEL " + string(iso)
	}
	if mode != "" {
		begin += " " + string(mode)
	}
	// BeginQuery takes no arguments and SET no parameters, so the timeouts are written into the
	// text: integers only, nothing from outside reaches it.
	return pgx.TxOptions{BeginQuery: fmt.Sprintf("%s; SET LOCAL lock_timeout = %d; SET LOCAL statement_timeout = %d",
		begin, max(lock.Milliseconds(), 1), max(stmt.Milliseconds(), 1))}
}

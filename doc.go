// Package outbox gives a multi-process task store durable, ordered, cross-process observation
// of task deletions through PostgreSQL.
//
// # The problem
//
// A task store soft-deletes a task by setting deleted_at, writes one task:deleted audit row and,
// after commit, sends an operator mailbox notice and tells its in-process listeners. Nothing
// tells the other processes sharing the database: a dashboard, a CLI or an engine on another
// node keeps showing the task. NOTIFY alone is at-most-once (a process that is restarting or
// disconnected misses it), so it cannot be the record.
//
// # The outbox
//
// The writer hook, Writer.RecordTaskDeletedTx, runs inside the host's delete transaction and
// inserts one row into the event log, lifecycle_event_log, for the first deleted_at transition
// only: its identity is "task-deleted:<taskId>:<deletedAt>" with deletedAt in canonical UTC at
// the database's microsecond precision, unique per project, so a repeated or concurrent delete
// records nothing new and a rolled-back delete leaves nothing. The delete and its event commit
// together. The row carries the writing transaction's ID (txid), and nothing updates it after.
//
// Ordering is assigned after commit. A bigserial would be wrong: a transaction holding sequence
// 10 can commit after one holding 11, and a reader that acknowledged 11 would never see 10. A
// per-project counter row locked until commit would serialise every delete of a project. So the
// ticker (the database function lifecycle_outbox_tick) stores the current transaction snapshot
// as a tick whenever events committed since the last one. Tick n's batch is the events whose
// transaction is visible in tick n's snapshot and was not in tick n-1's: every committed event
// falls in exactly one batch, that of the first tick after its commit, and a rolled-back one in
// none. The ticker counts each batch per project and moves the project's head by that count; an
// event's sequence is derived when it is read (lifecycle_outbox_read): the project's count
// before the tick plus the event's rank in the project's part of the batch, by (txid,
// deleted_at, task_id). Sequences are contiguous per project, and an event that commits after a
// tick falls in a later one, so readers of "sequence > cursor" cannot skip one. An open
// transaction anywhere in the database holds nothing back: its own events arrive in the first
// tick after it ends.
//
// One ticker numbers for every consumer. Each consumer is a candidate, and the one that holds a
// session advisory lock on its dedicated connection is elected: it ticks on the writers' hints,
// at most once per Config.TickFloor, and otherwise once per Config.TickFallbackInterval. While
// its own consumer is still busy with the ticks before, it holds the next tick back, for at
// most Config.TickBusyWait: ticks faster than the consumers read only add reads. The
// poll of its own consumer (its one read of heads) also says whether events committed that no
// tick numbered, in any project, and it then ticks, so a lost hint costs about one
// PollInterval and a tick. The tick announces itself on Config.TickChannel: "tick/<tick_id>",
// then one notification per project with new events. The other candidates wait for the lock
// without sending a statement and tick only once per Config.TickFallbackInterval, so a stalled
// ticker slows delivery to that interval and stops nothing. (With NOTIFY off, or behind a
// transaction pooler without Config.ListenDSN, there is no election: every consumer ticks once
// per PollInterval.) After commit the writer sends a coalesced NOTIFY naming the project; it is
// only a hint to the ticker.
//
// A consumer reads its open deliveries (retries, replay requests) only when they may have
// changed: when it gains a lease, after a write of its own whose outcome is unknown, when
// Admin.RequestReplay tells it on Config.TickChannel that an operator asked for a replay, and
// at least once per TickFallbackInterval; otherwise it keeps what it read and wrote
// (open_deliveries.go).
//
// The transaction ID timeline is load-bearing: ticks compare transaction IDs, which a physical
// replica, a failover or pg_upgrade keeps but a logical dump restored into another cluster does
// not. Such a move needs the new cluster's xid epoch raised before any writer uses it; the
// ticker refuses to tick (ErrXIDTimeline) when it finds the cluster's transaction IDs behind
// its last tick or the stored events. docs/operations.md, "Moving the database", has the
// procedure.
//
// # Consumers
//
// A process observes only with a durable identity read from a named persisted setting (see
// ResolveConsumerID); without one, observation stays off and the log says which setting to set.
// A Consumer keeps one cursor per (project, consumer) in lifecycle_consumer_cursors, holds each
// under a lease with a fencing epoch judged by the database clock, LISTENs on a dedicated
// connection first and then catches up from its cursor in batches. It only reads: the heads,
// then the events through lifecycle_outbox_read, continuing inside a tick after the key of the
// last event it read. Every cursor write names the epoch it was granted: a process frozen past
// its lease, or replaced by another process with the same identity, writes nothing. No
// transaction stays open while listeners run. Acknowledgements go by time or count: a project's
// cursor is written once Config.BatchSize events are dispatched beyond it or Config.AckInterval
// after the first of them, whichever comes first, and on Stop. Delivery is at-least-once: after
// a crash a project re-delivers at most BatchSize events or AckInterval's worth, so listeners
// must be idempotent.
//
// The Dispatcher applies each deletion to the host's cache and hands it to the observed
// listeners with a context marked observed (see WithObserved). The writer hook and the host's
// writer-owned paths (the delete, its audit row, its mailbox notice) refuse such a context with
// a *FenceError, so an observer can never repeat the writer's side effects. A process never
// re-delivers its own writes to its own listeners (its local emitter already told them), but
// applies them to its cache like any other.
//
// A failing event is not acknowledged: the stream waits for it while its delivery row records
// attempts, the next attempt time and a failure class (never error text), with a backoff of 1s,
// 5s, 30s, 5m, then 15m. After the tenth attempt one fenced transaction parks it as a dead
// letter, writes a consumer-poisoned audit row and moves the cursor on. An operator can replay
// it (Admin.RequestReplay) once the cause is fixed; only the owning consumer re-delivers it.
//
// When history is gone (a cursor never positioned, ahead of the head, or below the pruned
// floor, or a hole in the stream: an event its tick counted that is no longer stored, which
// only the schema's owner can cause, reason stream_hole) the consumer reconciles: in one
// REPEATABLE READ snapshot it reads the head and the live task IDs, replaces its cache's live
// set, removes again whatever was deleted after the snapshot (the process's own deletes
// included), and restarts its cursor at that head.
//
// Stop is bounded by its context: no event is handed to a listener after it is called, the
// one in flight may finish and is acknowledged only if it did, and a consumer once stopped
// cannot be started again (ErrConsumerStopped).
//
// # Operations
//
// Retention is a MaintenanceTask the host's self-healing sweep runs: it prunes events older
// than the window and acknowledged by every non-retired consumer, in bounded batches, recording
// the project's pruned floor. Retirement of a consumer is explicit and audited, never inferred
// from a missed heartbeat. Admin and cmd/outboxctl show status and lag, list dead letters,
// request replays, retire consumers and preview pruning; Metrics exports them to Prometheus.
// The web surface (the resumable event stream, the operations page, and the client with which
// child workers and remote nodes follow a stream) is package fusion/outbox/web, built on this
// package's public API alone.
// Migrations are numbered, embedded and applied under an advisory lock (Migrate); VerifySchema
// checks a database against SchemaVersion. schema.sql at the module root shows the whole schema
// they build, in one place, for reading: `make schema` generates it from a freshly migrated
// database, `make test` fails while it differs, and nothing applies it.
//
// # Poolers, tracing and config files
//
// Behind a transaction-pooling proxy such as PgBouncer the pool must use pgx's
// QueryExecModeExec (default_query_exec_mode=exec; see CheckPoolerSafe and
// Config.TransactionPooler), and Config.ListenDSN should reach PostgreSQL directly: each
// consumer proves its wake-ups with a NOTIFY to itself and polls alone, saying so once, when
// they do not arrive (Consumer.Wakeups). With TransactionPooler and no ListenDSN it sends no
// LISTEN through the pool at all (one left on a server connection upsets PgBouncer's server
// check) and polls, saying so once. The module keeps no session state on pooled connections
// (the ticker's election lock is held on the consumer's dedicated connection). With
// Config.TracerProvider set the writer stores the W3C trace context of its insert's span with
// each event, and every dispatch attempt is a consumer span linked to it (tracing.go). Config
// decodes from YAML and JSON with the keys of its field tags (LoadConfigFile).
//
// # Reading from a hot standby
//
// With Config.ReadDSN a consumer reads ticks, heads, events and reconciliation snapshots from a
// physical streaming standby, and writes, locks, LISTENs and ticks on its pool (standby.go). A
// scan reads there only once the standby has replayed the newest tick the ticker announced (or
// the primary showed, or the consumer saw); it waits for that up to Config.ReadMaxLag, then
// reads from the primary until the standby catches up. An announcement is a hint: one the
// standby has not replayed within 50ms is checked on the primary first. A scan the standby
// serves sends the primary no statement. Heads and events of a scan come from one server, and a
// scan only ever moves from the standby to the primary.
//
// # Isolation
//
// Every role, row and client may be hostile or broken, and the database refuses what must never
// happen. Each component runs as a role of its own (GrantWriterRole, GrantConsumerRole,
// GrantOperatorRole) holding only the column privileges it uses, none of which allows a lock
// that blocks another project (a consumer role's call of the ticker's function, in a
// transaction it keeps open, holds back every tick: docs/operations.md); row-level security
// scopes every table by project and the writes of cursors and deliveries by consumer identity;
// checks refuse malformed identifiers and times; the functions pin their search_path and the
// module's SQL qualifies every built-in it calls. One project's trouble stays in that project:
// the read of events, the read of open deliveries, status and metrics fall back to one project
// at a time (the last three report what they skipped, ProjectErrors), and a row the consumer
// cannot decode becomes a dead letter of class undecodable_event. docs/operations.md has the
// threat model.
//
// # Wiring
//
// New is the composition root: from the host's pool, one Config and the host's seams (Deps:
// Settings, TaskCache, LiveTasks, AuditSink, Projects, listeners, optional per-component
// pools), it applies the Config's defaults and validates it, once, and builds the writer hook,
// the dispatcher (knowing the writer's process ID), the consumer, the retention sweep and the
// admin calls, each given the Config fields it uses. Outbox.Start resolves the identity from
// the named setting and starts the consumer
// (without an identity it succeeds and State says observation is off); Outbox.Stop stops it and
// the writer's wake-ups, bounded by its context. Module is thin fx glue over New that provides
// the writer on its own, so a host's store can take it in its constructor. Each piece also has
// a plain constructor (NewWriter, NewDispatcher, NewConsumer, NewRetention, NewAdmin). Every
// long-running part runs on one start/stop lifecycle (package startstop). The schema must be
// migrated first (Migrate, outboxctl migrate) unless Config.AutoMigrate is set. The reference
// host in example/taskstore shows a complete host on the public API alone.
package outbox

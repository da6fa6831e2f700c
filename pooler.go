package outbox

import (
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"fusion/outbox/internal/safetext"
)

// Behind a transaction-pooling proxy (PgBouncer with pool_mode = transaction, and its kin) a
// client keeps a server connection only for the length of one transaction, or of one statement
// outside a transaction. What that breaks, and what the module does about it:
//
//   - Named prepared statements. pgx's default, QueryExecModeCacheStatement, prepares each
//     statement once per connection under a name and then only binds it: the next transaction
//     may run on another server connection, where the name is unknown ("prepared statement
//     ... does not exist") or names something else. PgBouncer tracks protocol-level prepared
//     statements only from 1.21 on, and only when max_prepared_statements is set.
//     QueryExecModeCacheDescribe and QueryExecModeDescribeExec use the unnamed statement but
//     describe it in a round trip of its own, and outside a transaction the proxy may run the
//     second round trip on another server connection. QueryExecModeExec sends parse, bind and
//     execute in one round trip and is safe; QueryExecModeSimpleProtocol is safe too (it
//     interpolates parameters on the client). Every statement of the module runs correctly in
//     QueryExecModeExec: the test suite runs the writer, the consumer, retention and outboxctl
//     through a real PgBouncer in that mode.
//   - LISTEN. A LISTEN through the proxy is registered on whichever server connection ran it
//     and the notifications go to whichever client holds that connection next, so a consumer's
//     wake-ups silently never arrive. The consumer proves its wake-up channel at start (see
//     Consumer.Wakeups) and falls back to polling alone when it does not work; set
//     Config.ListenDSN to a direct connection to PostgreSQL to keep prompt wake-ups.
//   - Session state. The module sets nothing at session level: its only setting is SET LOCAL
//     style (set_config(..., true)) inside the notifying transaction, its only advisory lock
//     is transaction-scoped (migrations), and it creates no temporary table.

// CheckPoolerSafe reports whether connections made with cfg are safe behind a
// transaction-pooling proxy. It returns nil for QueryExecModeExec and
// QueryExecModeSimpleProtocol and an error that says what to set for every other mode.
func CheckPoolerSafe(cfg *pgx.ConnConfig) error {
	if cfg == nil {
		return invalid("pgx.ConnConfig", "is nil")
	}
	switch mode := cfg.DefaultQueryExecMode; mode {
	case pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol:
		return nil
	default:
		why := "it prepares named statements, which live on one server connection while the proxy moves the client between them"
		if mode == pgx.QueryExecModeDescribeExec || mode == pgx.QueryExecModeCacheDescribe {
			why = "it describes a statement in one round trip and runs it in another, which the proxy may send to another server connection"
		}
		return &ValidationError{Field: "pgx.ConnConfig.DefaultQueryExecMode (default_query_exec_mode)",
			Reason: fmt.Sprintf("is %s, which is unsafe behind a transaction-pooling proxy: %s; "+
				"add default_query_exec_mode=exec to the connection string (or set pgx.ConnConfig.DefaultQueryExecMode to pgx.QueryExecModeExec)", modeName(mode), why)}
	}
}

// CheckPoolerSafeDSN is CheckPoolerSafe for a connection string.
func CheckPoolerSafeDSN(dsn string) error {
	cfg, err := pgx.ParseConfig(dsn)
	if err != nil {
		return fmt.Errorf("check pooler safety: %w", err)
	}
	return CheckPoolerSafe(cfg)
}

// modeName is the connection-string spelling of a mode.
func modeName(m pgx.QueryExecMode) string {
	switch m {
	case pgx.QueryExecModeCacheStatement:
		return "cache_statement (the pgx default)"
	case pgx.QueryExecModeCacheDescribe:
		return "cache_describe"
	case pgx.QueryExecModeDescribeExec:
		return "describe_exec"
	default:
		return m.String()
	}
}

// checkPooledDB applies CheckPoolerSafe to a pool the module was given, when the
// configuration says the pool goes through a transaction pooler. Other database handles (a
// connection, a transaction, a host's wrapper) are the host's to check.
func checkPooledDB(cfg Config, db any) error {
	if !cfg.TransactionPooler {
		return nil
	}
	pool, ok := db.(*pgxpool.Pool)
	if !ok || pool == nil {
		return nil
	}
	if err := CheckPoolerSafe(pool.Config().ConnConfig); err != nil {
		return fmt.Errorf("outbox config: TransactionPooler (transaction_pooler) is set but the pool is not safe behind it: %w", err)
	}
	return nil
}

// DSNParseReason says why a connection string did not parse (err is what pgx's ParseConfig
// returned), in a sentence from a fixed set that never repeats part of the string: pgx's own
// message can hold part of a password. Hosts use it to report their own DSNs the same way.
func DSNParseReason(err error) string { return safetext.DSNParseReason(err) }

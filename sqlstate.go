package outbox

// SQLSTATEs of the module's own errors, raised by its functions with RAISE ... USING ERRCODE.
// They are in class LX, which PostgreSQL does not use, among the classes the SQL standard
// leaves to implementations (those beginning with 5 to 9 or I to Z), so none can be taken for
// the server's own. An error that has a standard meaning keeps its standard code, which
// pgerrcode names: a bad argument (22023), a project the caller may not prune (42501), a
// tick outside READ COMMITTED (25001). TestModuleSQLStates checks that every LX code the
// schema raises or the docs name is declared here.
const (
	// sqlstateXIDTimeline: the ticker found the cluster's transaction IDs behind its last
	// tick or the newest stored event (migration 0018): the database was moved into another
	// cluster by a logical dump or logical replication. Tick returns it as ErrXIDTimeline,
	// with the server's hint (docs/operations.md, "Moving the database").
	sqlstateXIDTimeline = "LX001"

	// sqlstateNoTick: the ticker found lifecycle_tick empty (migration 0018). Migration 0018
	// writes tick 1 and retention never removes the newest tick, so the schema was changed by
	// hand. No code path tells it apart: the consumer logs the error and retries.
	sqlstateNoTick = "LX002"

	// sqlstateTickMissing: the log's reader (migration 0018) or retention (migration 0019) met
	// a part of the log whose tick, or the tick before it, is gone. Retention keeps every tick
	// a remaining part needs, so the schema was changed by hand. No code path tells it apart
	// either: the read or the sweep fails with the server's message.
	sqlstateTickMissing = "LX003"
)

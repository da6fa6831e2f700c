package outbox

// SQLStateXIDTimeline is the SQLSTATE of the ticker's refusal of a broken xid timeline.
const SQLStateXIDTimeline = sqlstateXIDTimeline

// ModuleSQLStates is every SQLSTATE the module declares for its own errors (sqlstate.go), by
// the name of its constant.
var ModuleSQLStates = map[string]string{
	"sqlstateXIDTimeline": sqlstateXIDTimeline,
	"sqlstateNoTick":      sqlstateNoTick,
	"sqlstateTickMissing": sqlstateTickMissing,
}

package outbox

// The event stream's and the operations page's statements join Statements here, in a file of
// their own, so that TestEveryStatementPrepares prepares them too.
func init() {
	Statements["sseHeadSQL"] = sseHeadSQL
	Statements["ssePageSQL"] = ssePageSQL
}

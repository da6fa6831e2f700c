package outbox

// Statements run once per connection or election join Statements here, in a file of their
// own, so that TestEveryStatementPrepares prepares them too.
func init() {
	Statements["inRecoverySQL"] = inRecoverySQL
	Statements["standbyNewestTickSQL"] = standbyNewestTickSQL
	Statements["tickerLockSQL"] = tickerLockSQL
}

package web

// Statements is every SQL statement the package runs, by the name of its constant: what
// queries_test.go prepares and checks (internal/testkit), as the core's export_test.go does.
var Statements = map[string]string{
	"sseHeadSQL": sseHeadSQL,
	"ssePageSQL": ssePageSQL,
}

// MaxIDLen is the longest project ID a request's query is sized for.
const MaxIDLen = maxIDLen

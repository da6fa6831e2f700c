package safetext

import (
	"encoding/json"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
)

func TestEscape(t *testing.T) {
	for in, want := range map[string]string{
		"engine-eu:1":                          "engine-eu:1",
		"task with spaces":                     "task with spaces",
		"\r\x1b[K (all checks passed, type y)": `\r\x1b[K (all checks passed, type y)`,
		"a\u202eb":                             `a\u202eb`,
		"bell\a":                               `bell\a`,
		`back\slash`:                           `back\\slash`,
		"bad \xff byte":                        `bad \xff byte`,
		"naïve":                                "naïve",
	} {
		require.Equal(t, want, Escape(in), "%q", in)
	}
	require.Equal(t, `back\slash \x1b`, Printable("back\\slash \x1b"), "Printable leaves backslashes alone")
	require.Equal(t, `two\nlines`, Printable("two\nlines"))
}

func TestJSONStaysValidAndPrintable(t *testing.T) {
	doc, err := json.MarshalIndent(map[string]string{"id": "a\u202eb\x1b\U0001F600\u00a0"}, "", "  ")
	require.NoError(t, err)
	out := JSON(doc)
	require.NotContains(t, string(out), "\u202e")
	require.NotContains(t, string(out), "\u00a0")
	var back map[string]string
	require.NoError(t, json.Unmarshal(out, &back))
	require.Equal(t, "a\u202eb\x1b\U0001F600\u00a0", back["id"], "the document means the same")
}

func TestDSNParseReasonNeverRepeatsTheString(t *testing.T) {
	for _, dsn := range []string{
		"password=my Sup3rSecret phrase host=db",
		"host=db password='my Sup3rSecret phrase",
		"postgres://u:my Sup3rSecret phrase@db/x",
		"postgres://u:Sup3rSecret@db:notaport/x",
		"host=db sslmode=bogus password=Sup3rSecret",
		"host=db password=Sup3rSecret connect_timeout=soon",
	} {
		_, err := pgx.ParseConfig(dsn)
		require.Error(t, err, dsn)
		reason := DSNParseReason(err)
		require.NotContains(t, reason, "Sup3rSecret", dsn)
		require.NotContains(t, reason, "phrase", dsn)
		require.NotEmpty(t, reason)
	}
}

package web_test

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
)

// TestSSEMovesPastAnUndecodableRow: a row the consumer parks as undecodable (deleted_at
// 'infinity', written before the database checked rows) is skipped by a resuming client, which
// gets every other event, no reset, and an ID past the row; a second resume from before it
// works the same way instead of failing on the page again.
func TestSSEMovesPastAnUndecodableRow(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	testkit.SeedUndecodableAt4(t, pool, "p") // 1 to 3, then 4 cannot be decoded; 5 and 6 follow it

	sse := newSSE(t, pool, []string{"p"}, nil)
	srv := httptest.NewServer(sse)
	defer srv.Close()
	probe, _ := openStream(t, ctx, srv.URL, "")
	parts := strings.Split(probe.position(t, ctx), ".")
	require.Len(t, parts, 3)
	for attempt := range 2 {
		s, code := openStream(t, ctx, srv.URL, "1."+parts[1]+".0")
		require.Equal(t, http.StatusOK, code)
		var seqs []int64
		for len(seqs) < 5 {
			seqs = append(seqs, decodeDeletion(t, s.next(t, ctx, fmt.Sprintf("attempt %d", attempt))).Sequence)
		}
		require.Equal(t, []int64{1, 2, 3, 5, 6}, seqs, "attempt %d: every event but the undecodable one, in order", attempt)
		require.Equal(t, "1."+parts[1]+".6", s.close(), "the last ID is past every row")
	}
	require.Zero(t, sse.Stats().Resets)
}

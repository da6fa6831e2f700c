package web_test

import (
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/web"
)

// TestSSEOpeningMovesOnlyWhatWasSent: the opening frame of a resumed stream carried the
// positions after its resets, so a client that kept that ID and stopped before the resets (a
// browser whose connection dropped, a StreamClient whose HandleReset failed) resumed past
// resets it never saw. The opening frame now keeps the resumed positions of the projects
// about to be reset, and each reset frame moves only its own.
func TestSSEOpeningMovesOnlyWhatWasSent(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	projects := []string{"p", "q", "r"}
	for _, p := range projects {
		testkit.SeedEvents(t, pool, p, 5)
	}
	sse := newSSE(t, pool, projects, func(o *web.SSEOptions) { o.MaxReplayReads = 1 })
	srv := httptest.NewServer(sse)
	defer srv.Close()
	url := srv.URL + "?project=p,q,r"
	probe, _ := openStream(t, ctx, url, "")
	fp := strings.Split(probe.position(t, ctx), ".")[1] // the handler has seen 5 of each
	testkit.SeedMore(t, pool, "p", "more", 5)           // the outbox is at 10 in p

	// p at 8: beyond the handler's newest, checked with the one read the budget allows, kept.
	// q at 20 ("k"): beyond the head too, left unchecked: unknown_position. r at 2: its replay
	// needs a read the budget no longer has: replay_budget.
	last := "1." + fp + ".8.k.2"
	s, _ := openStream(t, ctx, url, last)
	defer s.close()
	f := s.next(t, ctx, "the first reset")
	require.Equal(t, last, <-s.opened, "the opening frame moves nothing")
	require.Equal(t, web.SSEResetEvent, f.Event)
	require.JSONEq(t, `{"projects":["q"],"reason":"unknown_position"}`, f.Data)
	require.Equal(t, "1."+fp+".8.5.2", f.ID, "the first reset moves only q")
	f = s.next(t, ctx, "the second reset")
	require.JSONEq(t, `{"projects":["r"],"reason":"replay_budget"}`, f.Data)
	require.Equal(t, "1."+fp+".8.5.5", f.ID)

	// An ID of another stream: the reset of every project, at the handler's newest events, is
	// the first frame.
	s2, _ := openStream(t, ctx, url, "1.00000000.1.1.1")
	defer s2.close()
	f = s2.next(t, ctx, "the reset")
	require.Equal(t, "1."+fp+".5.5.5", <-s2.opened, "no frame before the reset")
	require.JSONEq(t, `{"projects":["p","q","r"],"reason":"unknown_position"}`, f.Data)
	require.Equal(t, "1."+fp+".5.5.5", f.ID)
}

package web_test

import (
	"bufio"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
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

// TestSSEMovesPastAParkedEvent: the consumer parked the project's last events (every listener
// after the failing one never saw them). The stream sends a well-formed one in its place and
// the ID of a row that cannot be decoded without an event, so a client that resumes from
// before them ends at the head instead of behind it until another event comes, which may be
// never.
func TestSSEMovesPastAParkedEvent(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	pool := pgtest.NewPool(t)
	testkit.SeedEvents(t, pool, "p", 5)
	sse := newSSE(t, pool, []string{"p"}, nil)
	srv := httptest.NewServer(sse)
	defer srv.Close()
	deleted := time.Date(2030, 1, 1, 0, 0, 4, 0, time.UTC)
	require.NoError(t, sse.HandleObserved(ctx, outbox.ObservedEvent{Event: outbox.Event{ProjectID: "p", Sequence: 3,
		EventType: outbox.EventTypeTaskDeleted, TaskID: "seed-3", DeletedAt: deleted.Add(-time.Second)}}))
	probe, _ := openStream(t, ctx, srv.URL, "")
	id := strings.Split(probe.position(t, ctx), ".")
	require.Equal(t, "3", id[2], "the stream stands at the last event its consumer handed it")

	sse.HandleParked(ctx, outbox.Event{ProjectID: "p", Sequence: 4, EventType: outbox.EventTypeTaskDeleted, TaskID: "seed-4",
		EventID: outbox.TaskDeletedEventID("seed-4", deleted), DeletedAt: deleted, WriterProcessID: "writer-0123456789abcdef",
		OccurredAt: deleted, PayloadVersion: outbox.PayloadVersion})
	sse.HandleParked(ctx, outbox.Event{ProjectID: "p", Sequence: 5}) // what could be read of a row that cannot be decoded
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL, nil)
	require.NoError(t, err)
	req.Header.Set("Last-Event-ID", "1."+id[1]+".3")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	lines := bufio.NewScanner(resp.Body)
	var frame []string
	var frames []string
	for lines.Scan() {
		if lines.Text() != "" {
			frame = append(frame, lines.Text())
			continue
		}
		opening := len(frame) == 1 && frame[0] == "id: 1."+id[1]+".3"
		if !opening && slices.ContainsFunc(frame, func(l string) bool { return strings.HasPrefix(l, "id: ") }) {
			frames = append(frames, strings.Join(frame, "\n"))
		}
		frame = frame[:0]
		if len(frames) == 2 {
			break
		}
	}
	require.Len(t, frames, 2, "the stream ended early: %v", lines.Err())
	require.Contains(t, frames[0], "id: 1."+id[1]+".4")
	require.Contains(t, frames[0], `"taskId":"seed-4"`, "the parked event, in its place")
	require.Equal(t, "id: 1."+id[1]+".5", frames[1], "the undecodable one: its position only")
}

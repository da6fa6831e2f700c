package outbox

import (
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap"
)

// TestWakeChannelPayloads: the tick's announcement and the replay hint parse back, are never
// taken for a project ID (an earlier build skips them), and anything malformed is skipped.
func TestWakeChannelPayloads(t *testing.T) {
	t.Parallel()
	for payload, want := range map[string]int64{"tick/1": 1, "tick/9223372036854775807": 9223372036854775807} {
		got, ok := parseTickPayload(payload)
		require.True(t, ok, payload)
		require.Equal(t, want, got, payload)
		_, err := parseWakePayload(payload)
		require.Error(t, err, "%s is not a project ID", payload)
	}
	for _, payload := range []string{"tick/", "tick/0", "tick/-1", "tick/+1", "tick/01", "tick/1x", "tick/ 1",
		"tick/9223372036854775808", "tick1", "Tick/1", "alpha"} {
		_, ok := parseTickPayload(payload)
		require.False(t, ok, payload)
	}

	hint := replayPayload("engine-1", "proj:a.b")
	consumer, project, ok := parseReplayPayload(hint)
	require.True(t, ok)
	require.Equal(t, ConsumerID("engine-1"), consumer)
	require.Equal(t, "proj:a.b", project)
	_, err := parseWakePayload(hint)
	require.Error(t, err, "a replay hint is not a project ID")
	for _, payload := range []string{"replay/", "replay/engine", "replay//p", "replay/engine/", "replay/en gine/p",
		"replay/engine/p/q", "replay/-engine/p", "replay/engine/p q", "replay:engine/p"} {
		_, _, ok := parseReplayPayload(payload)
		require.False(t, ok, payload)
	}
}

// TestWakerNotes: a project's notification asks for a scan of it; a tick's announcement raises
// the newest announced tick and asks for nothing (the project notifications after it do); a
// replay hint for this consumer has the project's open deliveries read, one for another
// consumer does nothing; anything else is skipped.
func TestWakerNotes(t *testing.T) {
	t.Parallel()
	scans := newScanRequests()
	wk := &waker{id: "engine", scans: scans, log: zap.NewNop()}

	wk.note("ch", "tick/7")
	wk.note("ch", "tick/5")
	require.EqualValues(t, 7, scans.announced.Load(), "the newest announcement stays")
	dirty, all, stale := scans.take()
	require.Empty(t, dirty)
	require.False(t, all)
	require.Empty(t, stale)

	wk.note("ch", "alpha")
	wk.note("ch", replayPayload("other", "beta"))
	wk.note("ch", replayPayload("engine", "gamma"))
	wk.note("ch", "selftest/abc")
	wk.note("ch", "tick/x")
	dirty, all, stale = scans.take()
	require.Equal(t, map[string]struct{}{"alpha": {}, "gamma": {}}, dirty)
	require.False(t, all)
	require.Equal(t, map[string]struct{}{"gamma": {}}, stale)
	require.EqualValues(t, 7, scans.announced.Load())

	scans.requestRead()
	dirty, all, stale = scans.take()
	require.True(t, all)
	require.Contains(t, dirty, "")
	require.Equal(t, map[string]struct{}{"": {}}, stale)
}

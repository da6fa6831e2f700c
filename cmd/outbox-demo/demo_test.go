package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestMetricsExcerptSaysCountersArePerProcess: the dashboard is killed and restarted mid-run,
// so its /metrics counters count only the second process (200 of a project's 300). The excerpt
// says so and puts the demo's own count over both processes, from the applied log, beside it.
func TestMetricsExcerptSaysCountersArePerProcess(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	logPath := filepath.Join(dir, "dashboard.applied.jsonl")
	var log strings.Builder
	for i := 1; i <= 3; i++ {
		log.WriteString(`{"kind":"applied","eventId":"e` + string(rune('0'+i)) + `","project":"alpha","sequence":` + string(rune('0'+i)) + "}\n")
	}
	// The restarted process sees e3 again and suppresses it.
	log.WriteString(`{"kind":"duplicate","eventId":"e3","project":"alpha","sequence":3}` + "\n")
	log.WriteString(`{"kind":"applied","eventId":"b1","project":"beta","sequence":1}` + "\n")
	require.NoError(t, os.WriteFile(logPath, []byte(log.String()), 0o644))
	r, err := readAppliedLog(logPath)
	require.NoError(t, err)
	require.Equal(t, map[string]int{"alpha": 3, "beta": 1}, r.perProject)

	body := `# HELP outbox_events_dispatched_total Events handled by a consumer, by outcome (delivered, own, failed).
# TYPE outbox_events_dispatched_total counter
outbox_events_dispatched_total{consumer="dashboard",outcome="delivered",project="alpha"} 2
outbox_events_dispatched_total{consumer="dashboard",outcome="failed",project="beta"} 1
outbox_consumer_lag_events{consumer="dashboard",project="alpha"} 0
outbox_lease_acquisitions_total{consumer="dashboard",project="alpha"} 2
`
	lines, err := metricsExcerpt(strings.NewReader(body), "dashboard", r.perProject)
	require.NoError(t, err)
	require.Equal(t, []string{
		`outbox_events_dispatched_total{consumer="dashboard",outcome="delivered",project="alpha"} 2   (this process; dashboard applied 3 in alpha over all its processes)`,
		`outbox_events_dispatched_total{consumer="dashboard",outcome="failed",project="beta"} 1   (this process)`,
		`outbox_consumer_lag_events{consumer="dashboard",project="alpha"} 0`,
	}, lines)
}

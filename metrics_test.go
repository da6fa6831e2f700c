package outbox_test

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testhost"
	"fusion/outbox/internal/testkit"
)

// metricsConsumer builds, in a process of its own, a consumer that reports to m. Its
// recorder can be told to fail.
func metricsConsumer(t *testing.T, url string, id outbox.ConsumerID, cfg outbox.Config, m *outbox.Metrics) (*outbox.Consumer, *testkit.Recorder) {
	t.Helper()
	pool := pgtest.Pool(t, url)
	store := testhost.New(pool, testhost.Options{})
	require.NoError(t, store.LoadCache(testkit.Ctx(t), "p"))
	rec := testkit.NewRecorder()
	d := outbox.NewDispatcher(outbox.DispatcherOptions{Listeners: []outbox.Listener{rec}, Cache: store.Cache(),
		NoLocalWriter: true, Logger: zaptest.NewLogger(t)})
	c, err := outbox.NewConsumer(outbox.ConsumerOptions{ID: id, Pool: pool, Config: cfg, Projects: outbox.StaticProjects{"p"},
		Dispatcher: d, LiveTasks: store, Cache: store.Cache(), Metrics: m, Logger: zaptest.NewLogger(t)})
	require.NoError(t, err)
	return c, rec
}

// metricsConfig is testkit.FastConfig with a lease long enough that a slow machine never loses
// one, which would add lease acquisitions to the counts below.
func metricsConfig() outbox.Config {
	cfg := testkit.FastConfig()
	cfg.LeaseTTL = 30 * time.Second
	return cfg
}

func stopConsumer(t *testing.T, c *outbox.Consumer) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), testkit.WaitLimit)
	defer cancel()
	require.NoError(t, c.Stop(ctx))
}

// scrape gathers reg as Prometheus would, keyed by metric name.
func scrape(t *testing.T, reg *prometheus.Registry) map[string]*dto.MetricFamily {
	t.Helper()
	fams, err := reg.Gather()
	require.NoError(t, err, "every collector answers")
	out := make(map[string]*dto.MetricFamily, len(fams))
	for _, f := range fams {
		out[f.GetName()] = f
	}
	return out
}

// sample finds the series of name with exactly these labels: a counter's or gauge's value, a
// histogram's sample count. ok is false when there is no such series.
func sample(fams map[string]*dto.MetricFamily, name string, labels ...string) (v float64, ok bool) {
	want := map[string]string{}
	for i := 0; i+1 < len(labels); i += 2 {
		want[labels[i]] = labels[i+1]
	}
	f := fams[name]
	if f == nil {
		return 0, false
	}
	for _, m := range f.GetMetric() {
		got := map[string]string{}
		for _, l := range m.GetLabel() {
			got[l.GetName()] = l.GetValue()
		}
		if !maps.Equal(got, want) {
			continue
		}
		switch {
		case m.Counter != nil:
			return m.GetCounter().GetValue(), true
		case m.Gauge != nil:
			return m.GetGauge().GetValue(), true
		case m.Histogram != nil:
			return float64(m.GetHistogram().GetSampleCount()), true
		}
	}
	return 0, false
}

func requireSample(t *testing.T, fams map[string]*dto.MetricFamily, want float64, name string, labels ...string) {
	t.Helper()
	v, ok := sample(fams, name, labels...)
	require.True(t, ok, "no series %s%v", name, labels)
	require.Equal(t, want, v, "%s%v", name, labels)
}

// TestMetricsReportLagDeadLettersAndCounters scripts a scenario and checks what a scrape says:
// five deletions in project p; "laggard" reads two and stops; "engine" (MaxAttempts 1) parks
// the second event as a dead letter and delivers the rest; then an operator replays it.
func TestMetricsReportLagDeadLettersAndCounters(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	reg := prometheus.NewRegistry()
	m, err := outbox.NewMetrics(reg)
	require.NoError(t, err)

	w := testkit.StartProcess(t, db.URL, testkit.ProcessOpts{Projects: []string{"p"}, Config: testkit.FastConfig()})
	_, err = w.Store.CreateMany(ctx, "p", "t", 5)
	require.NoError(t, err)
	deleteTasks := func(ids ...int) {
		for _, i := range ids {
			_, err := w.Store.Delete(ctx, "p", fmt.Sprintf("t-%d", i))
			require.NoError(t, err)
		}
	}

	deleteTasks(1, 2)
	laggard, _ := metricsConsumer(t, db.URL, "laggard", metricsConfig(), m)
	require.NoError(t, laggard.Start(ctx))
	testkit.WaitCursor(t, ctx, w.Pool, "p", "laggard", 2)
	stopConsumer(t, laggard)

	deleteTasks(3, 4, 5)
	cfg := metricsConfig()
	cfg.MaxAttempts = 1
	engine, rec := metricsConsumer(t, db.URL, "engine", cfg, m)
	broken := func(ev outbox.ObservedEvent) error {
		if ev.Sequence == 2 {
			return testkit.ErrListener // its text must reach no label
		}
		return nil
	}
	rec.SetFail(broken)
	require.NoError(t, engine.Start(ctx))
	t.Cleanup(func() { stopConsumer(t, engine) })
	testkit.WaitCursor(t, ctx, w.Pool, "p", "engine", 5)
	// The oldest event laggard has not read becomes ten minutes old.
	tag, err := w.Pool.Exec(ctx, `UPDATE lifecycle_event_log e SET occurred_at = e.occurred_at - interval '10 minutes'
		FROM lifecycle_outbox_read('p', 2, 1, NULL, NULL, NULL) r
		WHERE e.project_id = 'p' AND e.task_id = r.task_id AND e.deleted_at = r.deleted_at`)
	require.NoError(t, err)
	require.Equal(t, int64(1), tag.RowsAffected(), "the event at sequence 3")

	fams := scrape(t, reg)
	pe := []string{"project", "p", "consumer", "engine"}
	pl := []string{"project", "p", "consumer", "laggard"}
	with := func(base []string, kv ...string) []string { return append(slices.Clone(base), kv...) }

	// Gauges, read from the database at scrape time.
	requireSample(t, fams, 3, "outbox_consumer_lag_events", pl...)
	requireSample(t, fams, 0, "outbox_consumer_lag_events", pe...)
	lag, ok := sample(fams, "outbox_consumer_lag_seconds", pl...)
	require.True(t, ok)
	require.GreaterOrEqual(t, lag, (10 * time.Minute).Seconds(), "the age of the oldest unacknowledged event")
	require.Less(t, lag, (12 * time.Minute).Seconds())
	requireSample(t, fams, 0, "outbox_consumer_lag_seconds", pe...)
	requireSample(t, fams, 1, "outbox_dead_letters_outstanding", pe...)
	requireSample(t, fams, 0, "outbox_dead_letters_outstanding", pl...)
	requireSample(t, fams, 0, "outbox_deliveries_retrying", pe...)

	// Counters, by outcome and failure class.
	requireSample(t, fams, 4, "outbox_events_dispatched_total", with(pe, "outcome", "delivered")...)
	requireSample(t, fams, 1, "outbox_events_dispatched_total", with(pe, "outcome", "failed")...)
	requireSample(t, fams, 2, "outbox_events_dispatched_total", with(pl, "outcome", "delivered")...)
	requireSample(t, fams, 1, "outbox_dead_letters_parked_total", pe...)
	_, ok = sample(fams, "outbox_dead_letters_parked_total", pl...)
	require.False(t, ok, "laggard parked nothing")
	requireSample(t, fams, 1, "outbox_delivery_failures_total", with(pe, "class", string(outbox.FailureListenerError))...)
	require.Len(t, fams["outbox_delivery_failures_total"].GetMetric(), 1, "one failure, one class")
	requireSample(t, fams, 1, "outbox_lease_acquisitions_total", pe...)
	requireSample(t, fams, 1, "outbox_lease_acquisitions_total", pl...)
	requireSample(t, fams, 5, "outbox_dispatch_duration_seconds", "consumer", "engine")
	requireSample(t, fams, 2, "outbox_dispatch_duration_seconds", "consumer", "laggard")

	// Labels stay bounded: identifiers of projects and consumers and fixed codes, never an
	// event ID (nor error text).
	rows, err := w.Pool.Query(ctx, `SELECT lifecycle_event_id(task_id, deleted_at) FROM lifecycle_outbox_read('p', 0, 100, NULL, NULL, NULL)`)
	require.NoError(t, err)
	eventIDs := map[string]bool{}
	for rows.Next() {
		var id string
		require.NoError(t, rows.Scan(&id))
		eventIDs[id] = true
	}
	require.NoError(t, rows.Err())
	require.Len(t, eventIDs, 5)
	allowed := []string{"project", "consumer", "outcome", "class", "reason"}
	for name, f := range fams {
		for _, series := range f.GetMetric() {
			for _, l := range series.GetLabel() {
				require.Contains(t, allowed, l.GetName(), "%s has an unexpected label", name)
				require.False(t, eventIDs[l.GetValue()], "%s carries event ID %q in label %s", name, l.GetValue(), l.GetName())
				require.False(t, strings.HasPrefix(l.GetValue(), "task-deleted:"), "%s label %s", name, l.GetName())
				require.NotContains(t, l.GetValue(), "secret", "%s label %s carries error text", name, l.GetName())
			}
		}
	}

	// After a fix, the replayed dead letter leaves the outstanding gauge and counts as replayed.
	rec.SetFail(nil)
	_, err = outbox.NewAdmin(w.Pool, outbox.AdminOptions{}).RequestReplay(ctx, outbox.ReplayRequest{ProjectID: "p", ConsumerID: "engine",
		Sequence: 2, Operator: outbox.Operator{Actor: "oncall", Reason: "FN-1"}})
	require.NoError(t, err)
	deadline, cancel := context.WithTimeout(ctx, testkit.WaitLimit)
	defer cancel()
	for testkit.DeliveryOf(t, w.Pool, "engine", 2).State != "resolved" {
		select {
		case <-deadline.Done():
			t.Fatalf("the replay was never resolved: %v", deadline.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
	fams = scrape(t, reg)
	requireSample(t, fams, 0, "outbox_dead_letters_outstanding", pe...)
	requireSample(t, fams, 1, "outbox_dead_letters_replayed_total", pe...)
	requireSample(t, fams, 1, "outbox_dead_letters_parked_total", pe...)
	requireSample(t, fams, 3, "outbox_consumer_lag_events", pl...)
}

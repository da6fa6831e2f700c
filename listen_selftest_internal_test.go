package outbox

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// TestWakeupStateMachine: the self-test's bound passing makes the consumer poll alone and warn
// once; a notification arriving afterwards (a slow database rather than a proxy) makes the
// wake-ups count as working again; a bound passing after a notification changes nothing.
func TestWakeupStateMachine(t *testing.T) {
	t.Parallel()
	core, logs := observer.New(zap.InfoLevel)
	m, err := NewMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	w := &waker{id: "c", cfg: Config{ListenCheckTimeout: time.Second}.WithDefaults().consumerConfig(), log: zap.New(core), metrics: m}
	c := &Consumer{cfg: w.cfg, waker: w}
	w.check.run, w.check.token = 1, selfTestPrefix+"abc"
	gauge := func() float64 {
		var d dto.Metric
		if err := m.listenWakeups.WithLabelValues("c").Write(&d); err != nil {
			t.Fatal(err)
		}
		return d.GetGauge().GetValue()
	}

	if got := c.Wakeups(); got != WakeupsUnchecked {
		t.Fatalf("before the self-test: %s", got)
	}
	w.selfTestTimedOut(1)
	w.check.run++
	w.selfTestTimedOut(0) // an earlier run's bound: nothing
	w.selfTestTimedOut(2) // a second connection's bound: no second warning
	if got := c.Wakeups(); got != WakeupsPollingOnly || gauge() != 0 {
		t.Fatalf("after the bound: %s, gauge %v", got, gauge())
	}
	if n := logs.FilterMessageSnippet("LISTEN wake-ups do not arrive").Len(); n != 1 {
		t.Fatalf("warned %d times", n)
	}
	if ours := w.heard("alpha"); ours {
		t.Fatal("a project's notification is not the self-test's")
	}
	if got := c.Wakeups(); got != WakeupsWorking || gauge() != 1 {
		t.Fatalf("after a late notification: %s, gauge %v", got, gauge())
	}
	if logs.FilterMessageSnippet("arrive after all").Len() != 1 {
		t.Fatal("the recovery is not logged")
	}
	w.selfTestTimedOut(2)
	if !w.heard(selfTestPrefix+"abc") || c.Wakeups() != WakeupsWorking {
		t.Fatalf("a bound after a notification must not undo it: %s", c.Wakeups())
	}
}

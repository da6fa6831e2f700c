package outbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Metrics are the module's Prometheus measurements. Build them with NewMetrics only when the
// host provides a registerer; a nil *Metrics records nothing. Labels are project and consumer
// IDs (and small fixed sets such as the failure class), never event IDs, so the series count
// stays bounded by the projects a process observes.
type Metrics struct {
	dispatched        *prometheus.CounterVec
	duration          *prometheus.HistogramVec
	failures          *prometheus.CounterVec
	parkedTotal       *prometheus.CounterVec
	replayedTotal     *prometheus.CounterVec
	leaseAcquisitions *prometheus.CounterVec
	leaseLosses       *prometheus.CounterVec
	reconciliations   *prometheus.CounterVec
	prunedRows        *prometheus.CounterVec
	prunedDead        prometheus.Counter
	listenReconnects  *prometheus.CounterVec
	listenWakeups     *prometheus.GaugeVec
	projectErrors     *prometheus.CounterVec
	ticks             prometheus.Counter
	tickedEvents      prometheus.Counter
	ticksHeld         prometheus.Counter
	streamHoles       *prometheus.CounterVec
	readFallbacks     *prometheus.CounterVec
	readReturns       *prometheus.CounterVec
	readConflicts     *prometheus.CounterVec
	readLagTicks      *prometheus.GaugeVec
	readLagSeconds    *prometheus.GaugeVec
	status            *statusCollector
}

// NewMetrics creates the module's metrics and registers them with reg.
func NewMetrics(reg prometheus.Registerer) (*Metrics, error) {
	pc := []string{"project", "consumer"}
	m := &Metrics{
		dispatched: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "outbox_events_dispatched_total",
			Help: "Events handled by a consumer, by outcome (delivered, own, failed)."}, append(pc, "outcome")),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "outbox_dispatch_duration_seconds",
			Help:    "Time to dispatch one event to the cache and the observed listeners.",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 5, 30}}, []string{"consumer"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "outbox_delivery_failures_total",
			Help: "Failed delivery attempts, by failure class."}, append(pc, "class")),
		parkedTotal: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "outbox_dead_letters_parked_total",
			Help: "Events parked as dead letters after their last attempt."}, pc),
		replayedTotal: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "outbox_dead_letters_replayed_total",
			Help: "Dead letters replayed successfully."}, pc),
		leaseAcquisitions: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "outbox_lease_acquisitions_total",
			Help: "Leases acquired."}, pc),
		leaseLosses: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "outbox_lease_losses_total",
			Help: "Leases lost (expired or taken over) while held."}, pc),
		reconciliations: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "outbox_reconciliations_total",
			Help: "Full reconciliations, by reason."}, append(pc, "reason")),
		prunedRows: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "outbox_pruned_rows_total",
			Help: "Outbox rows pruned by retention."}, []string{"project"}),
		prunedDead: prometheus.NewCounter(prometheus.CounterOpts{Name: "outbox_pruned_dead_letters_total",
			Help: "Resolved dead letters pruned by retention."}),
		listenReconnects: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "outbox_listen_reconnects_total",
			Help: "Times the LISTEN connection was lost and re-opened."}, []string{"consumer"}),
		projectErrors: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "outbox_project_errors_total",
			Help: "Scans in which a step failed for one project, which was skipped while the others went on, by step."}, append(pc, "step")),
		ticks: prometheus.NewCounter(prometheus.CounterOpts{Name: "outbox_ticks_total",
			Help: "Ticks this process took (as the elected ticker, or as a fallback)."}),
		tickedEvents: prometheus.NewCounter(prometheus.CounterOpts{Name: "outbox_ticked_events_total",
			Help: "Events numbered by this process's ticks."}),
		ticksHeld: prometheus.NewCounter(prometheus.CounterOpts{Name: "outbox_ticks_held_total",
			Help: "Ticks this process's elected ticker held back while its own consumer was still busy (TickBusyWait)."}),
		streamHoles: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "outbox_stream_holes_total",
			Help: "Events counted by their tick but no longer stored, found by a consumer (each reconciled its project)."}, pc),
		readFallbacks: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "outbox_read_fallbacks_total",
			Help: "Times a consumer with a read standby (ReadDSN) read from the primary instead, by reason (lag: behind by ReadMaxLag; unreachable)."}, []string{"consumer", "reason"}),
		readReturns: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "outbox_read_returns_total",
			Help: "Times a consumer went back to its read standby once it had caught up."}, []string{"consumer"}),
		readConflicts: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "outbox_read_recovery_conflicts_total",
			Help: "Reads on the standby cancelled by a conflict with recovery (retried)."}, []string{"consumer"}),
		readLagTicks: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "outbox_read_standby_lag_ticks",
			Help: "Ticks the primary had that the consumer's read standby had not replayed, when last compared."}, []string{"consumer"}),
		readLagSeconds: prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "outbox_read_standby_lag_seconds",
			Help: "The primary's newest tick time minus the read standby's, when last compared (0 when caught up)."}, []string{"consumer"}),
		status: &statusCollector{},
	}
	m.listenWakeups = newListenWakeupsGauge() // listen_selftest.go
	m.status.lagEvents = prometheus.NewDesc("outbox_consumer_lag_events",
		"Committed, sequenced events the consumer has not acknowledged.", pc, nil)
	m.status.lagSeconds = prometheus.NewDesc("outbox_consumer_lag_seconds",
		"Age of the oldest event the consumer has not acknowledged (0 when caught up).", pc, nil)
	m.status.deadOutstanding = prometheus.NewDesc("outbox_dead_letters_outstanding",
		"Dead letters not yet resolved (dead or awaiting replay).", pc, nil)
	m.status.retrying = prometheus.NewDesc("outbox_deliveries_retrying",
		"Events waiting for their next attempt.", pc, nil)
	m.status.errors = prometheus.NewCounter(prometheus.CounterOpts{Name: "outbox_status_errors_total",
		Help: "Projects whose lag and dead-letter gauges could not be read from the database at a scrape (each left out of that scrape)."})
	for _, c := range []prometheus.Collector{m.dispatched, m.duration, m.failures, m.parkedTotal, m.replayedTotal,
		m.leaseAcquisitions, m.leaseLosses, m.reconciliations, m.prunedRows, m.prunedDead, m.listenReconnects,
		m.listenWakeups, m.projectErrors, m.ticks, m.tickedEvents, m.ticksHeld, m.streamHoles, m.readFallbacks, m.readReturns,
		m.readConflicts, m.readLagTicks, m.readLagSeconds, m.status} {
		if err := reg.Register(c); err != nil {
			return nil, fmt.Errorf("register outbox metrics: %w", err)
		}
	}
	return m, nil
}

func outcomeLabel(o Outcome) string {
	switch o {
	case Delivered:
		return "delivered"
	case Own:
		return "own"
	case Failed:
		return "failed"
	default:
		return "interrupted"
	}
}

func (m *Metrics) observeDispatch(project, consumer string, o Outcome, d time.Duration) {
	if m == nil {
		return
	}
	m.dispatched.WithLabelValues(project, consumer, outcomeLabel(o)).Inc()
	m.duration.WithLabelValues(consumer).Observe(d.Seconds())
}

func (m *Metrics) failure(project, consumer string, class FailureClass) {
	if m != nil {
		m.failures.WithLabelValues(project, consumer, string(class)).Inc()
	}
}

func (m *Metrics) parked(project, consumer string) {
	if m != nil {
		m.parkedTotal.WithLabelValues(project, consumer).Inc()
	}
}

func (m *Metrics) replayed(project, consumer string) {
	if m != nil {
		m.replayedTotal.WithLabelValues(project, consumer).Inc()
	}
}

func (m *Metrics) leaseAcquired(project, consumer string) {
	if m != nil {
		m.leaseAcquisitions.WithLabelValues(project, consumer).Inc()
	}
}

func (m *Metrics) leaseLost(project, consumer string) {
	if m != nil {
		m.leaseLosses.WithLabelValues(project, consumer).Inc()
	}
}

func (m *Metrics) reconciled(project, consumer, reason string) {
	if m != nil {
		m.reconciliations.WithLabelValues(project, consumer, reason).Inc()
	}
}

func (m *Metrics) ticked(ticks int, events int64) {
	if m != nil {
		m.ticks.Add(float64(ticks))
		m.tickedEvents.Add(float64(events))
	}
}

func (m *Metrics) tickHeld() {
	if m != nil {
		m.ticksHeld.Inc()
	}
}

func (m *Metrics) streamHole(project, consumer string) {
	if m != nil {
		m.streamHoles.WithLabelValues(project, consumer).Inc()
	}
}

func (m *Metrics) pruned(project string, rows int64) {
	if m != nil && rows > 0 {
		m.prunedRows.WithLabelValues(project).Add(float64(rows))
	}
}

func (m *Metrics) prunedDeadLetters(n int64) {
	if m != nil && n > 0 {
		m.prunedDead.Add(float64(n))
	}
}

func (m *Metrics) projectError(project, consumer, step string) {
	if m != nil {
		m.projectErrors.WithLabelValues(project, consumer, step).Inc()
	}
}

func (m *Metrics) listenReconnect(consumer string) {
	if m != nil {
		m.listenReconnects.WithLabelValues(consumer).Inc()
	}
}

// statusSource is what the status gauges read through: the database, and the project set a
// consumer observes. It holds no consumer state: the gauges are whatever the database says.
type statusSource struct {
	db       DBTX
	projects func(context.Context) ([]string, error)
	clock    Clock
	log      *zap.Logger
}

// watch makes the status gauges cover the projects of src; unwatch stops it.
func (m *Metrics) watch(src *statusSource) {
	if m != nil {
		m.status.add(src)
	}
}

func (m *Metrics) unwatch(src *statusSource) {
	if m != nil {
		m.status.remove(src)
	}
}

// statusCollector reads lag and dead-letter counts from the database at scrape time, so the
// gauges are exact whenever they are read and cost nothing between scrapes. It reports every
// consumer of the projects its process observes, not only the process's own: the lag of a
// consumer whose process is down is what an operator most needs to see, and only a live
// process can show it. Several processes observing one project report the same series; alert
// on max by (project, consumer). A read that fails is repeated project by project; each
// project that still fails is left out of that scrape and counted in
// outbox_status_errors_total, so one project's broken rows never blind the others' alerts, and
// the rest of the /metrics page is served.
type statusCollector struct {
	lagEvents, lagSeconds, deadOutstanding, retrying *prometheus.Desc
	errors                                           prometheus.Counter

	mu      sync.Mutex
	sources []*statusSource
}

func (s *statusCollector) add(src *statusSource) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sources = append(s.sources, src)
}

func (s *statusCollector) remove(src *statusSource) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sources = slices.DeleteFunc(s.sources, func(x *statusSource) bool { return x == src })
}

func (s *statusCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- s.lagEvents
	ch <- s.lagSeconds
	ch <- s.deadOutstanding
	ch <- s.retrying
	s.errors.Describe(ch)
}

func (s *statusCollector) Collect(ch chan<- prometheus.Metric) {
	defer s.errors.Collect(ch)
	s.mu.Lock()
	sources := slices.Clone(s.sources)
	s.mu.Unlock()
	if len(sources) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var projects []string
	for _, src := range sources {
		ps, err := src.projects(ctx)
		if err != nil {
			s.errors.Inc()
			continue
		}
		projects = append(projects, ps...)
	}
	slices.Sort(projects)
	projects = slices.Compact(projects)
	c := sources[0]
	rows, err := projectsStatus(ctx, c.db, c.clock, projects)
	var pe *ProjectErrors
	switch {
	case errors.As(err, &pe):
		for _, p := range pe.Projects() {
			s.errors.Inc()
			c.log.Warn("status of one project could not be read; its gauges are left out of this scrape",
				zap.String("project_id", p), zap.Error(pe.Failed[p]))
		}
	case err != nil:
		s.errors.Add(float64(len(projects)))
		c.log.Warn("status could not be read; the gauges are left out of this scrape", zap.Error(err))
		return
	}
	for _, r := range rows {
		lv := []string{r.ProjectID, r.ConsumerID}
		ch <- prometheus.MustNewConstMetric(s.lagEvents, prometheus.GaugeValue, float64(r.LagEvents), lv...)
		ch <- prometheus.MustNewConstMetric(s.lagSeconds, prometheus.GaugeValue, r.LagSeconds, lv...)
		ch <- prometheus.MustNewConstMetric(s.deadOutstanding, prometheus.GaugeValue, float64(r.Dead+r.ReplayRequested), lv...)
		ch <- prometheus.MustNewConstMetric(s.retrying, prometheus.GaugeValue, float64(r.Retrying), lv...)
	}
}

func (m *Metrics) readFallback(consumer, reason string) {
	if m != nil {
		m.readFallbacks.WithLabelValues(consumer, reason).Inc()
	}
}

func (m *Metrics) readReturn(consumer string) {
	if m != nil {
		m.readReturns.WithLabelValues(consumer).Inc()
	}
}

func (m *Metrics) readConflict(consumer string) {
	if m != nil {
		m.readConflicts.WithLabelValues(consumer).Inc()
	}
}

func (m *Metrics) readLag(consumer string, ticks int64, lag time.Duration) {
	if m != nil {
		m.readLagTicks.WithLabelValues(consumer).Set(float64(ticks))
		m.readLagSeconds.WithLabelValues(consumer).Set(lag.Seconds())
	}
}

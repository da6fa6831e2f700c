package taskstore

import (
	"context"
	"sync"
	"time"

	"go.uber.org/zap"

	"fusion/outbox"
)

// SelfHealing is the store's maintenance sweep: it runs every registered task when the store
// opens and then on a schedule, and logs what each did. The outbox module contributes its
// retention task here; the store could add its own.
type SelfHealing struct {
	tasks    []outbox.MaintenanceTask
	interval time.Duration
	log      *zap.Logger

	mu      sync.Mutex
	cancel  context.CancelFunc
	done    chan struct{}
	results []SweepResult
}

// SweepResult is one task's outcome in one sweep.
type SweepResult struct {
	Task    string
	Summary string
	Err     error
	Elapsed time.Duration
}

// NewSelfHealing returns a manager for tasks, sweeping every interval (default 10m).
func NewSelfHealing(tasks []outbox.MaintenanceTask, interval time.Duration, log *zap.Logger) *SelfHealing {
	if interval <= 0 {
		interval = 10 * time.Minute
	}
	if log == nil {
		log = zap.NewNop()
	}
	return &SelfHealing{tasks: tasks, interval: interval, log: log.Named("selfheal")}
}

// RunOnce runs every task once, in registration order, and returns their results.
func (m *SelfHealing) RunOnce(ctx context.Context) []SweepResult {
	out := make([]SweepResult, 0, len(m.tasks))
	for _, t := range m.tasks {
		started := time.Now()
		summary, err := t.Run(ctx)
		r := SweepResult{Task: t.Name, Err: err, Elapsed: time.Since(started)}
		if summary != nil {
			r.Summary = summary.String()
		}
		if err != nil {
			m.log.Warn("maintenance task failed", zap.String("task", t.Name), zap.Duration("elapsed", r.Elapsed), zap.Error(err))
		} else {
			m.log.Info("maintenance task done", zap.String("task", t.Name), zap.Duration("elapsed", r.Elapsed), zap.String("result", r.Summary))
		}
		out = append(out, r)
	}
	m.mu.Lock()
	m.results = out
	m.mu.Unlock()
	return out
}

// LastResults returns the results of the latest sweep.
func (m *SelfHealing) LastResults() []SweepResult {
	m.mu.Lock()
	defer m.mu.Unlock()
	return append([]SweepResult(nil), m.results...)
}

// Start runs a sweep now (the store-open sweep) and then every interval until Stop.
func (m *SelfHealing) Start(ctx context.Context) {
	m.RunOnce(ctx)
	runCtx, cancel := context.WithCancel(context.Background())
	m.mu.Lock()
	m.cancel, m.done = cancel, make(chan struct{})
	done := m.done
	m.mu.Unlock()
	go func() {
		defer close(done)
		t := time.NewTicker(m.interval)
		defer t.Stop()
		for {
			select {
			case <-runCtx.Done():
				return
			case <-t.C:
				m.RunOnce(runCtx)
			}
		}
	}()
}

// Stop ends the schedule and waits for a sweep in progress, bounded by ctx.
func (m *SelfHealing) Stop(ctx context.Context) error {
	m.mu.Lock()
	cancel, done := m.cancel, m.done
	m.mu.Unlock()
	if cancel == nil {
		return nil
	}
	cancel()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

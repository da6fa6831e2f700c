package taskstore

import (
	"context"
	"fmt"
	"sync"
	"time"

	"go.uber.org/zap"

	"fusion/outbox"
	"fusion/outbox/startstop"
)

// SelfHealing is the store's maintenance sweep: it runs every registered task when the store
// opens and then on a schedule, and logs what each did. The outbox module contributes its
// retention task here; the store could add its own.
type SelfHealing struct {
	tasks    []outbox.MaintenanceTask
	interval time.Duration
	log      *zap.Logger

	// lifecycle is the module's own start/stop base: Start after Stop refuses, Stop is
	// idempotent and bounded by its context.
	lifecycle startstop.Base

	mu      sync.Mutex
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

// Start runs a sweep now (the store-open sweep, bounded by ctx) and then every interval until
// Stop. After Stop it refuses with startstop.ErrStopped.
func (m *SelfHealing) Start(ctx context.Context) error {
	run, err := m.lifecycle.Begin()
	if err != nil {
		return fmt.Errorf("start self-healing: %w", err)
	}
	startCtx, release := run.StartContext(ctx)
	m.RunOnce(startCtx)
	release()
	go func() {
		defer run.Finished()
		t := time.NewTicker(m.interval)
		defer t.Stop()
		for {
			select {
			case <-run.Ctx.Done():
				return
			case <-t.C:
				m.RunOnce(run.Ctx)
			}
		}
	}()
	return nil
}

// Stop ends the schedule and waits for a sweep in progress, bounded by ctx. It is idempotent
// and safe before Start.
func (m *SelfHealing) Stop(ctx context.Context) error {
	if err := m.lifecycle.Stop(ctx); err != nil {
		return fmt.Errorf("stop self-healing: %w", err)
	}
	return nil
}

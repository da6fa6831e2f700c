package testhost

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"

	"go.uber.org/fx"
	"go.uber.org/zap"

	"fusion/outbox"
	"fusion/outbox/web"
)

// The observer process shared by the demo and the fault suite: the module and the test host,
// with an apply log as the observed listener. Each caller keeps its own command line, start-up
// retries and progress lines; what an observer does with an event, and the log it leaves for
// the checks that follow, is one thing.

// ApplyOptions configure an ApplyLog.
type ApplyOptions struct {
	// Path of the append-only log; an existing log is read first, so a restarted observer
	// counts a re-delivery of what it applied before as a duplicate.
	Path string
	// Failing are task IDs whose events always fail (to be parked as dead letters).
	Failing []string
	// Poison is a "project/task" whose event fails until the file Fixed exists (a listener
	// fixed by an operator, after which a replay succeeds).
	Poison, Fixed string
	// Progress prints "applied N" every 100 first applications.
	Progress bool
}

// ApplyRecord is one line of the log: kind is applied, duplicate, fence-refused or
// fence-violated (the observer's try at a writer-owned side effect, which must be refused),
// or reset (a child worker was told to refetch Project: the stream could not tell it
// everything; the project's next event starts afresh).
type ApplyRecord struct {
	Kind     string `json:"kind"`
	EventID  string `json:"eventId"`
	Project  string `json:"project"`
	Sequence int64  `json:"sequence"`
	Replay   bool   `json:"replay,omitempty"`
}

// ApplyLog is the observer's idempotent listener: it applies each deletion once and records
// it in a file that survives SIGKILL (one unbuffered write per line).
type ApplyLog struct {
	opts    ApplyOptions
	failing map[string]bool
	store   *Store // set by ObserverApp before anything starts

	mu      sync.Mutex
	f       *os.File
	seen    map[string]bool
	applied int
}

// OpenApplyLog opens (or continues) the log at o.Path.
func OpenApplyLog(o ApplyOptions) (*ApplyLog, error) {
	l := &ApplyLog{opts: o, failing: map[string]bool{}, seen: map[string]bool{}}
	for _, t := range o.Failing {
		l.failing[t] = true
	}
	if f, err := os.Open(o.Path); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			var r ApplyRecord
			if json.Unmarshal(sc.Bytes(), &r) == nil && r.Kind == "applied" {
				l.seen[r.EventID] = true
				l.applied++
			}
		}
		_ = f.Close()
	}
	f, err := os.OpenFile(o.Path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open apply log: %w", err)
	}
	l.f = f
	return l, nil
}

// UseStore gives the log the store whose writer-owned side effects it tries (and the fence
// must refuse); ObserverApp and RunWorker set it themselves.
func (l *ApplyLog) UseStore(s *Store) { l.store = s }

// Close closes the log file.
func (l *ApplyLog) Close() error { return l.f.Close() }

// Name implements outbox.Listener.
func (l *ApplyLog) Name() string { return "apply-log" }

var (
	errChosenFailure = errors.New("chosen to fail")
	errPoison        = errors.New("this listener cannot handle the event yet")
)

// HandleObserved implements outbox.Listener.
func (l *ApplyLog) HandleObserved(ctx context.Context, ev outbox.ObservedEvent) error {
	if l.failing[ev.TaskID] {
		return errChosenFailure
	}
	if l.opts.Poison != "" && l.opts.Poison == ev.ProjectID+"/"+ev.TaskID {
		if _, err := os.Stat(l.opts.Fixed); err != nil {
			return errPoison
		}
	}
	// An observer must never be able to perform the writer's side effects.
	fence := "fence-refused"
	if err := l.store.SendDeleteNotice(ctx, Task{ProjectID: ev.ProjectID, ID: ev.TaskID}); !errors.Is(err, outbox.ErrObservedContext) {
		fence = "fence-violated"
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	kind := "applied"
	if l.seen[ev.EventID] {
		kind = "duplicate"
	}
	for _, k := range []string{fence, kind} {
		b, _ := json.Marshal(ApplyRecord{Kind: k, EventID: ev.EventID, Project: ev.ProjectID, Sequence: ev.Sequence, Replay: ev.Replay})
		if _, err := l.f.Write(append(b, '\n')); err != nil {
			return fmt.Errorf("append apply log: %w", err)
		}
	}
	if kind == "applied" {
		l.seen[ev.EventID] = true
		if l.applied++; l.opts.Progress && l.applied%100 == 0 {
			fmt.Printf("applied %d\n", l.applied)
		}
	}
	return nil
}

// HandleReset implements web.StreamHandler for a child worker: it records the reset of
// each project, after which the worker would refetch the project's state.
func (l *ApplyLog) HandleReset(_ context.Context, r web.SSEReset) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, p := range r.Projects {
		b, _ := json.Marshal(ApplyRecord{Kind: "reset", Project: p})
		if _, err := l.f.Write(append(b, '\n')); err != nil {
			return fmt.Errorf("append apply log: %w", err)
		}
	}
	return nil
}

// ObserverApp is the observer process's fx app: the module, the test host and al as the
// observed listener. The listener gets the store before anything starts, since the consumer
// may deliver at once.
func ObserverApp(host HostConfig, log *zap.Logger, al *ApplyLog, opts ...fx.Option) *fx.App {
	return fx.New(append([]fx.Option{
		outbox.Module, Module, fx.Supply(host, log),
		fx.Provide(outbox.AsListener(func(s *Store) outbox.Listener { al.store = s; return al })),
		fx.NopLogger,
	}, opts...)...)
}

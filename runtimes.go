package outbox

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"sync"

	"go.uber.org/zap"
)

// Per-project runtimes: a host whose project manager starts and stops a runtime per project
// while the process runs registers each with ProjectRuntimes, which is both the consumer's
// Projects seam (the projects with a runtime are the projects observed) and an observed
// listener that hands each event to its project's runtime only.

// Runtime is one project's runtime inside a host: it gets that project's observed events. Like
// any listener it must be idempotent (delivery is at-least-once) and must not perform
// writer-owned side effects.
type Runtime interface {
	HandleObserved(ctx context.Context, ev ObservedEvent) error
}

var (
	// ErrNoRuntime is returned, wrapped with the project's ID, by ProjectRuntimes.HandleObserved
	// for an event whose project has no runtime (it was never added, or Remove has taken it
	// out), and by Remove for a project without one.
	ErrNoRuntime = errors.New("no runtime for the project")
	// ErrRuntimeExists is returned, wrapped with the project's ID, by ProjectRuntimes.Add for
	// a project that has a runtime already.
	ErrRuntimeExists = errors.New("the project has a runtime already")
)

// ProjectRuntimesOptions configure ProjectRuntimes.
type ProjectRuntimesOptions struct {
	// Logger defaults to a no-op logger.
	Logger *zap.Logger
}

// ProjectRuntimes routes observed events to per-project runtimes that come and go while the
// consumer runs. Give it to the module as its Projects seam and as one of its listeners
// (ProvideProjectRuntimes does both in an fx graph; without fx, put it in Deps.Projects and
// Deps.Listeners). New then gives it the Outbox's RefreshProjects, so that Add and Remove
// take effect at once rather than at the consumer's next heartbeat; with a Consumer built
// directly, call SetRefresher(consumer.RefreshProjects).
//
// Add makes a project observed: its events flow to the runtime from the consumer's durable
// cursor, those written before the Add included. Remove makes it unobserved and returns once
// the runtime is done: it is never called again, and the project's cursor is written through
// the last event it took and its lease released right after (a later Add resumes from there).
// An event crosses into no other project's runtime.
//
// An event of a project without a runtime (one Remove took out while the consumer was handing
// it over) gets an error naming the project, wrapping ErrNoRuntime. Remove drops the project
// from the consumer before it takes the runtime out, so by then the consumer no longer holds
// the project's lease: it records no failed attempt for the event, which is delivered again
// from the cursor when the project is observed again. Only a host whose Projects seam lists a
// project that has no runtime here (ProjectRuntimes is not its seam, or it wraps it) sees such
// an error count as a failed attempt.
type ProjectRuntimes struct {
	log *zap.Logger

	mu      sync.Mutex
	refresh func(context.Context) error
	entries map[string]*runtimeEntry
}

// runtimeEntry is one project's runtime and where it stands.
type runtimeEntry struct {
	rt       Runtime
	observed bool     // ObservedProjects lists the project
	routed   bool     // HandleObserved hands the project's events to rt
	inflight int      // HandleObserved calls inside rt now
	removal  *removal // the Remove under way, nil when none is
}

// removal is a Remove under way: done is closed when it is over, err says how it ended.
type removal struct {
	done chan struct{}
	err  error
}

// NewProjectRuntimes builds an empty set: no project is observed until a runtime is added.
func NewProjectRuntimes(opts ProjectRuntimesOptions) *ProjectRuntimes {
	if opts.Logger == nil {
		opts.Logger = zap.NewNop()
	}
	return &ProjectRuntimes{log: opts.Logger.Named("outbox.runtimes"), entries: map[string]*runtimeEntry{}}
}

// SetRefresher sets what Add and Remove call to have the consumer apply the new project set
// at once: normally Outbox.RefreshProjects (New sets it), or Consumer.RefreshProjects. Without
// one, the consumer applies a change at its next heartbeat, and Remove cannot tell when the
// consumer has dropped the project: set one before a consumer runs.
func (p *ProjectRuntimes) SetRefresher(refresh func(context.Context) error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refresh = refresh
}

// apply calls the refresher, if any.
func (p *ProjectRuntimes) apply(ctx context.Context) error {
	p.mu.Lock()
	refresh := p.refresh
	p.mu.Unlock()
	if refresh == nil {
		return nil
	}
	return refresh(ctx)
}

// Add gives project a runtime: the project is observed from now on, and the consumer is asked
// to take it at once, so that r gets the project's events from the consumer's durable cursor
// (those written before the Add included), in order. It refuses an invalid project ID
// (*ValidationError), a nil runtime and a project that has a runtime already
// (ErrRuntimeExists); while a Remove of the project is under way it waits for it (bounded by
// ctx) and then adds. An error from the refresh is returned wrapped, but the runtime stays
// added: the consumer takes the project at its next heartbeat (Remove takes it out).
func (p *ProjectRuntimes) Add(ctx context.Context, project string, r Runtime) error {
	if err := ValidateProjectID(project); err != nil {
		return &ValidationError{Field: "ProjectRuntimes.Add project", Reason: err.Error()}
	}
	if r == nil {
		return invalid("ProjectRuntimes.Add runtime", "is nil")
	}
	for {
		p.mu.Lock()
		e := p.entries[project]
		if e == nil {
			p.entries[project] = &runtimeEntry{rt: r, observed: true, routed: true}
			p.mu.Unlock()
			break
		}
		rm := e.removal
		p.mu.Unlock()
		if rm == nil {
			return fmt.Errorf("add runtime of project %s: %w", project, ErrRuntimeExists)
		}
		select { // the project's last runtime is being removed: add once it is gone
		case <-rm.done:
		case <-ctx.Done():
			return fmt.Errorf("add runtime of project %s: a removal of its runtime is under way: %w", project, ctx.Err())
		}
	}
	p.log.Info("project runtime added", zap.String("project_id", project))
	if err := p.apply(ctx); err != nil {
		return fmt.Errorf("runtime of project %s added, but the consumer did not take the project now (it will at its next heartbeat): %w", project, err)
	}
	return nil
}

// Remove takes project's runtime out. The project stops being observed and the consumer is
// asked to drop it at once; then no event reaches the runtime any more, and Remove waits,
// bounded by ctx, for the calls of the runtime still in flight. Once it has returned nil the
// runtime is never called again. The consumer writes the project's cursor through the last
// event the runtime took and releases the project's lease right after.
//
// When the consumer cannot drop the project (the refresh failed), the runtime stays, observed,
// and the error is returned: Remove may be tried again. When ctx ends while a call is still in
// flight, ctx's error is returned, and the runtime is nonetheless out: it gets nothing more,
// and a later Add of the project waits for that call. A Remove of a project without a runtime
// returns ErrNoRuntime; one while another Remove of the project is under way waits for it and
// returns its outcome.
func (p *ProjectRuntimes) Remove(ctx context.Context, project string) error {
	p.mu.Lock()
	e := p.entries[project]
	if e == nil {
		p.mu.Unlock()
		return fmt.Errorf("remove runtime of project %s: %w", project, ErrNoRuntime)
	}
	if rm := e.removal; rm != nil {
		p.mu.Unlock()
		return p.awaitRemoval(ctx, project, rm)
	}
	rm := &removal{done: make(chan struct{})}
	e.removal, e.observed = rm, false
	p.mu.Unlock()

	// The consumer first: once it has dropped the project, it hands none of its events over,
	// except one it may be handing over already, which still reaches the runtime below.
	if err := p.apply(ctx); err != nil {
		err = fmt.Errorf("remove runtime of project %s: the consumer did not drop the project: %w", project, err)
		p.mu.Lock()
		e.removal, e.observed = nil, true
		rm.err = err
		p.mu.Unlock()
		close(rm.done)
		return err
	}
	p.mu.Lock()
	e.routed = false
	if e.inflight == 0 {
		p.finish(project, e)
	}
	p.mu.Unlock()
	return p.awaitRemoval(ctx, project, rm)
}

// awaitRemoval waits for rm to be over, bounded by ctx.
func (p *ProjectRuntimes) awaitRemoval(ctx context.Context, project string, rm *removal) error {
	select {
	case <-rm.done:
		return rm.err
	case <-ctx.Done():
		return fmt.Errorf("remove runtime of project %s: it gets no more events, but a call of it is still in flight: %w", project, ctx.Err())
	}
}

// finish forgets a removed runtime whose last call returned and ends its removal. p.mu is held.
func (p *ProjectRuntimes) finish(project string, e *runtimeEntry) {
	if p.entries[project] == e {
		delete(p.entries, project)
	}
	close(e.removal.done)
	p.log.Info("project runtime removed", zap.String("project_id", project))
}

// ObservedProjects lists the projects with a runtime, sorted: ProjectRuntimes is the
// consumer's Projects seam.
func (p *ProjectRuntimes) ObservedProjects(context.Context) ([]string, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := make([]string, 0, len(p.entries))
	for project, e := range p.entries {
		if e.observed {
			out = append(out, project)
		}
	}
	sort.Strings(out)
	return out, nil
}

// Name identifies the listener in logs.
func (p *ProjectRuntimes) Name() string { return "project-runtimes" }

// HandleObserved hands ev to the runtime of ev.ProjectID, and to no other. For a project
// without a runtime it returns an error naming the project and wrapping ErrNoRuntime (see
// ProjectRuntimes for why the consumer then records no failed attempt).
func (p *ProjectRuntimes) HandleObserved(ctx context.Context, ev ObservedEvent) error {
	p.mu.Lock()
	e := p.entries[ev.ProjectID]
	if e == nil || !e.routed {
		p.mu.Unlock()
		return fmt.Errorf("event of project %s: %w", ev.ProjectID, ErrNoRuntime)
	}
	e.inflight++
	p.mu.Unlock()
	defer func() { // a panic too: the dispatcher recovers it
		p.mu.Lock()
		defer p.mu.Unlock()
		e.inflight--
		if e.inflight == 0 && !e.routed {
			p.finish(ev.ProjectID, e)
		}
	}()
	return e.rt.HandleObserved(ctx, ev)
}

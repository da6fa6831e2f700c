package outbox

import "context"

// Applying a change of the observed project set at once. The consumer asks its Projects seam
// at start and at every lease heartbeat; a host whose projects come and go at run time (see
// ProjectRuntimes) calls RefreshProjects after changing the set, so that the change does not
// wait for the next heartbeat.

// RefreshProjects has the consumer follow its Projects seam now instead of at the next
// heartbeat, and returns when it has: the projects no longer listed are dropped locally (no
// event of theirs is handed to a listener from then on, except the one being handed over
// already, if any; their cursors are written and their leases released right after), and the
// leases of the newly listed ones are taken (those another instance holds are tried again at
// each heartbeat) and their streams scanned from their durable cursors. It runs on the
// heartbeat's goroutine, never beside a heartbeat round, and returns the error of the step that
// failed, or ctx's when ctx ends first. When the consumer is not running (not started, failed
// to start, stopping or stopped) it returns nil: a start reads the seam anyway.
func (c *Consumer) RefreshProjects(ctx context.Context) error {
	done := c.lifecycle.Done()
	if done == nil {
		return nil // never started: Start reads the seam after this call
	}
	return c.leases.refresh(ctx, done)
}

// RefreshProjects has the consumer, if one runs, apply a change of the Projects seam's set
// now (see Consumer.RefreshProjects); without one, or before it starts, it returns nil: a
// start reads the seam anyway. New gives it to a Projects seam that takes a refresher
// (ProjectRuntimes does).
func (o *Outbox) RefreshProjects(ctx context.Context) error {
	if o.consumer == nil {
		return nil
	}
	return o.consumer.RefreshProjects(ctx)
}

// ProjectsRefresher is a Projects seam whose set changes while the consumer runs and that
// applies each change at once through the refresher it is given: New (and so the fx Module)
// gives it the Outbox's RefreshProjects. ProjectRuntimes is one.
type ProjectsRefresher interface {
	Projects
	SetRefresher(refresh func(context.Context) error)
}

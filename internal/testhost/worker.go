package testhost

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	"fusion/outbox/web"
)

// The child worker shared by the demo and the fault suite: a process its parent (a host with
// HostConfig.ChildSocket) feeds over a unix socket. It has no database of its own; it follows
// the parent's event stream with the module's client, applies each event to its apply log and
// keeps its position in a file, so that it resumes where it left off when it, or its parent,
// restarts.

// WorkerOptions configure RunWorker.
type WorkerOptions struct {
	// Socket is the parent's HostConfig.ChildSocket.
	Socket string
	// Positions is the file that keeps the last position the worker handled.
	Positions string
	// Log applies the events; its writer-owned side effects go through a store of the
	// worker's own, which the fence must refuse.
	Log    *ApplyLog
	Logger *zap.Logger
	// Ready, when set, is called once the client is built, before it first connects.
	Ready func()
}

// RunWorker follows the parent's stream until ctx ends; it returns nil then.
func RunWorker(ctx context.Context, o WorkerOptions) error {
	// The child's own store: no pool, its own emitter and cache. Its writer-owned side
	// effects refuse an observed context before they would touch a database.
	o.Log.store = New(nil, Options{Logger: o.Logger, Actor: "worker"})
	c, err := web.NewStreamClient(web.StreamClientOptions{
		URL:        "http://parent/events",
		HTTPClient: web.UnixSocketClient(o.Socket),
		Positions:  web.FilePositions(o.Positions),
		MinBackoff: 50 * time.Millisecond,
		MaxBackoff: time.Second,
		Logger:     o.Logger,
	}, o.Log)
	if err != nil {
		return err
	}
	if o.Ready != nil {
		o.Ready()
	}
	if err := c.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

package testhost

import (
	"context"
	"sync"
	"time"
)

// TaskDeleted is the payload of the store's task:deleted event. The local emitter sends it
// with Observed false; the outbox bus bridge sends the same shape with Observed true.
type TaskDeleted struct {
	ProjectID       string    `json:"projectId"`
	TaskID          string    `json:"taskId"`
	DeletedAt       time.Time `json:"deletedAt"`
	Column          string    `json:"column"`
	Archived        bool      `json:"archived"`
	EventID         string    `json:"eventId,omitempty"`
	OriginProcessID string    `json:"originProcessId,omitempty"`
	Observed        bool      `json:"observed,omitempty"`
}

// Emitter is a process-local, synchronous event emitter: listeners run in registration order
// on the emitting goroutine, and only listeners in this process hear it.
type Emitter struct {
	mu        sync.RWMutex
	next      int
	listeners map[int]func(context.Context, TaskDeleted)
	order     []int
}

// On registers fn for task:deleted and returns a function that unregisters it.
func (e *Emitter) On(fn func(context.Context, TaskDeleted)) (off func()) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.listeners == nil {
		e.listeners = map[int]func(context.Context, TaskDeleted){}
	}
	id := e.next
	e.next++
	e.listeners[id] = fn
	e.order = append(e.order, id)
	return func() {
		e.mu.Lock()
		defer e.mu.Unlock()
		delete(e.listeners, id)
		for i, o := range e.order {
			if o == id {
				e.order = append(e.order[:i], e.order[i+1:]...)
				break
			}
		}
	}
}

// Emit calls every listener with ev.
func (e *Emitter) Emit(ctx context.Context, ev TaskDeleted) {
	e.mu.RLock()
	fns := make([]func(context.Context, TaskDeleted), 0, len(e.order))
	for _, id := range e.order {
		fns = append(fns, e.listeners[id])
	}
	e.mu.RUnlock()
	for _, fn := range fns {
		fn(ctx, ev)
	}
}

package web_test

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/testkit"
	"fusion/outbox/web"
)

// Helpers of the stream client's tests: a handler that records, a client run in the
// background, and stream IDs built by hand.

// streamCtx bounds a stream client's test: each takes well under a second on a quiet
// machine, and a minute on a busy one is a failure, not slowness.
func streamCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(testkit.Ctx(t), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// streamPos is the stream ID of positions in the stream of the sorted projects, as sse_id.go
// writes it.
func streamPos(projects []string, positions ...int64) string {
	h := fnv.New32a()
	for _, p := range projects {
		_, _ = h.Write([]byte(p))
		_, _ = h.Write([]byte{0})
	}
	id := fmt.Sprintf("1.%08x", h.Sum32())
	for _, p := range positions {
		id += "." + strconv.FormatInt(p, 36)
	}
	return id
}

// streamRecorder is a StreamHandler that records what it is handed, with what its context says.
type streamRecorder struct {
	mu      sync.Mutex
	events  []outbox.ObservedEvent
	markers []outbox.Observed // each event's observed marker
	fenced  []error           // RefuseObserved in each event's context
	resets  []web.SSEReset
	changed chan struct{} // closed and replaced on every record

	// onEvent and onReset, when set, run first; an error is returned to the client and
	// nothing is recorded.
	onEvent func(outbox.ObservedEvent) error
	onReset func(web.SSEReset) error
}

func newStreamRecorder() *streamRecorder { return &streamRecorder{changed: make(chan struct{})} }

func (r *streamRecorder) HandleObserved(ctx context.Context, ev outbox.ObservedEvent) error {
	if r.onEvent != nil {
		if err := r.onEvent(ev); err != nil {
			return err
		}
	}
	marker, _ := outbox.ObservedFrom(ctx)
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, ev)
	r.markers = append(r.markers, marker)
	r.fenced = append(r.fenced, outbox.RefuseObserved(ctx, "delete"))
	r.notifyLocked()
	return nil
}

func (r *streamRecorder) HandleReset(ctx context.Context, rs web.SSEReset) error {
	if r.onReset != nil {
		if err := r.onReset(rs); err != nil {
			return err
		}
	}
	if !outbox.IsObserved(ctx) {
		return errors.New("the reset's context is not observed")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.resets = append(r.resets, rs)
	r.notifyLocked()
	return nil
}

func (r *streamRecorder) notifyLocked() {
	close(r.changed)
	r.changed = make(chan struct{})
}

// waitUntil waits until cond, called under the streamRecorder's lock, holds; it fails the test when
// ctx ends first.
func (r *streamRecorder) waitUntil(t *testing.T, ctx context.Context, what string, cond func() bool) {
	t.Helper()
	for {
		r.mu.Lock()
		ok, changed := cond(), r.changed
		r.mu.Unlock()
		if ok {
			return
		}
		select {
		case <-changed:
		case <-ctx.Done():
			t.Fatalf("waiting for %s: %v", what, ctx.Err())
		}
	}
}

// seqs is the sequences recorded of project, in the order they came. Call under the lock.
func (r *streamRecorder) seqsLocked(project string) []int64 {
	var out []int64
	for _, ev := range r.events {
		if ev.ProjectID == project {
			out = append(out, ev.Sequence)
		}
	}
	return out
}

// seqs is seqsLocked for callers that do not hold the lock.
func (r *streamRecorder) seqs(project string) []int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.seqsLocked(project)
}

// waitEvents waits until the streamRecorder holds at least n events of each project in want.
func (r *streamRecorder) waitEvents(t *testing.T, ctx context.Context, want map[string]int) {
	t.Helper()
	r.waitUntil(t, ctx, fmt.Sprintf("events %v", want), func() bool {
		for p, n := range want {
			if len(r.seqsLocked(p)) < n {
				return false
			}
		}
		return true
	})
}

// runClient builds a client and runs it until the test ends; stop ends it and returns what
// Run returned.
func runClient(t *testing.T, ctx context.Context, opts web.StreamClientOptions, h web.StreamHandler) (c *web.StreamClient, stop func() error) {
	t.Helper()
	c, err := web.NewStreamClient(opts, h)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	var runErr error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case runErr = <-done:
			case <-time.After(testkit.WaitLimit):
				runErr = errors.New("Run did not return after its context ended")
			}
		})
		return runErr
	}
	t.Cleanup(func() { _ = stop() })
	return c, stop
}

// liveEvent is the event of a deletion seedMore wrote: task prefix-i, deleted at 2031-01-01
// plus i seconds, numbered seq.
func liveEvent(project, prefix string, i int, seq int64) outbox.ObservedEvent {
	at := time.Date(2031, 1, 1, 0, 0, i, 0, time.UTC)
	task := prefix + "-" + strconv.Itoa(i)
	return outbox.ObservedEvent{Event: outbox.Event{ProjectID: project, Sequence: seq, EventID: outbox.TaskDeletedEventID(task, at),
		EventType: outbox.EventTypeTaskDeleted, TaskID: task, DeletedAt: at, WriterProcessID: "writer-0123456789abcdef",
		OccurredAt: time.Now(), PayloadVersion: 1}}
}

// quick is backoff short enough that reconnects cost a test nothing.
func quick(o web.StreamClientOptions) web.StreamClientOptions {
	o.MinBackoff, o.MaxBackoff = 5*time.Millisecond, 50*time.Millisecond
	return o
}

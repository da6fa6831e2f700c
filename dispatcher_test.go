package outbox_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
)

func sampleEvent(writer string) outbox.ObservedEvent {
	deletedAt := time.Date(2026, 5, 1, 12, 0, 0, 0, time.UTC)
	return outbox.ObservedEvent{Event: outbox.Event{ProjectID: "p", Sequence: 1, EventType: outbox.EventTypeTaskDeleted, TaskID: "t-1",
		DeletedAt: deletedAt, EventID: outbox.TaskDeletedEventID("t-1", deletedAt), WriterProcessID: writer, PayloadVersion: outbox.PayloadVersion}}
}

// TestDispatchOnItsOwnSurvivesAListenerTimeout: Dispatch called directly (as a replay is)
// abandons a listener that overruns its timeout, and returns a timeout failure.
func TestDispatchOnItsOwnSurvivesAListenerTimeout(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	defer close(release)
	d := outbox.NewDispatcher(outbox.DispatcherOptions{Timeout: 20 * time.Millisecond, Listeners: []outbox.Listener{
		outbox.ListenerFunc("stuck", func(context.Context, outbox.ObservedEvent) error { <-release; return nil })}})
	outcome, class := d.Dispatch(context.Background(), sampleEvent("writer-0123456789abcdef"))
	require.Equal(t, outbox.Failed, outcome)
	require.Equal(t, outbox.FailureListenerTimeout, class)
}

// TestDispatchAfterStopHandsNothingOver: with its context already ended, a dispatch touches
// neither the cache nor the listeners.
func TestDispatchAfterStopHandsNothingOver(t *testing.T) {
	t.Parallel()
	var calls atomic.Int64
	cache := &countingCache{}
	d := outbox.NewDispatcher(outbox.DispatcherOptions{Cache: cache, NoLocalWriter: true, Listeners: []outbox.Listener{
		outbox.ListenerFunc("count", func(context.Context, outbox.ObservedEvent) error { calls.Add(1); return nil })}})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	outcome, _ := d.Dispatch(ctx, sampleEvent("writer-0123456789abcdef"))
	require.Equal(t, outbox.Interrupted, outcome)
	require.Zero(t, calls.Load())
	require.Zero(t, cache.removed.Load())
}

// TestOwnEventGoesToTheCacheOnly: an event this process wrote is applied to the cache and not
// handed to the listeners.
func TestOwnEventGoesToTheCacheOnly(t *testing.T) {
	t.Parallel()
	var calls atomic.Int64
	cache := &countingCache{}
	d := outbox.NewDispatcher(outbox.DispatcherOptions{Cache: cache, SelfWriterID: "writer-0123456789abcdef", Listeners: []outbox.Listener{
		outbox.ListenerFunc("count", func(context.Context, outbox.ObservedEvent) error { calls.Add(1); return nil })}})
	outcome, _ := d.Dispatch(context.Background(), sampleEvent("writer-0123456789abcdef"))
	require.Equal(t, outbox.Own, outcome)
	require.Zero(t, calls.Load())
	require.Equal(t, int64(1), cache.removed.Load())
}

type countingCache struct{ removed atomic.Int64 }

func (c *countingCache) RemoveTask(context.Context, string, string, time.Time) (bool, error) {
	c.removed.Add(1)
	return true, nil
}

func (c *countingCache) ReplaceLive(context.Context, string, []string) error { return nil }

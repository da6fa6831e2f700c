package outbox_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/zap/zaptest"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
	"fusion/outbox/internal/testkit"
)

// TestListenerTimeoutWithoutFx: Config.ListenerTimeout bounds dispatch when the consumer and
// its dispatcher are built with the plain constructors, the dispatcher given no timeout.
func TestListenerTimeoutWithoutFx(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	cfg := testkit.FastConfig()
	cfg.ListenerTimeout = 200 * time.Millisecond
	// How long the dispatch let the listener run is measured from its call to its context's
	// end, not over the whole test, and held against half the 30s default that applies if
	// Config.ListenerTimeout is ignored: a busy machine delays a 200ms timer, not by 15s.
	held := make(chan time.Duration, 1)
	slow := outbox.ListenerFunc("slow", func(ctx context.Context, _ outbox.ObservedEvent) error {
		called := time.Now()
		<-ctx.Done() // returns when the dispatch gives up on it
		select {
		case held <- time.Since(called):
		default:
		}
		return ctx.Err()
	})
	c, w := backlogConsumer(t, 1, cfg, slow)
	require.NoError(t, c.Start(ctx))
	t.Cleanup(func() { require.NoError(t, c.Stop(context.Background())) })
	for {
		var class string
		err := w.Pool.QueryRow(ctx, `SELECT coalesce(max(last_failure_class), '') FROM lifecycle_consumer_deliveries WHERE consumer_id = 'dash'`).Scan(&class)
		require.NoError(t, err)
		if class != "" {
			require.Equal(t, string(outbox.FailureListenerTimeout), class)
			d := <-held // sent before the listener returned, so before its failure was recorded
			require.Less(t, d, outbox.Config{}.WithDefaults().ListenerTimeout/2, "the listener ran %v: the default timeout, not Config.ListenerTimeout", d)
			return
		}
		select {
		case <-ctx.Done():
			t.Fatal("no listener_timeout was recorded: Config.ListenerTimeout did not take effect")
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// TestConsumerRefusesADispatcherWithoutSelfWriterID: forgetting the process's writer ID would
// re-deliver its own writes to its own listeners, so the plain constructor refuses it unless
// the process declares it records no events.
func TestConsumerRefusesADispatcherWithoutSelfWriterID(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	build := func(d outbox.DispatcherOptions) error {
		_, err := outbox.NewConsumer(outbox.ConsumerOptions{ID: "dash", Pool: pool, Projects: outbox.StaticProjects{"p"},
			Dispatcher: outbox.NewDispatcher(d), Logger: zaptest.NewLogger(t)})
		return err
	}
	rec := testkit.NewRecorder()
	err := build(outbox.DispatcherOptions{Listeners: []outbox.Listener{rec}})
	var verr *outbox.ValidationError
	require.ErrorAs(t, err, &verr)
	require.Equal(t, "DispatcherOptions.SelfWriterID", verr.Field)

	require.NoError(t, build(outbox.DispatcherOptions{Listeners: []outbox.Listener{rec}, SelfWriterID: "writer-0123456789abcdef"}))
	require.NoError(t, build(outbox.DispatcherOptions{Listeners: []outbox.Listener{rec}, NoLocalWriter: true}))
	require.NoError(t, build(outbox.DispatcherOptions{}), "no listeners: nothing could be re-delivered")
}

// TestDispatcherTimeoutMustAgreeWithConfig: a dispatcher given its own timeout under a
// consumer whose Config says otherwise is refused rather than one of them silently ignored.
func TestDispatcherTimeoutMustAgreeWithConfig(t *testing.T) {
	t.Parallel()
	pool := pgtest.NewPool(t)
	d := outbox.NewDispatcher(outbox.DispatcherOptions{NoLocalWriter: true, Timeout: 5 * time.Second})
	_, err := outbox.NewConsumer(outbox.ConsumerOptions{ID: "dash", Pool: pool, Projects: outbox.StaticProjects{"p"}, Dispatcher: d})
	var verr *outbox.ValidationError
	require.ErrorAs(t, err, &verr)
	require.Equal(t, "DispatcherOptions.Timeout", verr.Field)
	_, err = outbox.NewConsumer(outbox.ConsumerOptions{ID: "dash", Pool: pool, Projects: outbox.StaticProjects{"p"}, Dispatcher: d,
		Config: outbox.Config{ListenerTimeout: 5 * time.Second}})
	require.NoError(t, err)
}

// TestConsumerIDThatCannotLeaseIsRefused: the lease owner is the ID, "@" and 16 hex digits,
// and must fit the 128 bytes the database allows, so an ID longer than 111 bytes is refused at
// construction with an error naming the field, not by a CHECK violation at Start.
func TestConsumerIDThatCannotLeaseIsRefused(t *testing.T) {
	t.Parallel()
	ctx := testkit.Ctx(t)
	db := pgtest.NewDB(t)
	pool := pgtest.Pool(t, db.URL)
	longest, tooLong := strings.Repeat("c", 111), strings.Repeat("c", 112)

	_, err := outbox.ParseConsumerID(tooLong)
	require.ErrorContains(t, err, "111")
	_, err = outbox.NewConsumer(outbox.ConsumerOptions{ID: outbox.ConsumerID(tooLong), Pool: pool, Projects: outbox.StaticProjects{"p"},
		Dispatcher: outbox.NewDispatcher(outbox.DispatcherOptions{})})
	var verr *outbox.ValidationError
	require.ErrorAs(t, err, &verr)
	require.Equal(t, "ConsumerOptions.ID", verr.Field)

	settings := staticSettings{"outbox.consumer_id": tooLong}
	_, _, err = outbox.ResolveConsumerID(ctx, settings, "outbox.consumer_id")
	require.ErrorAs(t, err, &verr)
	require.Equal(t, "outbox.consumer_id", verr.Field)

	c, err := outbox.NewConsumer(outbox.ConsumerOptions{ID: outbox.ConsumerID(longest), Pool: pool, Config: testkit.FastConfig(),
		Projects: outbox.StaticProjects{"p"}, Dispatcher: outbox.NewDispatcher(outbox.DispatcherOptions{})})
	require.NoError(t, err)
	require.Len(t, c.LeaseOwner(), 128)
	require.NoError(t, c.Start(ctx), "the longest accepted ID can lease")
	require.NoError(t, c.Stop(ctx))
}

type staticSettings map[string]string

func (s staticSettings) Setting(_ context.Context, name string) (string, bool, error) {
	v, ok := s[name]
	return v, ok, nil
}

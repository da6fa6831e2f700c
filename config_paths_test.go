package outbox_test

import (
	"context"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/internal/pgtest"
)

// TestConsumerIDThatCannotLeaseIsRefused: the lease owner is the ID, "@" and 16 hex digits,
// and must fit the 128 bytes the database allows, so an ID longer than 111 bytes is refused at
// construction with an error naming the field, not by a CHECK violation at Start.
func TestConsumerIDThatCannotLeaseIsRefused(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
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

	c, err := outbox.NewConsumer(outbox.ConsumerOptions{ID: outbox.ConsumerID(longest), Pool: pool, Config: fastConfig(),
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

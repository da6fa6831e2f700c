package web

import (
	"errors"
	"net/http"
	"net/url"
	"strings"
	"time"

	"go.uber.org/zap"

	"fusion/outbox"
)

// StreamClientOptions configure a StreamClient.
type StreamClientOptions struct {
	// URL is the stream, e.g. "http://engine:8080/events?project=a&project=b"; for a unix
	// socket any host, e.g. "http://parent/events". Required: an absolute http or https URL.
	URL string
	// HTTPClient makes the requests. nil: a client with no overall timeout on
	// http.DefaultTransport; UnixSocketClient(path) for a parent's socket. A client with an
	// overall Timeout is refused, since it would cut every stream after it.
	HTTPClient *http.Client
	// Header is sent with every request (a remote node's credentials). Last-Event-ID is the
	// client's own, from Positions, and is refused here.
	Header http.Header
	// Positions keeps the client's position across reconnects and restarts. Required.
	Positions PositionStore
	// ConsumerID, optional, is the durable receiver whose stream this client follows; it is
	// put in each event's outbox.Observed marker and outbox.ObservedEvent. Validated as a consumer ID.
	ConsumerID outbox.ConsumerID
	// MinBackoff and MaxBackoff bound the wait before a reconnect: MinBackoff after a
	// connection that made progress, doubled after each failure up to MaxBackoff, and
	// jittered (between half the step and the step). Defaults 100ms and 30s (at least
	// MinBackoff); MinBackoff 1ms to 1m, MaxBackoff MinBackoff to 1h.
	MinBackoff, MaxBackoff time.Duration
	// IdleTimeout drops a connection on which nothing, not even the server's heartbeat
	// (SSEOptions.Heartbeat, 15s by default), arrived for this long, on the wall clock: a
	// peer that vanished without closing the connection would otherwise hold it forever. Time
	// the handler spends is not counted. Defaults to 1m; 10ms to 1h.
	IdleTimeout time.Duration
	// Clock times the backoff. Defaults to outbox.RealClock; tests pass a fake one.
	Clock outbox.Clock
	// Logger logs reconnects, refusals and passed frames (never a payload). Defaults to none.
	Logger *zap.Logger
}

// withDefaults fills every unset field.
func (o StreamClientOptions) withDefaults() StreamClientOptions {
	if o.MinBackoff == 0 {
		o.MinBackoff = 100 * time.Millisecond
	}
	if o.MaxBackoff == 0 {
		o.MaxBackoff = max(30*time.Second, o.MinBackoff)
	}
	if o.IdleTimeout == 0 {
		o.IdleTimeout = time.Minute
	}
	if o.Clock == nil {
		o.Clock = outbox.RealClock{}
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	return o
}

// validate reports every invalid field, each error naming it; no error repeats the URL or a
// header, which may carry credentials.
func (o StreamClientOptions) validate() error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, invalid("StreamClientOptions."+field, format, args...))
	}
	if u, err := url.Parse(o.URL); err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		bad("URL", "must be an absolute http or https URL")
	}
	if o.HTTPClient != nil && o.HTTPClient.Timeout != 0 {
		bad("HTTPClient", "has an overall Timeout (%s), which would cut every stream; IdleTimeout bounds a dead connection", o.HTTPClient.Timeout)
	}
	for k := range o.Header {
		if strings.EqualFold(k, "Last-Event-ID") {
			bad("Header", "sets Last-Event-ID, which the client sends from Positions")
		}
	}
	if o.Positions == nil {
		bad("Positions", "is nil: the client must keep its position to resume")
	}
	if o.ConsumerID != "" {
		if _, err := outbox.ParseConsumerID(string(o.ConsumerID)); err != nil {
			bad("ConsumerID", "%v", err)
		}
	}
	if o.MinBackoff < time.Millisecond || o.MinBackoff > time.Minute {
		bad("MinBackoff", "must be between 1ms and 1m (got %s)", o.MinBackoff)
	}
	if o.MaxBackoff < o.MinBackoff || o.MaxBackoff > time.Hour {
		bad("MaxBackoff", "must be between MinBackoff %s and 1h (got %s)", o.MinBackoff, o.MaxBackoff)
	}
	if o.IdleTimeout < 10*time.Millisecond || o.IdleTimeout > time.Hour {
		bad("IdleTimeout", "must be between 10ms and 1h (got %s)", o.IdleTimeout)
	}
	return errors.Join(errs...)
}

package web

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"net/url"
	"sync/atomic"

	"go.uber.org/zap"

	"fusion/outbox"
)

// StreamHandler receives what a StreamClient reads. Its methods are called one at a time, in
// the stream's order.
type StreamHandler interface {
	// HandleObserved gets each event once in order (at least once across crashes); ctx is
	// marked observed (outbox.RefuseObserved fails in it), carrying the event's ID and writer.
	HandleObserved(ctx context.Context, ev outbox.ObservedEvent) error
	// HandleReset says the stream cannot tell everything that happened to r.Projects:
	// refetch their state; the stream continues from their newest events. ctx is marked
	// observed too: a refetch repeats none of a writer's work.
	HandleReset(ctx context.Context, r SSEReset) error
}

// ErrStreamRefused is wrapped by the error Run returns when the stream refuses the client
// for good: a 4xx status other than 408 and 429 (403 from Authorize, 400 for a bad project
// list, 404 for a wrong URL), or a response that is not an event stream. It is a mistake in
// the client's configuration or credentials, which retrying does not mend.
var ErrStreamRefused = errors.New("event stream refused the client")

// StreamClient follows an SSEHandler's stream from another process: a child worker fed by its
// parent over a unix socket, or a remote node following an engine over HTTP. It resumes from
// the position its PositionStore keeps, so that across reconnects and restarts its handler
// gets every event once, in order, or a reset where the stream cannot tell what it missed.
//
// After each frame its handler accepted, the client saves the frame's ID; a frame that only
// moves the position (the stream's opening frame, a row the server cannot deliver) is saved
// too. A crash between the handler's return and the save hands the event over again: at
// least once. When the handler fails, the connection is dropped and resumed from the saved
// position after the backoff, so the failed frame comes again (an event with its Attempt one
// higher). There is no dead letter: a handler that always fails holds the stream there, each
// failure counted in Errors and logged. A frame whose data this build cannot decode (a
// payload that is not a valid event or reset, or a type it does not know) is logged without
// its data, counted as Undecodable, and passed: its ID is saved, as the server passes a row
// it cannot deliver, since retrying it would fail again forever.
//
// A client that has no saved position starts at the stream's newest events: what happened
// before is state to fetch, not events to replay. A saved position that does not describe
// the stream (another project list in the URL, say) gets a reset of every project.
type StreamClient struct {
	opts  StreamClientOptions
	h     StreamHandler
	log   *zap.Logger
	http  *http.Client
	where string // the URL without credentials, for logs

	running atomic.Bool
	stats   streamClientCounters

	failedKey     string // the event the handler failed on last, and how often
	failedAttempt int
}

// NewStreamClient validates opts and returns a client that calls h; every invalid field is
// named in the error.
func NewStreamClient(opts StreamClientOptions, h StreamHandler) (*StreamClient, error) {
	opts = opts.withDefaults()
	err := opts.validate()
	if h == nil {
		err = errors.Join(err, invalid("StreamHandler", "is nil"))
	}
	if err != nil {
		return nil, fmt.Errorf("stream client: %w", err)
	}
	u, _ := url.Parse(opts.URL) // validated
	c := &StreamClient{opts: opts, h: h, log: opts.Logger.Named("outbox.stream_client"), http: opts.HTTPClient, where: u.Redacted()}
	if c.http == nil {
		c.http = &http.Client{}
	}
	return c, nil
}

// Run follows the stream until ctx ends, and then returns ctx.Err(). It connects with the
// saved position as Last-Event-ID and hands each frame to the handler. When the connection
// fails or ends, when the handler or the position store fails, or on a status such as 503
// (whose Retry-After it honours, up to MaxBackoff), it connects again after the backoff. It
// returns an error wrapping ErrStreamRefused when the stream refuses the client for good.
// Run may not be called again while it runs.
func (c *StreamClient) Run(ctx context.Context) error {
	if !c.running.CompareAndSwap(false, true) {
		return errors.New("stream client: Run is already running")
	}
	defer c.running.Store(false)
	backoff := c.opts.MinBackoff
	for {
		res := c.follow(ctx)
		if ctx.Err() != nil {
			return ctx.Err()
		}
		c.stats.errors.Add(1)
		if errors.Is(res.err, ErrStreamRefused) {
			c.log.Error("event stream: refused for good; not reconnecting", zap.String("url", c.where), zap.Error(res.err))
			return fmt.Errorf("stream client: %w", res.err)
		}
		if res.progress {
			backoff = c.opts.MinBackoff
		}
		wait := backoff/2 + rand.N(backoff/2+1) // jittered within [backoff/2, backoff]
		if ra := min(res.retryAfter, c.opts.MaxBackoff); ra > wait {
			wait = ra
		}
		c.log.Info("event stream: reconnecting", zap.String("url", c.where), zap.Duration("after", wait), zap.Error(res.err))
		t := c.opts.Clock.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C():
		}
		backoff = min(2*backoff, c.opts.MaxBackoff)
	}
}

// StreamClientStats are a StreamClient's counters since it was built.
type StreamClientStats struct {
	Connects    int64 // streams opened (a 200 with an event stream)
	Events      int64 // events the handler accepted
	Resets      int64 // resets the handler accepted
	Undecodable int64 // frames passed without a handler call, since this build cannot decode them
	Errors      int64 // connections that ended other than by Run's context: refused, failed, dropped, or ended by a failing handler or position store
}

type streamClientCounters struct {
	connects, events, resets, undecodable, errors atomic.Int64
}

// Stats returns the client's counters.
func (c *StreamClient) Stats() StreamClientStats {
	s := &c.stats
	return StreamClientStats{Connects: s.connects.Load(), Events: s.events.Load(), Resets: s.resets.Load(),
		Undecodable: s.undecodable.Load(), Errors: s.errors.Load()}
}

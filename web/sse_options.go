package web

import (
	"errors"
	"fmt"
	"net/http"
	"time"

	"go.uber.org/zap"

	"fusion/outbox"
)

// The event stream's options and the reset event it sends.

// SSEOptions configure an SSEHandler.
type SSEOptions struct {
	// Pool reads the retained outbox for clients the ring cannot serve, and the head of a
	// project for the first client of a project the handler has not seen yet. Required.
	Pool outbox.DBTX
	// Projects is the set of projects the stream serves: a request without ?project= gets
	// all of them (those Authorize allows), and a request naming another project is refused.
	// Normally the consumer's own Projects. Required.
	Projects outbox.Projects
	// Authorize, when set, is asked for every project of every connection whether r may see
	// it, at connect and again every ReauthorizeInterval while the stream is open. A request
	// naming in ?project= a project that is refused, or that the stream does not serve, fails
	// with the same 403 either way, so that the answer does not tell which project IDs exist;
	// without ?project= the stream carries only the allowed projects. An open stream one of
	// whose projects is refused on a later check is ended; the browser's reconnect is then
	// authorized afresh. Without Authorize every served project is open to anyone who reaches
	// the handler: the host owns authentication.
	Authorize func(r *http.Request, projectID string) bool
	// ReauthorizeInterval is how often an open stream asks Authorize again about each of its
	// projects, so that a user whose access was revoked stops receiving events within it.
	// Defaults to 1m; 10ms to 1h. Unused without Authorize.
	ReauthorizeInterval time.Duration
	// Clock measures ReauthorizeInterval. Defaults to outbox.RealClock; tests pass a fake one.
	Clock outbox.Clock
	// MaxClients bounds the concurrent streams; a request beyond it gets 503 with
	// Retry-After. Defaults to 1000; 1 to 1000000.
	MaxClients int
	// MaxProjects bounds how many projects one request may name in ?project=. Defaults to 64;
	// 1 to 1024.
	MaxProjects int
	// RingSize is how many recent events the handler keeps per project to resume clients
	// from memory. Defaults to 1024; 16 to 1000000.
	RingSize int
	// MaxReplay is how far behind, in events of one project, a client may be and still be
	// resumed; further behind it is sent a reset. Defaults to 10000; at least RingSize, at
	// most 1000000.
	MaxReplay int
	// MaxReplayReads bounds the outbox reads one connection may cost: each read of a page of
	// 500 sequences of one project counts, whether the database or the cache served it
	// (replays from the ring cost nothing), and so does each head read that checks a resumed
	// position beyond the handler's newest event. A resuming client whose projects need more
	// is sent a reset, with reason replay_budget, for the projects that do not fit (a
	// position that could not be checked is reset as unknown_position); it then continues
	// from their newest events, as after any reset. A connected client that falls behind the
	// ring once the budget is spent is reset likewise. Defaults to two projects MaxReplay
	// behind (42 reads at the default MaxReplay); 1 to 1000000.
	MaxReplayReads int
	// Heartbeat is how often an idle stream gets a comment line, which keeps proxies from
	// closing it. Defaults to 15s; at least 10ms.
	Heartbeat time.Duration
	// WriteTimeout bounds one write to a client; a client that does not take it in time is
	// disconnected (and resumes when it reconnects). Defaults to 10s; at least 10ms.
	WriteTimeout time.Duration
	// ReplayReadTimeout bounds one read of the outbox that resuming clients share (a page of
	// events or a project's head); a client whose read fails this way is disconnected and
	// resumes when it reconnects. Defaults to 10s; at least 10ms.
	ReplayReadTimeout time.Duration
	// Retry is the reconnection delay the stream suggests to browsers (the SSE retry field).
	// Defaults to 2s; 10ms to 1h.
	Retry  time.Duration
	Logger *zap.Logger
}

// withDefaults fills every unset field.
func (o SSEOptions) withDefaults() SSEOptions {
	defInt := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	def := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	defInt(&o.MaxClients, 1000)
	defInt(&o.MaxProjects, 64)
	defInt(&o.RingSize, 1024)
	defInt(&o.MaxReplay, max(10000, o.RingSize))
	def(&o.Heartbeat, 15*time.Second)
	def(&o.WriteTimeout, 10*time.Second)
	def(&o.ReplayReadTimeout, 10*time.Second)
	def(&o.Retry, 2*time.Second)
	def(&o.ReauthorizeInterval, time.Minute)
	defInt(&o.MaxReplayReads, 2*(o.MaxReplay/replayPageSize+1))
	if o.Clock == nil {
		o.Clock = outbox.RealClock{}
	}
	if o.Logger == nil {
		o.Logger = zap.NewNop()
	}
	return o
}

// validate reports every invalid field, each error naming it.
func (o SSEOptions) validate() error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, invalid("SSEOptions."+field, format, args...))
	}
	if o.Pool == nil {
		bad("Pool", "is nil: the stream reads the outbox to resume clients")
	}
	if o.Projects == nil {
		bad("Projects", "is nil: the stream must know which projects it serves")
	}
	if o.MaxClients < 1 || o.MaxClients > 1_000_000 {
		bad("MaxClients", "must be between 1 and 1000000 (got %d)", o.MaxClients)
	}
	if o.MaxProjects < 1 || o.MaxProjects > 1024 {
		bad("MaxProjects", "must be between 1 and 1024 (got %d)", o.MaxProjects)
	}
	if o.RingSize < 16 || o.RingSize > 1_000_000 {
		bad("RingSize", "must be between 16 and 1000000 (got %d)", o.RingSize)
	}
	if o.MaxReplay < o.RingSize || o.MaxReplay > 1_000_000 {
		bad("MaxReplay", "must be between RingSize %d and 1000000 (got %d)", o.RingSize, o.MaxReplay)
	}
	if o.MaxReplayReads < 1 || o.MaxReplayReads > 1_000_000 {
		bad("MaxReplayReads", "must be between 1 and 1000000 (got %d)", o.MaxReplayReads)
	}
	if o.ReauthorizeInterval < 10*time.Millisecond || o.ReauthorizeInterval > time.Hour {
		bad("ReauthorizeInterval", "must be between 10ms and 1h (got %s)", o.ReauthorizeInterval)
	}
	if o.Heartbeat < 10*time.Millisecond {
		bad("Heartbeat", "must be at least 10ms (got %s)", o.Heartbeat)
	}
	if o.WriteTimeout < 10*time.Millisecond {
		bad("WriteTimeout", "must be at least 10ms (got %s)", o.WriteTimeout)
	}
	if o.ReplayReadTimeout < 10*time.Millisecond {
		bad("ReplayReadTimeout", "must be at least 10ms (got %s)", o.ReplayReadTimeout)
	}
	if o.Retry < 10*time.Millisecond || o.Retry > time.Hour {
		bad("Retry", "must be between 10ms and 1h (got %s)", o.Retry)
	}
	if len(errs) > 0 {
		return fmt.Errorf("sse options: %w", errors.Join(errs...))
	}
	return nil
}

// The reasons a reset event gives.
const (
	// ResetBelowPrunedFloor: an event the client needs was pruned.
	ResetBelowPrunedFloor = "below_pruned_floor"
	// ResetTooFarBehind: the client is more than MaxReplay events behind.
	ResetTooFarBehind = "too_far_behind"
	// ResetUnknownPosition: the Last-Event-ID does not describe this stream (another
	// project list, another format, garbage, or a position beyond the project's head).
	ResetUnknownPosition = "unknown_position"
	// ResetReplayBudget: replaying what the client missed would cost its connection more
	// outbox reads than MaxReplayReads allows.
	ResetReplayBudget = "replay_budget"
)

// SSEResetEvent is the event type of a reset; its data is an SSEReset.
const SSEResetEvent = "reset"

// SSEReset is the payload of a reset event: the page should refetch these projects' state,
// since the stream cannot tell it everything that happened; the stream continues from the
// newest event.
type SSEReset struct {
	Projects []string `json:"projects"`
	Reason   string   `json:"reason"`
}

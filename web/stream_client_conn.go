package web

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strconv"
	"time"

	"go.uber.org/zap"

	"fusion/outbox"
)

// One connection of a StreamClient: the request, the frames, the handler calls and the saves.

// followed is how one connection ended.
type followed struct {
	err        error
	progress   bool          // the saved position moved, or the connection lasted MaxBackoff: the backoff starts over
	retryAfter time.Duration // what the server asked for, 0 when nothing
}

// follow makes one connection and handles its frames until it ends.
func (c *StreamClient) follow(ctx context.Context) (res followed) {
	saved, err := c.opts.Positions.Load(ctx)
	if err != nil {
		return followed{err: fmt.Errorf("load the position: %w", err)}
	}
	connCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	req, err := http.NewRequestWithContext(connCtx, http.MethodGet, c.opts.URL, nil)
	if err != nil {
		return followed{err: fmt.Errorf("%w: %v", ErrStreamRefused, err)} // not reached: the URL was validated
	}
	req.Header = c.opts.Header.Clone()
	if req.Header == nil {
		req.Header = http.Header{}
	}
	req.Header.Set("Accept", "text/event-stream")
	req.Header.Set("Cache-Control", "no-cache")
	if saved != "" {
		req.Header.Set("Last-Event-ID", saved)
	}
	started := time.Now()
	resp, err := c.http.Do(req)
	if err != nil {
		return followed{err: fmt.Errorf("connect: %w", err)}
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return followed{err: statusError(resp), retryAfter: retryAfter(resp.Header.Get("Retry-After"))}
	}
	if mt, _, err := mime.ParseMediaType(resp.Header.Get("Content-Type")); err != nil || mt != "text/event-stream" {
		return followed{err: fmt.Errorf("%w: the response is not an event stream", ErrStreamRefused)}
	}
	c.stats.connects.Add(1)
	c.log.Debug("event stream: connected", zap.String("url", c.where), zap.Bool("resumed", saved != ""))
	defer func() {
		if time.Since(started) >= c.opts.MaxBackoff {
			res.progress = true // a connection that lasted is no failure to back off from
		}
	}()

	idle := time.AfterFunc(c.opts.IdleTimeout, cancel)
	defer idle.Stop()
	idle.Stop() // armed only while a read waits
	rd := NewStreamReader(&idleReader{r: resp.Body, t: idle, d: c.opts.IdleTimeout})
	for {
		f, err := rd.Next()
		if err != nil {
			if connCtx.Err() != nil && ctx.Err() == nil {
				err = fmt.Errorf("nothing arrived for %s: %w", c.opts.IdleTimeout, err)
			}
			res.err = fmt.Errorf("read: %w", err)
			return res
		}
		if err := c.handle(ctx, f); err != nil {
			res.err = err
			return res
		}
		if f.ID == "" || f.ID == saved {
			continue
		}
		if err := c.opts.Positions.Save(ctx, f.ID); err != nil {
			res.err = fmt.Errorf("save the position: %w", err)
			return res
		}
		saved, res.progress = f.ID, true
	}
}

// handle hands one frame to the handler, or passes it.
func (c *StreamClient) handle(ctx context.Context, f StreamFrame) error {
	switch {
	case f.Type == "" && f.Data == nil:
		return nil // only the position moves
	case f.Type == outbox.EventTypeTaskDeleted:
		ev, ok := decodeStreamEvent(f.Data)
		if !ok {
			c.pass(f, "invalid_event")
			return nil
		}
		key := "event\x00" + ev.ProjectID + "\x00" + ev.EventID
		attempt := c.attempt(key)
		octx := outbox.WithObserved(ctx, outbox.Observed{ConsumerID: c.opts.ConsumerID, EventID: ev.EventID, WriterProcessID: ev.WriterProcessID})
		err := c.h.HandleObserved(octx, outbox.ObservedEvent{Event: ev, Observed: true, ConsumerID: c.opts.ConsumerID, Attempt: attempt})
		if c.done(key, attempt, err) != nil {
			return fmt.Errorf("handle event %s of %s: %w", ev.EventID, ev.ProjectID, err)
		}
		c.stats.events.Add(1)
	case f.Type == SSEResetEvent:
		r, ok := decodeStreamReset(f.Data)
		if !ok {
			c.pass(f, "invalid_reset")
			return nil
		}
		if err := c.h.HandleReset(outbox.WithObserved(ctx, outbox.Observed{ConsumerID: c.opts.ConsumerID}), r); err != nil {
			return fmt.Errorf("handle reset (%s) of %d projects: %w", r.Reason, len(r.Projects), err)
		}
		c.stats.resets.Add(1)
	default:
		c.pass(f, "unknown_type")
	}
	return nil
}

// attempt is the delivery attempt of the event key names: 1, or one more than the handler's
// failures on it so far (a resumed stream may bring other projects' events first).
func (c *StreamClient) attempt(key string) int {
	if key == c.failedKey {
		return c.failedAttempt + 1
	}
	return 1
}

// done records the handler's answer about the event key names, and returns err.
func (c *StreamClient) done(key string, attempt int, err error) error {
	switch {
	case err != nil:
		c.failedKey, c.failedAttempt = key, attempt
	case key == c.failedKey:
		c.failedKey, c.failedAttempt = "", 0
	}
	return err
}

// pass logs a frame it cannot decode, without its data, and counts it.
func (c *StreamClient) pass(f StreamFrame, reason string) {
	c.stats.undecodable.Add(1)
	c.log.Warn("event stream: a frame this build cannot decode is passed", zap.String("reason", reason),
		zap.Int("type_bytes", len(f.Type)), zap.Int("data_bytes", len(f.Data)))
}

// decodeStreamEvent reads an event frame's payload (an outbox.Event marked observed, as newFrame
// writes it) and checks it in full.
func decodeStreamEvent(data []byte) (outbox.Event, bool) {
	var p ssePayload
	if err := json.Unmarshal(data, &p); err != nil || !p.Observed || p.Event.Validate() != nil {
		return outbox.Event{}, false
	}
	return p.Event, true
}

// decodeStreamReset reads a reset frame's payload.
func decodeStreamReset(data []byte) (SSEReset, bool) {
	var r SSEReset
	if err := json.Unmarshal(data, &r); err != nil || len(r.Projects) == 0 || r.Reason == "" {
		return SSEReset{}, false
	}
	for _, p := range r.Projects {
		if outbox.ValidateProjectID(p) != nil {
			return SSEReset{}, false
		}
	}
	return r, true
}

// statusError describes a refused request; a 4xx other than 408 and 429 wraps
// ErrStreamRefused.
func statusError(resp *http.Response) error {
	code := resp.StatusCode
	if code >= 400 && code < 500 && code != http.StatusRequestTimeout && code != http.StatusTooManyRequests {
		return fmt.Errorf("%w: status %d", ErrStreamRefused, code)
	}
	return fmt.Errorf("status %d", code)
}

// retryAfter reads a Retry-After header, in seconds or as an HTTP date; 0 when absent or bad.
func retryAfter(v string) time.Duration {
	if v == "" {
		return 0
	}
	if s, err := strconv.ParseInt(v, 10, 64); err == nil {
		if s < 0 {
			return 0
		}
		return time.Duration(min(s, int64(24*time.Hour/time.Second))) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(time.Until(t), 0)
	}
	return 0
}

// idleReader arms its timer while a read waits: a connection on which nothing arrives for
// the timer's duration is cancelled.
type idleReader struct {
	r io.Reader
	t *time.Timer
	d time.Duration
}

func (r *idleReader) Read(p []byte) (int, error) {
	r.t.Reset(r.d)
	n, err := r.r.Read(p)
	r.t.Stop()
	return n, err
}

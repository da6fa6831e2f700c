package web

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"fusion/outbox"
)

// Writing to one event-stream client: catching it up from the ring or the outbox, resets, the
// per-project rings, the connection with its write deadline, and the counters.

// catchUpChunk is the most frames one write carries.
const catchUpChunk = 256

// catchUp sends the client everything up to each project's newest event.
func (h *SSEHandler) catchUp(ctx context.Context, c *sseClient, s *sseStream) error {
	for i := range c.projects {
		for {
			frames, reset, fromOutbox, err := h.next(ctx, c, i)
			if err != nil {
				return err
			}
			var b []byte
			switch {
			case reset != "":
				b = h.appendReset(nil, c, c.pos, []int{i}, reset)
			case len(frames) == 0:
			default:
				b = h.appendFrames(c, i, frames, fromOutbox)
			}
			if b == nil {
				break
			}
			if err := s.send(b); err != nil {
				return err
			}
		}
	}
	return nil
}

// next is the client's next step in project i: frames to send (from the ring or the
// outbox), a reset reason (the position already moved), or nothing when it is up to date.
func (h *SSEHandler) next(ctx context.Context, c *sseClient, i int) (frames []sseFrame, reset string, fromOutbox bool, err error) {
	h.mu.Lock()
	lg, pos := c.logs[i], c.pos[i]
	lo, hi := lg.lo, lg.hi
	switch {
	case pos >= hi:
		h.mu.Unlock()
		return nil, "", false, nil
	case hi-pos > int64(h.cfg.MaxReplay):
		h.mu.Unlock()
		c.pos[i] = hi
		return nil, ResetTooFarBehind, false, nil
	case pos >= lo:
		frames = lg.frames(pos, catchUpChunk)
		h.mu.Unlock()
		return frames, "", false, nil
	}
	h.mu.Unlock()
	if c.reads >= h.cfg.MaxReplayReads {
		// The connection spent its budget of outbox reads: a reset, never a silent skip.
		c.pos[i] = hi
		return nil, ResetReplayBudget, false, nil
	}
	c.reads++
	frames, err = h.replay.events(ctx, c.projects[i], pos, lo)
	if errors.Is(err, errBelowFloor) {
		c.pos[i] = hi
		return nil, ResetBelowPrunedFloor, false, nil
	}
	return frames, "", true, err
}

// appendFrames renders frames of project i, each with the ID of the position it leaves the
// client at, and moves the client's position.
func (h *SSEHandler) appendFrames(c *sseClient, i int, frames []sseFrame, fromOutbox bool) []byte {
	var b, id []byte
	replayed := 0
	for _, f := range frames {
		c.pos[i] = f.seq
		id = appendStreamID(id[:0], c.fingerprint, c.pos)
		if f.data == nil {
			// A row that cannot be delivered: only the position moves. An ID-only frame sets
			// the browser's Last-Event-ID without dispatching an event.
			b = appendStreamFrame(b, StreamFrame{ID: string(id)})
			continue
		}
		if f.seq <= c.replayTo[i] {
			replayed++
		}
		b = appendStreamFrame(b, StreamFrame{ID: string(id), Type: outbox.EventTypeTaskDeleted, Data: f.data})
	}
	if fromOutbox {
		h.stats.replayedOutbox.Add(int64(replayed))
	} else {
		h.stats.replayedRing.Add(int64(replayed))
	}
	return b
}

// appendReset renders a reset of the projects at indexes, whose positions already moved, with
// the ID of pos.
func (h *SSEHandler) appendReset(b []byte, c *sseClient, pos []int64, indexes []int, reason string) []byte {
	r := SSEReset{Reason: reason}
	for _, i := range indexes {
		r.Projects = append(r.Projects, c.projects[i])
	}
	data, _ := json.Marshal(r) // strings and a slice of strings: cannot fail
	h.stats.resets.Add(int64(len(indexes)))
	return appendStreamFrame(b, StreamFrame{ID: string(appendStreamID(nil, c.fingerprint, pos)), Type: SSEResetEvent, Data: data})
}

func allIndexes(n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = i
	}
	return out
}

// sseClient is one connected stream. Its positions are touched only by its own goroutine.
type sseClient struct {
	projects    []string      // sorted
	fingerprint string        // of projects, inside every ID
	logs        []*projectLog // per project, in projects' order
	pos         []int64       // the last sequence sent, per project
	replayTo    []int64       // frames at or below this were missed while disconnected
	reads       int           // outbox page reads this connection made, against MaxReplayReads
	wake        chan struct{}
}

// projectLog is one project's recent events: a ring holding the contiguous sequences
// (lo, hi]. Guarded by SSEHandler.mu.
type projectLog struct {
	known  bool // lo and hi mean something: set by the first event or the first client
	lo, hi int64
	ring   []sseFrame // the frame of sequence s is at ring[s % len(ring)]
	subs   map[*sseClient]struct{}
}

func (l *projectLog) append(f sseFrame, size int) {
	if l.ring == nil {
		l.ring = make([]sseFrame, size)
	}
	l.ring[f.seq%int64(len(l.ring))] = f
	l.hi = f.seq
	if l.hi-l.lo > int64(len(l.ring)) {
		l.lo = l.hi - int64(len(l.ring))
	}
}

func (l *projectLog) restart(f sseFrame, size int) {
	l.known, l.lo, l.hi = true, f.seq-1, f.seq-1
	l.append(f, size)
}

// frames copies at most n frames after sequence after, which must be in [lo, hi).
func (l *projectLog) frames(after int64, n int) []sseFrame {
	end := min(l.hi, after+int64(n))
	out := make([]sseFrame, 0, end-after)
	for s := after + 1; s <= end; s++ {
		out = append(out, l.ring[s%int64(len(l.ring))])
	}
	return out
}

// errClientGone is a write that failed or timed out: the client is gone or stalled.
var errClientGone = errors.New("event-stream client gone")

// sseStream writes to one client, each write bounded by WriteTimeout.
type sseStream struct {
	h         *SSEHandler
	w         http.ResponseWriter
	rc        *http.ResponseController
	deadlines bool // the writer supports write deadlines (as net/http's own do)
}

// send writes b and flushes it. The connection's write deadline bounds it; a ResponseWriter
// without deadlines (a middleware that hides them) gets a timer instead, which closes the
// connection by hijacking it if the writer allows that.
func (s *sseStream) send(b []byte) error {
	timeout := s.h.cfg.WriteTimeout
	if s.deadlines {
		if err := s.rc.SetWriteDeadline(time.Now().Add(timeout)); err != nil {
			s.deadlines = false
		}
	}
	var fired atomic.Bool
	var timer *time.Timer
	if !s.deadlines {
		timer = time.AfterFunc(timeout, func() { fired.Store(true); s.abort() })
	}
	_, err := s.w.Write(b)
	if err == nil {
		err = s.rc.Flush()
	}
	if timer != nil {
		timer.Stop()
	}
	switch {
	case fired.Load(), errors.Is(err, os.ErrDeadlineExceeded):
		s.h.stats.stalled.Add(1)
		return errClientGone
	case err != nil:
		return errClientGone
	}
	return nil
}

// abort closes a stalled client's connection from the timer.
func (s *sseStream) abort() {
	conn, _, err := s.rc.Hijack()
	if err != nil {
		if !s.h.warned.Swap(true) {
			s.h.log.Warn("a stalled event-stream client cannot be disconnected: the response writer supports neither write deadlines nor hijacking",
				zap.Duration("write_timeout", s.h.cfg.WriteTimeout))
		}
		return
	}
	_ = conn.Close()
}

type sseCounters struct {
	connections, resumes, replayedRing, replayedOutbox, resets, refused, stalled atomic.Int64
}

// SSEStats are an SSEHandler's counters since it was built.
type SSEStats struct {
	Clients            int   // connected now
	Connections        int64 // streams accepted
	Resumes            int64 // of which presented a Last-Event-ID of this stream
	ReplayedFromRing   int64 // events sent to resumed clients that they had missed, from memory
	ReplayedFromOutbox int64 // the same, read from the outbox
	Resets             int64 // project resets sent
	Refused            int64 // requests refused (limits, authorization, bad filters), and open streams ended on a revoked authorization
	Stalled            int64 // clients disconnected for not taking a write in time
	OutboxReads        int64 // outbox page reads (shared by every client that needed the page)
	HeadReads          int64 // project head reads (shared likewise)
}

// Stats returns the handler's counters.
func (h *SSEHandler) Stats() SSEStats {
	s := &h.stats
	return SSEStats{Clients: h.Clients(), Connections: s.connections.Load(), Resumes: s.resumes.Load(),
		ReplayedFromRing: s.replayedRing.Load(), ReplayedFromOutbox: s.replayedOutbox.Load(), Resets: s.resets.Load(),
		Refused: s.refused.Load(), Stalled: s.stalled.Load(), OutboxReads: h.replay.pageReads.Load(), HeadReads: h.replay.headReads.Load()}
}

// String is the stats on one line, for logs and test output.
func (s SSEStats) String() string {
	return "clients=" + strconv.Itoa(s.Clients) + " connections=" + strconv.FormatInt(s.Connections, 10) +
		" resumes=" + strconv.FormatInt(s.Resumes, 10) + " replayed_ring=" + strconv.FormatInt(s.ReplayedFromRing, 10) +
		" replayed_outbox=" + strconv.FormatInt(s.ReplayedFromOutbox, 10) + " resets=" + strconv.FormatInt(s.Resets, 10) +
		" refused=" + strconv.FormatInt(s.Refused, 10) + " stalled=" + strconv.FormatInt(s.Stalled, 10) +
		" outbox_reads=" + strconv.FormatInt(s.OutboxReads, 10) + " head_reads=" + strconv.FormatInt(s.HeadReads, 10)
}

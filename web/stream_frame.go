package web

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
)

// The event stream's framing, shared by the server (SSEHandler) and the client (StreamClient):
// frames in the text/event-stream form, whatever carries them (HTTP over TCP, or a unix
// socket from a parent process).

// StreamFrame is one frame of the event stream.
type StreamFrame struct {
	// ID is the stream's last event ID after this frame: the position a client resumes from
	// (see sse_id.go). A frame without an id line keeps the ID of the frame before it.
	ID string
	// Type is outbox.EventTypeTaskDeleted for an event, SSEResetEvent for a reset, and "" for a
	// frame that only moves the position (an ID-only frame: no type and no data).
	Type string
	// Data is the frame's data lines joined with "\n": for an event, the JSON of the event
	// marked observed; for a reset, an SSEReset. It is nil when the frame has no data line.
	Data []byte
}

// MaxStreamLine bounds one line of the event stream, and the data of one frame, in bytes.
const MaxStreamLine = 1 << 20

// ErrStreamTooLong is returned by StreamReader.Next for a line or a frame's data longer than
// MaxStreamLine: the stream is not one this module's server writes, and reading on would
// hold unbounded memory.
var ErrStreamTooLong = errors.New("event stream: line or frame data longer than 1 MiB")

// appendStreamFrame appends f in the text/event-stream form: an id line, an event line when
// f.Type is set, one data line per line of f.Data when it is not nil, and the blank line
// that ends the frame. The server's data is compact JSON, so one data line. f.ID and f.Type
// must hold no CR or LF, and f.Data no CR: the reader would split them.
func appendStreamFrame(b []byte, f StreamFrame) []byte {
	b = append(b, "id: "...)
	b = append(b, f.ID...)
	b = append(b, '\n')
	if f.Type != "" {
		b = append(b, "event: "...)
		b = append(b, f.Type...)
		b = append(b, '\n')
	}
	if f.Data != nil {
		rest := f.Data
		for {
			line, more, found := bytes.Cut(rest, []byte{'\n'})
			b = append(b, "data: "...)
			b = append(b, line...)
			b = append(b, '\n')
			if !found {
				break
			}
			rest = more
		}
	}
	return append(b, '\n')
}

// StreamReader reads the frames of an event stream, following the text/event-stream rules for
// what this module's server can send: lines end with CR, LF or CRLF; a blank line ends a
// frame; a line starting with ':' is a comment (the server's heartbeats) and is skipped; the
// retry field and unknown fields are ignored; data lines are joined with "\n"; an id holding
// NUL is ignored; a byte-order mark at the very start is dropped. Unlike a browser's
// EventSource it also returns frames that carry an id and no data, since they move the
// client's position. A line, or a frame's data, longer than MaxStreamLine ends the stream
// with ErrStreamTooLong.
type StreamReader struct {
	br               *bufio.Reader
	line             []byte
	lastID           string
	afterCR, started bool
	err              error
}

// NewStreamReader reads frames from r.
func NewStreamReader(r io.Reader) *StreamReader {
	return &StreamReader{br: bufio.NewReaderSize(r, 64<<10)}
}

// Next returns the next frame that has an id or data. At the end of the stream it returns
// io.EOF, or io.ErrUnexpectedEOF when the stream ended inside a frame (which is dropped); any
// error is returned again by every later call.
func (r *StreamReader) Next() (StreamFrame, error) {
	if r.err != nil {
		return StreamFrame{}, r.err
	}
	var (
		typ            string
		data           []byte
		hasID, hasData bool
	)
	for {
		line, err := r.readLine()
		if err != nil {
			if errors.Is(err, io.EOF) && (hasID || hasData || typ != "" || len(line) > 0) {
				err = io.ErrUnexpectedEOF
			}
			r.err = err
			return StreamFrame{}, err
		}
		if len(line) == 0 {
			if hasID || hasData {
				if hasData && data == nil {
					data = []byte{}
				}
				return StreamFrame{ID: r.lastID, Type: typ, Data: data}, nil
			}
			typ = "" // a frame of comments, a retry, or an event line alone: nothing to return
			continue
		}
		if line[0] == ':' {
			continue
		}
		field, value := line, []byte(nil)
		if i := bytes.IndexByte(line, ':'); i >= 0 {
			field, value = line[:i], line[i+1:]
			if len(value) > 0 && value[0] == ' ' {
				value = value[1:]
			}
		}
		switch string(field) {
		case "event":
			typ = string(value)
		case "data":
			if hasData {
				data = append(data, '\n')
			}
			if len(data)+len(value) > MaxStreamLine {
				r.err = fmt.Errorf("%w (a frame's data)", ErrStreamTooLong)
				return StreamFrame{}, r.err
			}
			data = append(data, value...)
			hasData = true
		case "id":
			if bytes.IndexByte(value, 0) < 0 {
				r.lastID = string(value)
				hasID = true
			}
		}
	}
}

// readLine returns the next line without its end; the slice is valid until the next call. A
// CR ends a line at once (waiting for a possible LF would stall a stream whose lines end in
// CR); an LF right after it is then skipped as the second half of a CRLF.
func (r *StreamReader) readLine() ([]byte, error) {
	r.line = r.line[:0]
	for {
		if r.br.Buffered() == 0 {
			if _, err := r.br.Peek(1); err != nil {
				if errors.Is(err, io.EOF) && len(r.line) > 0 {
					return r.line, io.ErrUnexpectedEOF
				}
				return r.line, err
			}
		}
		chunk, _ := r.br.Peek(r.br.Buffered())
		if r.afterCR {
			r.afterCR = false
			if chunk[0] == '\n' {
				_, _ = r.br.Discard(1)
				continue
			}
		}
		i := bytes.IndexAny(chunk, "\r\n")
		part := chunk
		if i >= 0 {
			part = chunk[:i]
		}
		if len(r.line)+len(part) > MaxStreamLine {
			return nil, fmt.Errorf("%w (a line)", ErrStreamTooLong)
		}
		r.line = append(r.line, part...)
		if i < 0 {
			_, _ = r.br.Discard(len(chunk))
			continue
		}
		r.afterCR = chunk[i] == '\r'
		_, _ = r.br.Discard(i + 1)
		if !r.started {
			r.started = true
			r.line = bytes.TrimPrefix(r.line, []byte("\xEF\xBB\xBF"))
		}
		return r.line, nil
	}
}

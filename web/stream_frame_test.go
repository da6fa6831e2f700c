package web

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"
	"testing/iotest"

	"fusion/outbox"
)

// readAll reads every frame of s, through a reader that returns one byte per Read when
// oneByte is set (so that every line end falls on a buffer boundary somewhere).
func readAll(s string, oneByte bool) ([]StreamFrame, error) {
	var in io.Reader = strings.NewReader(s)
	if oneByte {
		in = iotest.OneByteReader(in)
	}
	r := NewStreamReader(in)
	var out []StreamFrame
	for {
		f, err := r.Next()
		if err != nil {
			return out, err
		}
		out = append(out, f)
	}
}

func TestStreamReaderFollowsTheEventStreamRules(t *testing.T) {
	in := "\xEF\xBB\xBFretry: 2000\r\n: observing task:deleted\r\n\r\n" + // a BOM, CRLF, a frame of comments only
		"id: 1.abc.0\r\r" + // CR line ends: an ID-only frame
		"id:1.abc.1\nevent: task:deleted\ndata: {\"a\":1}\n\n" + // no space after the colon
		": keep-alive\n\n" +
		"event: reset\ndata: one\ndata\ndata: two\nunknown: x\n\n" + // no id: keeps the last one; data joined
		"id: bad\x00id\ndata: z\n\n" + // an id with NUL is ignored
		"event: lonely\n\n" + // neither id nor data: nothing
		"id\n\n" // an empty id
	for _, oneByte := range []bool{false, true} {
		got, err := readAll(in, oneByte)
		if !errors.Is(err, io.EOF) {
			t.Fatalf("oneByte=%v: %v", oneByte, err)
		}
		want := []StreamFrame{
			{ID: "1.abc.0"},
			{ID: "1.abc.1", Type: outbox.EventTypeTaskDeleted, Data: []byte(`{"a":1}`)},
			{ID: "1.abc.1", Type: SSEResetEvent, Data: []byte("one\n\ntwo")},
			{ID: "1.abc.1", Data: []byte("z")},
			{ID: ""},
		}
		if !framesEqual(got, want) {
			t.Fatalf("oneByte=%v:\n got %q\nwant %q", oneByte, got, want)
		}
	}

	// A stream that ends inside a frame: the frame is dropped, and the end is unexpected.
	got, err := readAll("id: 1\n\nid: 2\ndata: x\n", false)
	if !errors.Is(err, io.ErrUnexpectedEOF) || len(got) != 1 {
		t.Fatalf("got %q, %v", got, err)
	}
	if _, err := readAll("id: 1\n\nid: 2", false); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Fatalf("a partial line: %v", err)
	}

	// Bounded lines and frames, and the error sticks.
	r := NewStreamReader(strings.NewReader("data: " + strings.Repeat("x", MaxStreamLine) + "\n\n"))
	if _, err := r.Next(); !errors.Is(err, ErrStreamTooLong) {
		t.Fatalf("a long line: %v", err)
	}
	if _, err := r.Next(); !errors.Is(err, ErrStreamTooLong) {
		t.Fatalf("the error is not sticky: %v", err)
	}
	half := "data: " + strings.Repeat("x", MaxStreamLine/2) + "\n"
	if _, err := readAll(half+half+half+"\n", false); !errors.Is(err, ErrStreamTooLong) {
		t.Fatalf("a long frame: %v", err)
	}
}

func framesEqual(a, b []StreamFrame) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].ID != b[i].ID || a[i].Type != b[i].Type || !bytes.Equal(a[i].Data, b[i].Data) || (a[i].Data == nil) != (b[i].Data == nil) {
			return false
		}
	}
	return true
}

// FuzzStreamReader: the reader never panics and holds no more than MaxStreamLine of a frame,
// whatever it is sent; and what appendStreamFrame writes reads back as the same frames,
// whatever the line ends, the heartbeats between frames, and the reads' sizes.
func FuzzStreamReader(f *testing.F) {
	f.Add("1.82f7302c.3.7", outbox.EventTypeTaskDeleted, `{"projectId":"p","sequence":4}`, "1.82f7302c.4.7", "", "", uint8(0))
	f.Add("1.82f7302c.0", SSEResetEvent, `{"projects":["p"],"reason":"too_far_behind"}`, "x", "message", "a\n\nb\n", uint8(7))
	f.Add("", "", "", ":", ":", "\x00", uint8(255))
	f.Add("id\r\n", "ev\rx", "data\rcr", "\xEF\xBB\xBF", "", "", uint8(3))
	f.Fuzz(func(t *testing.T, id1, typ1, data1, id2, typ2, data2 string, mode uint8) {
		// Arbitrary input: no panic, bounded frames.
		for _, raw := range []string{id1 + typ1 + data1, id2 + "\n" + typ2 + "\r" + data2 + "\n\n"} {
			frames, err := readAll(raw, mode&1 != 0)
			if err == nil {
				t.Fatal("readAll ended without an error")
			}
			for _, fr := range frames {
				if len(fr.Data) > MaxStreamLine || strings.ContainsAny(fr.ID, "\r\n\x00") || strings.ContainsAny(fr.Type, "\r\n") {
					t.Fatalf("%q read as %q", raw, fr)
				}
			}
		}

		// Round trip, for frames within appendStreamFrame's contract.
		frames := []StreamFrame{{ID: id1, Type: typ1}, {ID: id2, Type: typ2}}
		if mode&2 != 0 {
			frames[0].Data = []byte(data1)
		}
		if mode&4 != 0 {
			frames[1].Data = []byte(data2)
		}
		for _, fr := range frames {
			if strings.ContainsAny(fr.ID, "\r\n\x00") || strings.ContainsAny(fr.Type, "\r\n") || bytes.IndexByte(fr.Data, '\r') >= 0 {
				return
			}
		}
		var b []byte
		if mode&8 != 0 {
			b = append(b, "\xEF\xBB\xBF"...)
		}
		for i, fr := range frames {
			if mode&16 != 0 {
				b = append(b, ": keep-alive\n\n"...)
			}
			if mode&32 != 0 && i == 0 {
				b = append(b, "retry: 2000\n"...)
			}
			b = appendStreamFrame(b, fr)
		}
		s := string(b)
		switch mode >> 6 {
		case 1:
			s = strings.ReplaceAll(s, "\n", "\r\n")
		case 2:
			s = strings.ReplaceAll(s, "\n", "\r")
		}
		got, err := readAll(s, mode&1 != 0)
		if !errors.Is(err, io.EOF) {
			t.Fatalf("%q: %v", s, err)
		}
		if !framesEqual(got, frames) {
			t.Fatalf("%q\n read as %q\n wrote %q", s, got, frames)
		}
	})
}

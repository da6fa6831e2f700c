package web

import (
	"errors"
	"hash/fnv"
	"strconv"
	"strings"
)

// The event stream's IDs carry a client's whole position: a browser's EventSource sends back
// only the last ID it saw, and one stream carries many projects, so an ID naming one event
// ("alpha:17") would lose the positions of every other project on reconnect. An ID is
//
//	1.<fingerprint>.<seq>.<seq>...
//
// the format version, an 8-hex-digit FNV-1a hash of the stream's sorted project list, and
// the last sequence sent for each project in that order, in base 36. The project names are
// not repeated: they are in the stream's URL, which an EventSource reuses when it reconnects,
// and the fingerprint catches an ID presented to a different list. Forty projects at
// sequences near a million cost about 200 bytes per event, and the handler keeps no state per
// client between connections, so a reconnect may land on any process serving the stream.

const streamIDVersion = "1"

// errStreamID is returned for a Last-Event-ID that does not describe this stream.
var errStreamID = errors.New("last event ID does not describe this stream")

// streamFingerprint identifies a sorted project list inside stream IDs.
func streamFingerprint(projects []string) string {
	h := fnv.New32a()
	for _, p := range projects {
		_, _ = h.Write([]byte(p))
		_, _ = h.Write([]byte{0})
	}
	var b [8]byte
	s := strconv.AppendUint(b[:0], uint64(h.Sum32()), 16)
	return strings.Repeat("0", 8-len(s)) + string(s)
}

// appendStreamID appends the ID of positions to b.
func appendStreamID(b []byte, fingerprint string, positions []int64) []byte {
	b = append(b, streamIDVersion...)
	b = append(b, '.')
	b = append(b, fingerprint...)
	for _, p := range positions {
		b = append(b, '.')
		b = strconv.AppendInt(b, p, 36)
	}
	return b
}

// maxStreamIDLen bounds the ID of a stream of n projects: longer input is refused before it is
// split, so a hostile header costs nothing.
func maxStreamIDLen(n int) int { return len(streamIDVersion) + 1 + 8 + n*14 }

// parseStreamID reads the positions of an ID for the stream of n projects with fingerprint.
func parseStreamID(id, fingerprint string, n int) ([]int64, error) {
	if len(id) > maxStreamIDLen(n) {
		return nil, errStreamID
	}
	parts := strings.Split(id, ".")
	if len(parts) != n+2 || parts[0] != streamIDVersion || parts[1] != fingerprint {
		return nil, errStreamID
	}
	out := make([]int64, n)
	for i, s := range parts[2:] {
		v, err := strconv.ParseInt(s, 36, 64)
		if err != nil || v < 0 || s != strconv.FormatInt(v, 36) {
			return nil, errStreamID
		}
		out[i] = v
	}
	return out, nil
}

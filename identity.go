package outbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"regexp"
	"strings"
	"unicode"
	"unicode/utf8"
)

// maxIDLen bounds project, consumer and writer identifiers.
const maxIDLen = 128

// maxConsumerIDLen leaves room in a lease owner (an identity, "@" and 16 hex digits, checked
// by the database at maxIDLen) for the per-boot suffix.
const maxConsumerIDLen = maxIDLen - 17

// idPattern is the form of project and consumer identifiers; the database checks it too.
var idPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._:-]*$`)

// ConsumerID is a durable consumer identity: the key of a consumer's cursors, leases and
// dead letters. It must come from a persisted setting (see ResolveConsumerID), never from a
// hostname, process ID, clock or random source, or a restart would orphan its cursor.
type ConsumerID string

// ParseConsumerID validates s as a consumer identity: 1 to 111 characters from
// [A-Za-z0-9._:-], starting with a letter or digit (the lease owner, the ID plus a 17-byte
// per-boot suffix, must fit 128). Surrounding whitespace is an error, not something to trim:
// a setting that differs from what the operator sees is a trap.
func ParseConsumerID(s string) (ConsumerID, error) {
	if err := checkID("consumer ID", s); err != nil {
		return "", err
	}
	if len(s) > maxConsumerIDLen {
		return "", fmt.Errorf("consumer ID is %d bytes long, the limit is %d (its lease owner adds 17)", len(s), maxConsumerIDLen)
	}
	return ConsumerID(s), nil
}

// ValidateProjectID checks a project identifier with the same rules as a consumer ID.
func ValidateProjectID(s string) error { return checkID("project ID", s) }

func checkID(what, s string) error {
	switch {
	case s == "":
		return fmt.Errorf("%s is empty", what)
	case len(s) > maxIDLen:
		return fmt.Errorf("%s is %d bytes long, the limit is %d", what, len(s), maxIDLen)
	case strings.IndexFunc(s, unicode.IsSpace) >= 0:
		return fmt.Errorf("%s %q contains whitespace", what, s)
	case !idPattern.MatchString(s):
		return fmt.Errorf("%s %q may only use letters, digits and . _ : - and must start with a letter or digit", what, s)
	}
	return nil
}

// validateTaskID accepts any printable identifier up to 256 bytes without whitespace.
func validateTaskID(field, s string) error {
	switch {
	case s == "":
		return invalid(field, "is empty")
	case len(s) > 256:
		return invalid(field, "is %d bytes long, the limit is 256", len(s))
	case !utf8.ValidString(s):
		return invalid(field, "is not valid UTF-8")
	case strings.IndexFunc(s, func(r rune) bool { return unicode.IsSpace(r) || !unicode.IsPrint(r) }) >= 0:
		return invalid(field, "%q contains whitespace or control characters", s)
	}
	return nil
}

// ResolveConsumerID reads the consumer identity from the named persisted field. It returns
// ok=false with no error when the field is absent or empty: observation stays disabled and the
// caller says so once. A present but invalid value is an error naming the field.
func ResolveConsumerID(ctx context.Context, settings Settings, field string) (id ConsumerID, ok bool, err error) {
	if settings == nil {
		return "", false, nil
	}
	v, found, err := settings.Setting(ctx, field)
	if err != nil {
		return "", false, fmt.Errorf("read setting %q: %w", field, err)
	}
	if !found || v == "" {
		return "", false, nil
	}
	id, err = ParseConsumerID(v)
	if err != nil {
		return "", false, &ValidationError{Field: field, Reason: err.Error()}
	}
	return id, true, nil
}

// newWriterProcessID returns a per-boot origin label for events this process writes, such as
// "engine-3f9c0a1b2c4d5e6f". It is only a label: it is never a consumer identity.
func newWriterProcessID(label string) (string, error) {
	if label == "" {
		label = "writer"
	}
	if err := checkID("writer label", label); err != nil {
		return "", err
	}
	if len(label) > maxIDLen-17 {
		return "", fmt.Errorf("writer label is %d bytes long, the limit is %d", len(label), maxIDLen-17)
	}
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("writer process ID: %w", err)
	}
	return label + "-" + hex.EncodeToString(b[:]), nil
}

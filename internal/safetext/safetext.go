// Package safetext makes text from outside fit to show a person: strings read from the
// database escaped before they reach a terminal, and connection-string errors reduced to a
// reason that cannot repeat a password.
package safetext

import (
	"errors"
	"net/url"
	"strconv"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgconn"
)

// Escape returns s with every character a terminal could act on, or that would hide what
// follows it, written as a Go escape: control characters (\r, \x1b, ...), format characters
// such as the bidirectional overrides (\u202e), other non-printable runes and invalid UTF-8
// bytes. A backslash is doubled, so an escape in the output always means an escaped character.
// Printable text, spaces included, is unchanged, so an ordinary identifier reads as itself.
func Escape(s string) string {
	clean := true
	for _, r := range s {
		if r == '\\' || r == utf8.RuneError || !unicode.IsPrint(r) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		if r == '\\' {
			b.WriteString(`\\`)
		} else {
			writeRune(&b, s[i:i+n], r, n)
		}
		i += n
	}
	return b.String()
}

// Printable returns s with every non-printable character written as a Go escape, like Escape,
// but leaves backslashes alone: for whole messages, whose quoted parts (%q) are escaped
// already and would read worse doubled. Newlines are escaped too; a message is one line.
func Printable(s string) string {
	clean := true
	for _, r := range s {
		if r == utf8.RuneError || !unicode.IsPrint(r) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); {
		r, n := utf8.DecodeRuneInString(s[i:])
		writeRune(&b, s[i:i+n], r, n)
		i += n
	}
	return b.String()
}

func writeRune(b *strings.Builder, raw string, r rune, n int) {
	switch {
	case r == utf8.RuneError && n <= 1:
		b.WriteString(`\x`)
		b.WriteString(strconv.FormatUint(uint64(raw[0])|0x100, 16)[1:])
	case unicode.IsPrint(r):
		b.WriteString(raw)
	default:
		q := strconv.QuoteRune(r) // '\x1b', '\u202e', ...
		b.WriteString(q[1 : len(q)-1])
	}
}

// JSON rewrites every non-printable character of encoded JSON (which encoding/json leaves as
// it is, the bidirectional overrides among them) as a \u escape, so that JSON shown on a
// terminal is as safe as the tables. The document means the same: outside strings JSON holds
// only printable characters and whitespace, which are kept.
func JSON(doc []byte) []byte {
	out := make([]byte, 0, len(doc))
	for i := 0; i < len(doc); {
		r, n := utf8.DecodeRune(doc[i:])
		switch {
		case r == '\n' || r == '\t' || r == '\r' || r == ' ' || (r != utf8.RuneError && unicode.IsPrint(r)):
			out = append(out, doc[i:i+n]...)
		case r == utf8.RuneError && n <= 1:
			out = append(out, []byte(`\ufffd`)...)
		case r > 0xffff:
			r1, r2 := utf16.EncodeRune(r)
			out = append(out, []byte(`\u`+hex4(r1)+`\u`+hex4(r2))...)
		default:
			out = append(out, []byte(`\u`+hex4(r))...)
		}
		i += n
	}
	return out
}

func hex4(r rune) string { return strconv.FormatUint(uint64(r)|0x10000, 16)[1:] }

// DSNParseReason says why a connection string does not parse, from a fixed set of sentences:
// never a part of the string, which may hold a password. pgx redacts the password only on a
// best-effort basis (a password with a space leaks its second word into the message), so its
// message is not shown at all.
func DSNParseReason(err error) string {
	var ue *url.Error
	if errors.As(err, &ue) {
		return "it is not a valid URL (percent-encode special characters, spaces included, in the user and password)"
	}
	var pe *pgconn.ParseConfigError
	if !errors.As(err, &pe) {
		return "it is not a PostgreSQL URL or key=value connection string"
	}
	// Only the part after the (redacted) string says what is wrong; it is matched, never shown.
	msg := pe.Error()
	if i := strings.LastIndex(msg, "`: "); i >= 0 {
		msg = msg[i+len("`: "):]
	}
	switch {
	case strings.Contains(msg, "failed to parse as URL"):
		return "it is not a valid URL (percent-encode special characters, spaces included, in the user and password)"
	case strings.Contains(msg, "failed to parse as keyword/value"), strings.Contains(msg, "failed to parse as DSN"):
		return "it is not valid key=value syntax (quote a value with spaces in single quotes, and escape a quote or backslash in it with a backslash)"
	case strings.Contains(msg, "pool_"):
		return "a pool_ setting (pool_max_conns, ...) is not valid"
	case strings.Contains(msg, "invalid port"):
		return "the port is not a number from 1 to 65535"
	case strings.Contains(msg, "TLS"), strings.Contains(msg, "sslmode"), strings.Contains(msg, "ssl"):
		return "its TLS settings (sslmode, sslcert, sslkey, sslrootcert) are invalid"
	case strings.Contains(msg, "timeout"):
		return "connect_timeout is not a whole number of seconds"
	}
	return "it is not a PostgreSQL URL or key=value connection string"
}

package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"fusion/outbox"
	"fusion/outbox/internal/safetext"
)

// usageError is bad usage: the command line is wrong, and nothing was done. Exit code 2.
type usageError struct{ err error }

func (e *usageError) Error() string { return e.err.Error() }
func (e *usageError) Unwrap() error { return e.err }

func usageErrorf(format string, args ...any) error {
	return &usageError{fmt.Errorf(format, args...)}
}

// failure is a command that was understood but did not succeed. Exit code 1.
type failure struct{ err error }

func (e *failure) Error() string { return e.err.Error() }
func (e *failure) Unwrap() error { return e.err }

// describe turns a failure into the sentence printed on stderr, with what to do next when we
// know it.
func (a *app) describe(err error) string {
	msg := err.Error()
	var pgErr *pgconn.PgError
	switch {
	case errors.Is(err, outbox.ErrSchemaBehind):
		return msg + "; run `outboxctl migrate` as the schema owner to apply the missing migrations"
	case errors.Is(err, outbox.ErrSchemaAhead):
		return msg + "; this outboxctl is older than the schema: use the build that migrated the database"
	case errors.Is(err, outbox.ErrSchemaDrift):
		return msg + "; an object the isolation rests on was changed by hand: restore it as the migrations made it (see docs/operations.md, \"Roles and grants\")"
	case errors.Is(err, outbox.ErrSchemaChecksum):
		return msg + "; the database was migrated by a different build: find out which before changing anything"
	case errors.Is(err, context.DeadlineExceeded):
		return fmt.Sprintf("%s (the --timeout of %s ran out; raise it for a large database)", msg, a.timeout)
	case errors.As(err, &pgErr) && pgErr.Code == pgerrcode.InsufficientPrivilege:
		return msg + "; this database role lacks a privilege outboxctl needs (see docs/operations.md, \"Roles and grants\")"
	}
	return msg
}

// parseReason says why a DSN does not parse without repeating any of it: it may hold a
// password, which pgx redacts on a best-effort basis only.
func parseReason(err error) string { return safetext.DSNParseReason(err) }

// connectError says which server could not be reached, as whom, and why, on one line.
//
// pgconn's ConnectError wraps an errors.Join of one error per attempt: one per host, and two
// per host under sslmode=prefer (TLS, then plain), each "ADDRESS (HOST): STAGE: CAUSE" where
// CAUSE is often a *net.OpError that names the address again. Printed as is, that is several
// lines (escaped to a literal \n) repeating the socket path and the cause, under a header
// reading database "" when the DSN names none. So each attempt is taken apart and said once,
// and identical attempts are said once.
func connectError(cfg *pgxpool.Config, err error) error {
	c := cfg.ConnConfig
	who := fmt.Sprintf("as user %q", c.User)
	if c.Database != "" {
		who = fmt.Sprintf("to database %q %s", c.Database, who)
	}
	var ce *pgconn.ConnectError
	if !errors.As(err, &ce) || errors.Unwrap(ce) == nil {
		where := c.Host
		if !strings.HasPrefix(where, "/") {
			where = net.JoinHostPort(c.Host, strconv.Itoa(int(c.Port)))
		}
		return &connectFailure{msg: fmt.Sprintf("cannot connect %s at %s: %s", who, where, oneLine(err.Error())), err: err}
	}
	prefix, attempts := splitJoined(errors.Unwrap(ce))
	// Group the causes by address, each said once, in the order pgx tried them.
	var places []string
	causes := map[string][]string{}
	for _, at := range attempts {
		where, what := describeAttempt(at)
		if _, ok := causes[where]; !ok {
			places = append(places, where)
		}
		if !slices.Contains(causes[where], what) {
			causes[where] = append(causes[where], what)
		}
	}
	parts := make([]string, len(places))
	for i, where := range places {
		parts[i] = strings.Join(causes[where], "; ")
		if where != "" {
			parts[i] = "at " + where + ": " + parts[i]
		}
	}
	msg := fmt.Sprintf("cannot connect %s", who)
	if prefix != "" {
		msg += ": " + prefix
	}
	sep := ": "
	if prefix == "" && places[0] != "" {
		sep = " "
	}
	msg += sep + strings.Join(parts, "; ")
	return &connectFailure{msg: msg, err: err}
}

// connectFailure is the rendered connection error; it unwraps to pgx's, so that errors.Is
// still finds a deadline that ran out.
type connectFailure struct {
	msg string
	err error
}

func (e *connectFailure) Error() string { return e.msg }
func (e *connectFailure) Unwrap() error { return e.err }

// splitJoined returns the attempts inside err (an errors.Join, possibly under one wrapper
// such as "hostname resolving error: ") and the wrapper's own words.
func splitJoined(err error) (string, []error) {
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		return "", j.Unwrap()
	}
	if inner := errors.Unwrap(err); inner != nil {
		if j, ok := inner.(interface{ Unwrap() []error }); ok {
			if p, found := strings.CutSuffix(err.Error(), ": "+inner.Error()); found {
				return p, j.Unwrap()
			}
		}
	}
	return "", []error{err}
}

// describeAttempt takes one attempt apart into where it went (empty when the error does not
// say) and what failed there ("STAGE: CAUSE"), naming the address once. pgconn's per-attempt
// type is unexported; its shape is "ADDRESS (HOST): " before the error it unwraps to, and
// that error is "STAGE: " before the cause.
func describeAttempt(err error) (where, what string) {
	stageErr := errors.Unwrap(err)
	if stageErr == nil {
		return "", oneLine(err.Error())
	}
	head, ok := strings.CutSuffix(err.Error(), ": "+stageErr.Error())
	if !ok {
		return "", oneLine(err.Error())
	}
	addr, host := head, ""
	if i := strings.LastIndex(head, " ("); i > 0 && strings.HasSuffix(head, ")") {
		addr, host = head[:i], head[i+2:len(head)-1]
	}
	where = addr
	// A unix socket's address is the directory plus .s.PGSQL.PORT, and an IP address's is
	// itself plus the port: only a resolved host name adds anything.
	if host != "" && !strings.HasPrefix(addr, host) {
		where = fmt.Sprintf("%s (%s)", host, addr)
	}
	what = stageErr.Error()
	if cause := errors.Unwrap(stageErr); cause != nil {
		if stage, ok := strings.CutSuffix(stageErr.Error(), ": "+cause.Error()); ok {
			what = stage + ": " + causeText(cause)
		}
	}
	return oneLine(where), oneLine(what)
}

// causeText drops the address a dial error repeats ("dial unix /tmp/x/.s.PGSQL.5432:
// connect: no such file or directory" becomes "connect: no such file or directory").
func causeText(err error) string {
	var op *net.OpError
	if errors.As(err, &op) && op.Err != nil {
		return op.Err.Error()
	}
	return err.Error()
}

// oneLine folds a multi-line message onto one line.
func oneLine(s string) string {
	return strings.Join(strings.Fields(s), " ")
}

// unknownConsumer is the error for a --consumer that has no cursor where it was looked for.
func (a *app) unknownConsumer() error {
	where := "in any project"
	if a.project != "" {
		where = fmt.Sprintf("in project %q", a.project)
	}
	return fmt.Errorf("%w: consumer %q has no cursor %s", outbox.ErrUnknownConsumer, a.consumer, where)
}

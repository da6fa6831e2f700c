package main

import (
	"context"
	"errors"
	"fmt"

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

// insufficientPrivilege is SQLSTATE 42501.
const insufficientPrivilege = "42501"

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
	case errors.As(err, &pgErr) && pgErr.Code == insufficientPrivilege:
		return msg + "; this database role lacks a privilege outboxctl needs (see docs/operations.md, \"Roles and grants\")"
	}
	return msg
}

// parseReason says why a DSN does not parse without repeating any of it: it may hold a
// password, which pgx redacts on a best-effort basis only.
func parseReason(err error) string { return safetext.DSNParseReason(err) }

// connectError says which server could not be reached, as whom, and why.
func connectError(cfg *pgxpool.Config, err error) error {
	c := cfg.ConnConfig
	where := fmt.Sprintf("database %q on %s:%d as user %q", c.Database, c.Host, c.Port, c.User)
	var ce *pgconn.ConnectError
	if errors.As(err, &ce) {
		if inner := errors.Unwrap(ce); inner != nil {
			err = inner
		}
	}
	return fmt.Errorf("cannot connect to %s: %w", where, err)
}

// unknownConsumer is the error for a --consumer that has no cursor where it was looked for.
func (a *app) unknownConsumer() error {
	where := "in any project"
	if a.project != "" {
		where = fmt.Sprintf("in project %q", a.project)
	}
	return fmt.Errorf("%w: consumer %q has no cursor %s", outbox.ErrUnknownConsumer, a.consumer, where)
}

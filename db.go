package outbox

import (
	"context"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Beginner is what Migrate needs: a pool, a connection, or anything else that begins
// transactions.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// DBTX is the smallest database surface the module needs: a *pgxpool.Pool, a *pgx.Conn and
// a pgx.Tx all satisfy it.
type DBTX interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

package main

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
)

// What the server executed, read from pg_stat_statements (the throwaway cluster loads it with
// track = all, see env.go) for one database. Only the case's own database is read or reset,
// so that other databases on the same server (other cases, parallel tests) do not count.

// statStatements reads pg_stat_statements in the database pool is on; ok is false when the
// extension is not usable there (a -dsn server that does not preload it), and why says what
// failed.
type statStatements struct {
	pool *pgxpool.Pool
	ok   bool
	why  string
}

// openStatStatements creates the extension in pool's database and checks that it can be
// read and reset.
func openStatStatements(ctx context.Context, pool *pgxpool.Pool) *statStatements {
	s := &statStatements{pool: pool}
	if _, err := pool.Exec(ctx, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements"); err != nil {
		s.why = "create extension: " + firstLine(err.Error())
		return s
	}
	if err := s.reset(ctx); err != nil {
		s.why = firstLine(err.Error())
		return s
	}
	s.ok = true
	return s
}

func firstLine(s string) string {
	first, _, _ := strings.Cut(s, "\n")
	return first
}

// resetSQL clears the statistics of this database's statements (all users).
const resetSQL = `SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database WHERE datname = current_database()), 0)`

// reset clears the statistics of this database's statements (all users).
func (s *statStatements) reset(ctx context.Context) error {
	if _, err := s.pool.Exec(ctx, resetSQL); err != nil {
		return fmt.Errorf("reset pg_stat_statements: %w", err)
	}
	return nil
}

// numberingSQL sums the top-level statements that call the two functions that number the
// stream since schema 18: lifecycle_outbox_tick, which counts each tick's events per project
// (the consumers' elected ticker calls it, a fallback ticker and Tick too), and
// lifecycle_outbox_read, which ranks a tick's events as it returns them (every read of a
// consumer, a replay or a status goes through it). exec_ms is pg_stat_statements'
// total_exec_time, time in the executor with lock and I/O waits included. The statements the
// functions run inside are tracked too (track = all) and are part of that time; lock_ms sums
// the one among them that takes the tick table's lock (LOCK TABLE lifecycle_tick ...), where
// two tickers wait for each other: nearly all of its time is waiting. It is matched by its
// text, so it reads 0 if the function changes. It is a lower bound: PostgreSQL 15's
// pg_stat_statements counts a utility statement of a function's cached plan on its first run
// in a session only (seen there: five ticks on one connection, one LOCK counted). A statement
// calls the ticker or the reader function when its text names it.
const numberingSQL = `
SELECT coalesce(sum(total_exec_time) FILTER (WHERE toplevel AND (query LIKE '%lifecycle_outbox_tick(%' OR query LIKE '%lifecycle_outbox_read(%')), 0),
       coalesce(sum(calls) FILTER (WHERE toplevel AND (query LIKE '%lifecycle_outbox_tick(%' OR query LIKE '%lifecycle_outbox_read(%')), 0)::bigint,
       coalesce(sum(total_exec_time) FILTER (WHERE NOT toplevel AND query ILIKE 'lock table lifecycle_tick %'), 0)
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())`

// numberingStats is what numbering cost since the last reset.
type numberingStats struct {
	execMS, lockMS float64
	calls          int64
}

func (s *statStatements) numbering(ctx context.Context) (numberingStats, error) {
	var st numberingStats
	if err := s.pool.QueryRow(ctx, numberingSQL).Scan(&st.execMS, &st.calls, &st.lockMS); err != nil {
		return st, fmt.Errorf("read pg_stat_statements: %w", err)
	}
	return st, nil
}

// callsSQL counts the statements executed in this database, top-level (what clients sent)
// and all (with those that functions ran), leaving out the bench's own reads of the view.
const callsSQL = `
SELECT coalesce(sum(calls) FILTER (WHERE toplevel), 0)::bigint, coalesce(sum(calls), 0)::bigint
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database()) AND query NOT LIKE '%pg_stat_statements%'`

// calls returns the statements executed in this database so far (since the last reset):
// top-level ones and all.
func (s *statStatements) calls(ctx context.Context) (toplevel, all int64, err error) {
	if err := s.pool.QueryRow(ctx, callsSQL).Scan(&toplevel, &all); err != nil {
		return 0, 0, fmt.Errorf("read pg_stat_statements: %w", err)
	}
	return toplevel, all, nil
}

// xacts is the fallback without the extension: transactions committed and rolled back in this
// database so far, from pg_stat_database. Backends report them when they go idle, at most
// once a second (and idle ones within about 10 s), so a short window is only approximate, and
// the bench's own two reads are included.
func xacts(ctx context.Context, pool *pgxpool.Pool) (int64, error) {
	var n int64
	err := pool.QueryRow(ctx, `SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()`).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("read pg_stat_database: %w", err)
	}
	return n, nil
}

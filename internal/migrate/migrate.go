// Package migrate applies a numbered, embedded set of SQL migrations with bookkeeping.
//
// Files are named NNNN_name.up.sql; versions start at 1 and must be contiguous. Each migration
// and its bookkeeping row commit in one transaction that first takes a fixed transaction-level
// advisory lock, so two processes applying the same set at once are safe: one applies, the
// other finds the work done.
package migrate

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgerrcode"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Migration is one numbered schema change.
type Migration struct {
	Version  int    // 1, 2, 3, ... with no gaps
	Name     string // from the file name, e.g. "outbox"
	SQL      string // the statements, run as one simple-protocol batch
	Checksum string // hex SHA-256 of SQL
}

var (
	// ErrBehind means the database lacks migrations this build knows.
	ErrBehind = errors.New("database schema is behind this build")
	// ErrAhead means the database has migrations this build does not know.
	ErrAhead = errors.New("database schema is ahead of this build")
	// ErrChecksum means an applied migration's text differs from this build's.
	ErrChecksum = errors.New("applied migration does not match this build")
)

var fileName = regexp.MustCompile(`^(\d{4})_([a-z0-9_]+)\.up\.sql$`)

// Load reads the migrations in dir of fsys and checks their numbering.
func Load(fsys fs.FS, dir string) ([]Migration, error) {
	entries, err := fs.ReadDir(fsys, dir)
	if err != nil {
		return nil, fmt.Errorf("read migrations: %w", err)
	}
	var out []Migration
	for _, e := range entries {
		if e.IsDir() {
			continue
		}
		m := fileName.FindStringSubmatch(e.Name())
		if m == nil {
			return nil, fmt.Errorf("migration file %q is not named NNNN_name.up.sql", e.Name())
		}
		body, err := fs.ReadFile(fsys, path.Join(dir, e.Name()))
		if err != nil {
			return nil, fmt.Errorf("read migration %s: %w", e.Name(), err)
		}
		v, _ := strconv.Atoi(m[1])
		sum := sha256.Sum256(body)
		out = append(out, Migration{Version: v, Name: m[2], SQL: string(body), Checksum: hex.EncodeToString(sum[:])})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	for i, m := range out {
		if m.Version != i+1 {
			return nil, fmt.Errorf("migrations are not contiguous: expected version %d, found %04d_%s", i+1, m.Version, m.Name)
		}
	}
	if len(out) == 0 {
		return nil, errors.New("no migrations found")
	}
	return out, nil
}

// Set is a list of migrations with the table that records them and the lock that guards them.
type Set struct {
	// Table is the bookkeeping table, e.g. lifecycle_outbox_schema. A statement cannot bind a
	// table name: the statements quote it as an identifier.
	Table   string
	LockKey int64 // pg_advisory_xact_lock key, fixed per set
	// LockTimeout bounds each wait of a migration's statements for a table lock (SET LOCAL
	// lock_timeout), so that a migration queued behind a long transaction fails instead of
	// holding every other statement on that table in the queue behind its own lock request.
	// Zero leaves the server's setting.
	LockTimeout time.Duration
	Migrations  []Migration
}

// Beginner is what Apply needs: a pool, a connection, or anything else that begins transactions.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// Querier is what Verify needs.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
}

// Version is the newest version in the set.
func (s Set) Version() int { return len(s.Migrations) }

// Applied is one bookkeeping row.
type Applied struct {
	Version   int
	Name      string
	Checksum  string
	AppliedAt time.Time
}

// Apply brings the database up to the set's newest version and returns the versions it
// applied (none when another process got there first).
func (s Set) Apply(ctx context.Context, db Beginner) ([]int, error) {
	var applied []int
	for {
		v, err := s.applyNext(ctx, db)
		if err != nil {
			return applied, err
		}
		if v == 0 {
			return applied, nil
		}
		applied = append(applied, v)
	}
}

// ApplyThrough is Apply stopped at version target; tests use it to exercise upgrade paths.
func (s Set) ApplyThrough(ctx context.Context, db Beginner, target int) ([]int, error) {
	if target < 0 || target > len(s.Migrations) {
		return nil, fmt.Errorf("target version %d out of range 0..%d", target, len(s.Migrations))
	}
	t := s
	t.Migrations = s.Migrations[:target]
	return t.Apply(ctx, db)
}

// applyNext applies the lowest missing migration in its own transaction and returns its
// version, or 0 when nothing is missing.
func (s Set) applyNext(ctx context.Context, db Beginner) (int, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return 0, fmt.Errorf("begin migration: %w", err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if s.LockTimeout > 0 {
		// Local to this transaction: nothing stays behind on a pooled connection.
		if _, err := tx.Exec(ctx, `SELECT pg_catalog.set_config('lock_timeout', $1, true)`,
			strconv.FormatInt(s.LockTimeout.Milliseconds(), 10)); err != nil {
			return 0, fmt.Errorf("set migration lock timeout: %w", err)
		}
	}
	if err := s.lock(ctx, tx); err != nil {
		return 0, err
	}
	if _, err := tx.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+pgx.Identifier{s.Table}.Sanitize()+` (
		version    integer PRIMARY KEY CHECK (version > 0),
		name       text NOT NULL,
		checksum   text NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT pg_catalog.now()
	)`); err != nil {
		return 0, fmt.Errorf("create %s: %w", s.Table, err)
	}
	rows, err := s.read(ctx, tx)
	if err != nil {
		return 0, err
	}
	if err := s.compare(rows, true); err != nil {
		return 0, err
	}
	if len(rows) == len(s.Migrations) {
		return 0, tx.Commit(ctx)
	}
	m := s.Migrations[len(rows)]
	if _, err := tx.Exec(ctx, m.SQL); err != nil {
		return 0, fmt.Errorf("apply migration %04d_%s: %w", m.Version, m.Name, err)
	}
	if err := MarkAppliedTx(ctx, tx, s.Table, m); err != nil {
		return 0, err
	}
	if err := tx.Commit(ctx); err != nil {
		return 0, fmt.Errorf("commit migration %04d_%s: %w", m.Version, m.Name, err)
	}
	return m.Version, nil
}

// tryLockSQL takes the set's lock if it is free. Polling it, rather than waiting in
// pg_advisory_xact_lock, lets Apply say who holds the lock when its context ends.
const tryLockSQL = `SELECT pg_catalog.pg_try_advisory_xact_lock($1)`

// lockHolderSQL names the sessions holding the advisory lock with key ($1 << 32 | $2) in this
// database. pg_locks and pg_stat_activity's pid, user and application name are readable by
// every role.
const lockHolderSQL = `
SELECT l.pid, coalesce(a.usename::text, ''), coalesce(a.application_name, '')
FROM pg_catalog.pg_locks l
LEFT JOIN pg_catalog.pg_stat_activity a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT d.oid FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database())
  AND l.classid = $1::bigint::oid AND l.objid = $2::bigint::oid
ORDER BY l.pid`

// Holder is a session holding the migration lock.
type Holder struct {
	PID             int32
	User            string
	ApplicationName string
}

func (h Holder) String() string {
	return fmt.Sprintf("pid %d (user %q, application %q)", h.PID, h.User, h.ApplicationName)
}

// lock takes the set's advisory lock in tx, polling until it is free or ctx ends. The error for
// an ended context names the sessions that held the lock at the last try: the key is fixed and
// any role can take it, so an operator needs to know whom to ask (or which pid to end).
func (s Set) lock(ctx context.Context, tx pgx.Tx) error {
	wait := 5 * time.Millisecond
	var holders []Holder
	for {
		var ok bool
		if err := tx.QueryRow(ctx, tryLockSQL, s.LockKey).Scan(&ok); err != nil {
			return lockError(err, holders)
		}
		if ok {
			return nil
		}
		h, err := s.holders(ctx, tx)
		if err != nil {
			return lockError(err, holders)
		}
		holders = h
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return lockError(ctx.Err(), holders)
		case <-t.C:
		}
		wait = min(wait*2, 250*time.Millisecond)
	}
}

func (s Set) holders(ctx context.Context, tx pgx.Tx) ([]Holder, error) {
	key := uint64(s.LockKey)
	rows, err := tx.Query(ctx, lockHolderSQL, int64(key>>32), int64(key&0xffffffff))
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowToStructByPos[Holder])
}

func lockError(err error, holders []Holder) error {
	if len(holders) == 0 {
		return fmt.Errorf("take migration lock: %w", err)
	}
	names := make([]string, len(holders))
	for i, h := range holders {
		names[i] = h.String()
	}
	return fmt.Errorf("take migration lock: %w; the lock is held by %s", err, strings.Join(names, ", "))
}

// MarkAppliedTx writes the bookkeeping row for m, for hosts that run the SQL with their own
// applier. It must run in the transaction that applied m.
func MarkAppliedTx(ctx context.Context, tx pgx.Tx, table string, m Migration) error {
	_, err := tx.Exec(ctx, `INSERT INTO `+pgx.Identifier{table}.Sanitize()+` (version, name, checksum) VALUES ($1, $2, $3)`,
		m.Version, m.Name, m.Checksum)
	if err != nil {
		return fmt.Errorf("record migration %04d_%s: %w", m.Version, m.Name, err)
	}
	return nil
}

// Verify checks that the database is at exactly this set's version with unchanged checksums.
// It only reads, so a role without DDL rights can run it.
func (s Set) Verify(ctx context.Context, db Querier) error {
	rows, err := s.read(ctx, db)
	if err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == pgerrcode.UndefinedTable {
			return fmt.Errorf("%w: no %s table (version 0, this build needs %d)", ErrBehind, s.Table, len(s.Migrations))
		}
		return err
	}
	return s.compare(rows, false)
}

// Status returns the bookkeeping rows in version order.
func (s Set) Status(ctx context.Context, db Querier) ([]Applied, error) {
	return s.read(ctx, db)
}

func (s Set) read(ctx context.Context, db Querier) ([]Applied, error) {
	rows, err := db.Query(ctx, `SELECT version, name, checksum, applied_at FROM `+pgx.Identifier{s.Table}.Sanitize()+` ORDER BY version`)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", s.Table, err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[Applied])
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", s.Table, err)
	}
	return out, nil
}

// compare checks the applied rows against the set. With allowBehind it accepts a prefix.
func (s Set) compare(rows []Applied, allowBehind bool) error {
	for i, r := range rows {
		if r.Version != i+1 {
			return fmt.Errorf("%s has a gap: version %d recorded where %d was expected", s.Table, r.Version, i+1)
		}
		if i >= len(s.Migrations) {
			return fmt.Errorf("%w: database has version %d (%s), this build knows up to %d",
				ErrAhead, rows[len(rows)-1].Version, rows[len(rows)-1].Name, len(s.Migrations))
		}
		if m := s.Migrations[i]; r.Checksum != m.Checksum {
			return fmt.Errorf("%w: %04d_%s was applied with checksum %.12s, this build has %.12s",
				ErrChecksum, m.Version, m.Name, r.Checksum, m.Checksum)
		}
	}
	if !allowBehind && len(rows) < len(s.Migrations) {
		return fmt.Errorf("%w: database has version %d, this build needs %d", ErrBehind, len(rows), len(s.Migrations))
	}
	return nil
}

// Package schema holds the reference task store's own migrations, kept apart from the outbox
// module's so that the module never owns host tables. A real host has a migration tool of its
// own; this small applier stands in for it (numbered embedded files, one transaction each
// under an advisory lock, a bookkeeping row with the file's checksum).
package schema

import (
	"context"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"path"
	"regexp"
	"sort"
	"strconv"

	"github.com/jackc/pgx/v5"

	"fusion/outbox"
)

//go:embed migrations/*.sql
var files embed.FS

// ErrBehind means the database lacks migrations of the task store.
var ErrBehind = errors.New("taskstore schema is behind this build")

// lockKey is the advisory lock every applier of these migrations takes ("taskstor").
const lockKey int64 = 0x7461736b73746f72

type migration struct {
	version        int
	name, sql, sum string
}

var fileName = regexp.MustCompile(`^(\d{4})_([a-z0-9_]+)\.up\.sql$`)

var migrations = func() []migration {
	entries, err := fs.ReadDir(files, "migrations")
	if err != nil {
		panic(fmt.Sprintf("taskstore: embedded migrations: %v", err))
	}
	var out []migration
	for _, e := range entries {
		m := fileName.FindStringSubmatch(e.Name())
		if m == nil {
			panic(fmt.Sprintf("taskstore: migration file %q is not named NNNN_name.up.sql", e.Name()))
		}
		body, err := fs.ReadFile(files, path.Join("migrations", e.Name()))
		if err != nil {
			panic(fmt.Sprintf("taskstore: read migration %s: %v", e.Name(), err))
		}
		v, _ := strconv.Atoi(m[1])
		sum := sha256.Sum256(body)
		out = append(out, migration{version: v, name: m[2], sql: string(body), sum: hex.EncodeToString(sum[:])})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].version < out[j].version })
	for i, m := range out {
		if m.version != i+1 {
			panic(fmt.Sprintf("taskstore: migrations are not contiguous at %04d_%s", m.version, m.name))
		}
	}
	return out
}()

const createTableSQL = `CREATE TABLE IF NOT EXISTS taskstore_schema (
	version    integer PRIMARY KEY CHECK (version > 0),
	name       text NOT NULL,
	checksum   text NOT NULL,
	applied_at timestamptz NOT NULL DEFAULT pg_catalog.now()
)`

const appliedSQL = `SELECT version, checksum FROM taskstore_schema ORDER BY version`

const recordSQL = `INSERT INTO taskstore_schema (version, name, checksum) VALUES ($1, $2, $3)`

// Migrate applies the task store's missing migrations, each in its own transaction.
func Migrate(ctx context.Context, db outbox.Beginner) error {
	for _, m := range migrations {
		if err := apply(ctx, db, m); err != nil {
			return fmt.Errorf("migrate taskstore schema: %w", err)
		}
	}
	return nil
}

func apply(ctx context.Context, db outbox.Beginner, m migration) error {
	tx, err := db.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT pg_catalog.pg_advisory_xact_lock($1)`, lockKey); err != nil {
		return fmt.Errorf("take migration lock: %w", err)
	}
	if _, err := tx.Exec(ctx, createTableSQL); err != nil {
		return fmt.Errorf("create taskstore_schema: %w", err)
	}
	applied, err := read(ctx, tx)
	if err != nil {
		return err
	}
	if sum, ok := applied[m.version]; ok {
		if sum != m.sum {
			return fmt.Errorf("%04d_%s was applied with another checksum", m.version, m.name)
		}
		return tx.Commit(ctx)
	}
	if _, err := tx.Exec(ctx, m.sql); err != nil {
		return fmt.Errorf("apply %04d_%s: %w", m.version, m.name, err)
	}
	if _, err := tx.Exec(ctx, recordSQL, m.version, m.name, m.sum); err != nil {
		return fmt.Errorf("record %04d_%s: %w", m.version, m.name, err)
	}
	return tx.Commit(ctx)
}

func read(ctx context.Context, db outbox.DBTX) (map[int]string, error) {
	rows, err := db.Query(ctx, appliedSQL)
	if err != nil {
		return nil, fmt.Errorf("read taskstore_schema: %w", err)
	}
	type row struct {
		Version  int
		Checksum string
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		return nil, fmt.Errorf("read taskstore_schema: %w", err)
	}
	out := make(map[int]string, len(got))
	for _, r := range got {
		out[r.Version] = r.Checksum
	}
	return out, nil
}

// Verify checks the task store's schema is current.
func Verify(ctx context.Context, db outbox.DBTX) error {
	applied, err := read(ctx, db)
	if err != nil {
		return err
	}
	for _, m := range migrations {
		sum, ok := applied[m.version]
		switch {
		case !ok:
			return fmt.Errorf("%w: %04d_%s is not applied", ErrBehind, m.version, m.name)
		case sum != m.sum:
			return fmt.Errorf("%04d_%s was applied with another checksum", m.version, m.name)
		}
	}
	return nil
}

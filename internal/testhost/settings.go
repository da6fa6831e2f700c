package testhost

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Settings is the store's persisted settings table. It implements outbox.Settings, which is
// where a deployment's durable consumer identity (outbox.consumer_id) is read from.
type Settings struct {
	pool  *pgxpool.Pool
	scope string
}

// NewSettings returns the settings of one scope (for example a deployment or node name; ""
// is the global scope).
func NewSettings(pool *pgxpool.Pool, scope string) *Settings {
	return &Settings{pool: pool, scope: scope}
}

// Setting implements outbox.Settings.
func (s *Settings) Setting(ctx context.Context, name string) (string, bool, error) {
	var v string
	err := s.pool.QueryRow(ctx, `SELECT value FROM settings WHERE scope = $1 AND key = $2`, s.scope, name).Scan(&v)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("read setting: %w", err)
	}
	return v, true, nil
}

// Set stores a setting.
func (s *Settings) Set(ctx context.Context, name, value string) error {
	_, err := s.pool.Exec(ctx, `INSERT INTO settings (scope, key, value) VALUES ($1, $2, $3)
		ON CONFLICT (scope, key) DO UPDATE SET value = excluded.value, updated_at = now()`, s.scope, name, value)
	if err != nil {
		return fmt.Errorf("write setting: %w", err)
	}
	return nil
}

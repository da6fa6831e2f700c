package pgtest_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"fusion/outbox"
	"fusion/outbox/example/taskstore/schema"
	"fusion/outbox/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }

func TestEachTestGetsItsOwnMigratedDatabase(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	a, b := pgtest.NewDB(t), pgtest.NewDB(t)
	require.NotEqual(t, a.Name, b.Name)
	pa, pb := pgtest.Pool(t, a.URL), pgtest.Pool(t, b.URL)
	for _, p := range []interface {
		outbox.DBTX
	}{pa, pb} {
		require.NoError(t, outbox.VerifySchema(ctx, p), "the module's schema is current")
	}
	require.NoError(t, schema.Verify(ctx, pa), "and so is the reference host's")
	_, err := pa.Exec(ctx, `INSERT INTO settings (key, value) VALUES ('k', 'v')`)
	require.NoError(t, err)
	var n int
	require.NoError(t, pb.QueryRow(ctx, `SELECT count(*) FROM settings`).Scan(&n))
	require.Zero(t, n, "databases are isolated")
	require.NotEmpty(t, pgtest.Kind())
	if pgtest.Kind() == "cluster" {
		require.NotNil(t, pgtest.Cluster(t))
	}
}

func TestEmptyDatabaseHasNoSchema(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := outbox.VerifySchema(ctx, pgtest.Pool(t, pgtest.NewEmptyDB(t).URL))
	require.ErrorIs(t, err, outbox.ErrSchemaBehind)
}

// BenchmarkNewDB measures what a test waits for its own migrated database: a CREATE
// DATABASE from the template (the drop runs at cleanup, after the timing).
func BenchmarkNewDB(b *testing.B) {
	for b.Loop() {
		pgtest.NewDB(b)
	}
}

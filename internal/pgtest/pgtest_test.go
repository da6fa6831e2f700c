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

// TestStandbyPair: a row written on the pair's primary shows on its standby, not while the
// standby's replay is paused, again once it resumes; a promoted standby takes writes.
func TestStandbyPair(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	pair := pgtest.StartPair(t)
	db := pair.NewDB(t)
	primary, standby := pgtest.Pool(t, db.URL), pgtest.Pool(t, db.StandbyURL)
	require.NoError(t, outbox.VerifySchema(ctx, standby), "the standby has the migrated database")
	var inRecovery bool
	require.NoError(t, standby.QueryRow(ctx, `SELECT pg_is_in_recovery()`).Scan(&inRecovery))
	require.True(t, inRecovery)
	count := func() int { return pgtest.QueryInt(t, standby, `SELECT count(*) FROM settings`) }

	_, err := primary.Exec(ctx, `INSERT INTO settings (key, value) VALUES ('a', '1')`)
	require.NoError(t, err)
	require.NoError(t, pair.WaitReplayed(t))
	require.Equal(t, 1, count(), "a row written on the primary is visible on the standby")

	pair.PauseReplay(t)
	_, err = primary.Exec(ctx, `INSERT INTO settings (key, value) VALUES ('b', '2')`)
	require.NoError(t, err)
	// Replay is paused: the row cannot show, however long we look. A short look suffices to
	// catch a pause that does not hold.
	require.Never(t, func() bool { return count() != 1 }, 200*time.Millisecond, 20*time.Millisecond)
	pair.ResumeReplay(t)
	require.NoError(t, pair.WaitReplayed(t))
	require.Equal(t, 2, count(), "and once replay resumes")

	_, err = standby.Exec(ctx, `INSERT INTO settings (key, value) VALUES ('c', '3')`)
	require.Error(t, err, "a standby refuses writes")
	require.NoError(t, pair.Standby.Promote(ctx))
	_, err = standby.Exec(ctx, `INSERT INTO settings (key, value) VALUES ('c', '3')`)
	require.NoError(t, err, "a promoted standby takes writes")
}

package testkit

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
)

// SeedEvents writes n events into project's log, as many writers would have, and ticks: what a
// freshly started stream handler finds there, numbered. Their task IDs are seed-1 to seed-n.
func SeedEvents(t testing.TB, pool *pgxpool.Pool, project string, n int) {
	t.Helper()
	seedLog(t, pool, project, "seed", "2030-01-01", n)
}

// SeedMore numbers n more events of project after whatever it has, with task IDs of prefix.
func SeedMore(t testing.TB, pool *pgxpool.Pool, project, prefix string, n int) {
	t.Helper()
	seedLog(t, pool, project, prefix, "2031-01-01", n)
}

// seedLog writes n events of project into the log, task IDs prefix-1 to prefix-n deleted a
// second apart after deletedFrom, and ticks.
func seedLog(t testing.TB, pool *pgxpool.Pool, project, prefix, deletedFrom string, n int) {
	t.Helper()
	ctx := Ctx(t)
	_, err := pool.Exec(ctx, `
INSERT INTO lifecycle_event_log (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
SELECT $1, $2 || '-' || g, $3::timestamptz + g * interval '1 second', 'task:deleted', false, 1, clock_timestamp(), 'writer-0123456789abcdef'
FROM generate_series(1, $4) g`, project, prefix, deletedFrom, n)
	require.NoError(t, err)
	_, err = outbox.Sequence(ctx, pool, []string{project}, 10000)
	require.NoError(t, err)
}

// SeedUndecodableAt4 stores project's first four events as the stream numbered before schema 18
// holds them: three well-formed ones (as SeedEvents names them), then at sequence 4 a row the
// reader cannot deliver (deleted_at = 'infinity', which the log's types refuse but a numbered
// row of the stream may hold); then it writes two well-formed events into the log and ticks, so
// they are numbered 5 and 6 after the stream.
func SeedUndecodableAt4(t testing.TB, pool *pgxpool.Pool, project string) {
	t.Helper()
	ctx := Ctx(t)
	_, err := pool.Exec(ctx, `
INSERT INTO lifecycle_outbox (project_id, sequence, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
SELECT $1, g, 'seed-' || g, timestamptz '2030-01-01' + g * interval '1 second', 'task:deleted', false, 1, clock_timestamp(), 'writer-0123456789abcdef'
FROM generate_series(1, 3) g`, project)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `
INSERT INTO lifecycle_outbox (project_id, sequence, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
VALUES ($1, 4, 'forever', 'infinity', 'task:deleted', false, 1, now(), 'writer-0123456789abcdef')`, project)
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `INSERT INTO lifecycle_outbox_heads (project_id, last_sequence) VALUES ($1, 4)
		ON CONFLICT (project_id) DO UPDATE SET last_sequence = 4`, project)
	require.NoError(t, err)
	seedLog(t, pool, project, "late", "2031-01-01", 2) // sequences 5 and 6
}

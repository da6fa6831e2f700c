package outbox_test

import (
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"fusion/outbox"
)

// Seeded events, as the stream handler's tests (package web) seed them too.

// seedEvents writes n events into project's log, as many writers would have, and ticks: what a
// freshly started stream handler finds there, numbered.
func seedEvents(t *testing.T, pool *pgxpool.Pool, project string, n int) {
	t.Helper()
	ctx := ctxT(t)
	_, err := pool.Exec(ctx, `
INSERT INTO lifecycle_event_log (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
SELECT $1, 'seed-' || g, timestamptz '2030-01-01' + g * interval '1 second', 'task:deleted', false, 1, clock_timestamp(), 'writer-0123456789abcdef'
FROM generate_series(1, $2) g`, project, n)
	require.NoError(t, err)
	_, err = outbox.Sequence(ctx, pool, []string{project}, 10000)
	require.NoError(t, err)
}

// seedUndecodableAt4 stores project's first four events as the stream numbered before schema 18
// holds them: three well-formed ones (as seedEvents names them), then at sequence 4 a row the
// reader cannot deliver (deleted_at = 'infinity', which the log's types refuse but a numbered
// row of the stream may hold); then it writes two well-formed events into the log and ticks, so
// they are numbered 5 and 6 after the stream.
func seedUndecodableAt4(t *testing.T, pool *pgxpool.Pool, project string) {
	t.Helper()
	ctx := ctxT(t)
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
	_, err = pool.Exec(ctx, `
INSERT INTO lifecycle_event_log (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at, writer_process_id)
SELECT $1, 'late-' || g, timestamptz '2031-01-01' + g * interval '1 second', 'task:deleted', false, 1, clock_timestamp(), 'writer-0123456789abcdef'
FROM generate_series(1, 2) g`, project)
	require.NoError(t, err)
	_, err = outbox.Sequence(ctx, pool, []string{project}, 10000) // sequences 5 and 6
	require.NoError(t, err)
}

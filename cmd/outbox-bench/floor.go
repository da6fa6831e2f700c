package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
)

// The copy floor: what writing each event once more, into a table laid out as the stream
// numbered before schema 18, costs, measured on the backlog that one tick then numbers. The
// sequencer that schema 18 replaced paid at least this (it moved every event from the pending
// table into the stream); a tick writes nothing per event, it counts them.
const (
	floorTableDDL = `CREATE TABLE bench_stream_floor (LIKE lifecycle_outbox INCLUDING ALL)`
	floorDropDDL  = `DROP TABLE bench_stream_floor`
	// floorCopySQL copies up to @batch of @project's logged events after the key
	// (@after_deleted_at, @after_task_id), in the log's key order, numbered in that order from
	// @base + 1, and returns the batch's last key.
	floorCopySQL = `
WITH b AS (
    SELECT q.project_id::text AS project_id, q.task_id::text AS task_id, q.deleted_at::timestamptz AS deleted_at,
           q.event_type, q.archived, q.payload_version::smallint AS payload_version, q.occurred_at::timestamptz AS occurred_at,
           q.writer_process_id::text AS writer_process_id, q.prior_column::text AS prior_column, q.trace_context::text AS trace_context
    FROM lifecycle_event_log q
    WHERE q.project_id = @project AND (q.deleted_at, q.task_id) > (@after_deleted_at::timestamptz, @after_task_id::text)
    ORDER BY q.project_id, q.deleted_at, q.task_id
    LIMIT @batch
), copied AS (
    INSERT INTO bench_stream_floor
        (project_id, task_id, deleted_at, sequence, event_type, archived, payload_version, occurred_at,
         writer_process_id, prior_column, trace_context)
    SELECT b.project_id, b.task_id, b.deleted_at,
           @base::bigint + row_number() OVER (ORDER BY b.deleted_at, b.task_id),
           b.event_type, b.archived, b.payload_version, b.occurred_at, b.writer_process_id, b.prior_column, b.trace_context
    FROM b
    RETURNING 1
)
SELECT (SELECT count(*) FROM copied), b.deleted_at, b.task_id
FROM b ORDER BY b.deleted_at DESC, b.task_id DESC LIMIT 1`
)

// floorBatch is how many events one statement of the copy floor copies: the batch the
// sequencer that schema 18 replaced numbered per project and call by default.
const floorBatch = 10000

// copyFloor copies every logged event of projects into a fresh table with the stream's
// columns, indexes and checks (no row-level security), batch rows per statement, and returns
// how long the copies took and how many rows they wrote.
func copyFloor(ctx context.Context, admin *pgxpool.Pool, projects []string, batch int) (time.Duration, int64, error) {
	if _, err := admin.Exec(ctx, floorTableDDL); err != nil {
		return 0, 0, fmt.Errorf("create floor table: %w", err)
	}
	defer func() { _, _ = admin.Exec(context.WithoutCancel(ctx), floorDropDDL) }() // the database goes after the run anyway
	var total int64
	started := time.Now()
	for _, project := range projects {
		after := pgtype.Timestamptz{InfinityModifier: pgtype.NegativeInfinity, Valid: true}
		afterTask, base := "", int64(0)
		for {
			var n int64
			err := admin.QueryRow(ctx, floorCopySQL, pgx.StrictNamedArgs{"project": project, "after_deleted_at": after,
				"after_task_id": afterTask, "batch": batch, "base": base}).Scan(&n, &after, &afterTask)
			if errors.Is(err, pgx.ErrNoRows) {
				break
			}
			if err != nil {
				return 0, total, fmt.Errorf("floor copy: %w", err)
			}
			total, base = total+n, base+n
			if n < int64(batch) {
				break
			}
		}
	}
	return time.Since(started), total, nil
}

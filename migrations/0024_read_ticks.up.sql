-- One read of what was ticked since the consumer's last scan.
--
-- lifecycle_outbox_read_parts (0022) finds each project's parts by key, two probes of the part
-- key per project, checks in SQL that each came back whole and numbers its events with a
-- window: on a 2-core machine (pgbench, one session, 1,500 ticks of 27 events over 16
-- projects, the newest tick read) a call for 16 projects cost 0.75-1.1 ms, against 0.20-0.24 ms
-- for the function below; most of the difference is starting the larger plan.
--
-- lifecycle_outbox_read_ticks(projects, tick, limit) returns the events of the given projects in
-- the ticks after tick, up to limit rows, each with its tick and its project's part of that tick
-- (the part's first sequence and number of events), unnumbered: one walk of the tick key for
-- all the projects (at most limit ticks and limit parts), one walk of the batch index per tick,
-- no sort. The caller numbers each part's events in the order the other readers number them
-- (txid, deleted_at, task_id in byte order) from the part's first sequence, and serves a
-- project only from the part holding its next event on, while its parts come back whole (as
-- many rows as the part counts: a part the limit cut, or that lost an event, is not) and follow
-- each other. Any other project (its next event in an earlier tick, the frozen stream, a tick
-- gone) it reads with the other readers. A consumer passes the newest tick seen by the scan
-- that brought its projects to their heads: their next events are in later ticks. It runs as
-- the caller, so row-level security shows it only the projects granted to it.

CREATE FUNCTION lifecycle_outbox_read_ticks(p_projects text[], p_tick bigint, p_limit integer)
RETURNS TABLE (project_id text, event_type lifecycle_event_type, task_id text, deleted_at timestamptz,
               prior_column text, archived boolean, writer_process_id text, occurred_at timestamptz,
               payload_version smallint, trace_context text, txid xid8,
               tick_id bigint, part_first_sequence bigint, part_events integer)
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF p_projects IS NULL OR pg_catalog.cardinality(p_projects) OPERATOR(pg_catalog.>) 10000
       OR p_tick IS NULL OR p_tick OPERATOR(pg_catalog.<) 0 OR p_tick OPERATOR(pg_catalog.>) 1000000000000000
       OR p_limit IS NULL OR p_limit OPERATOR(pg_catalog.<) 1 OR p_limit OPERATOR(pg_catalog.>) 100000 THEN
        RAISE EXCEPTION 'p_projects must be an array of at most 10000 projects, p_tick between 0 and 10^15 and p_limit between 1 and 100000'
            USING ERRCODE = '22023';
    END IF;

    RETURN QUERY
    WITH span AS (
        -- The projects' parts in the ticks after p_tick, in tick order: one walk of the tick
        -- key, at most p_limit ticks and p_limit parts.
        SELECT s.tick_id, s.project, s.first_sequence, s.events
        FROM (SELECT tp.tick_id, tp.project_id::text AS project, tp.first_sequence, tp.events
              FROM lifecycle_tick_project tp
              WHERE tp.tick_id OPERATOR(pg_catalog.>) p_tick
                AND tp.tick_id OPERATOR(pg_catalog.<=) (p_tick OPERATOR(pg_catalog.+) p_limit)
              OFFSET 0 -- keeps the project filter below out of the index conditions
             ) s
        WHERE s.project OPERATOR(pg_catalog.=) ANY (p_projects)
        ORDER BY s.tick_id
        LIMIT p_limit
    ), ticks AS (
        -- Each tick once, with both snapshots (each looked up by its key: a join could scan
        -- the whole tick table).
        SELECT g.tick_id,
               (SELECT c.snapshot FROM lifecycle_tick c WHERE c.tick_id OPERATOR(pg_catalog.=) g.tick_id) AS cur,
               (SELECT b.snapshot FROM lifecycle_tick b WHERE b.tick_id OPERATOR(pg_catalog.=) (g.tick_id OPERATOR(pg_catalog.-) 1)) AS prev
        FROM (SELECT DISTINCT s.tick_id FROM span s) g
    ), batch AS MATERIALIZED (
        -- A tick's batch for all its projects at once: one walk of the batch index per tick
        -- (materialized, so that the plan cannot walk it once per part instead). The projects
        -- are filtered after the walk, by the join below.
        SELECT k.tick_id, e.*
        FROM ticks k
        CROSS JOIN LATERAL (
            SELECT l.project_id, l.task_id, l.deleted_at, l.event_type, l.archived, l.payload_version, l.occurred_at,
                   l.writer_process_id, l.prior_column, l.trace_context, l.txid
            FROM lifecycle_event_log l
            WHERE l.txid OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT pg_catalog.pg_snapshot_xip(k.prev) EXCEPT SELECT pg_catalog.pg_snapshot_xip(k.cur)))
            UNION ALL
            SELECT l.project_id, l.task_id, l.deleted_at, l.event_type, l.archived, l.payload_version, l.occurred_at,
                   l.writer_process_id, l.prior_column, l.trace_context, l.txid
            FROM lifecycle_event_log l
            WHERE l.txid OPERATOR(pg_catalog.>=) pg_catalog.pg_snapshot_xmax(k.prev)
              AND l.txid OPERATOR(pg_catalog.<) pg_catalog.pg_snapshot_xmax(k.cur)
              AND pg_catalog.pg_visible_in_snapshot(l.txid, k.cur)
            OFFSET 0
        ) e
    )
    SELECT e.project_id::text, e.event_type, e.task_id::text, e.deleted_at::timestamptz, e.prior_column::text,
           e.archived, e.writer_process_id::text, e.occurred_at::timestamptz,
           e.payload_version::smallint, e.trace_context::text, e.txid,
           e.tick_id, p.first_sequence, p.events
    FROM batch e
    JOIN span p ON p.tick_id OPERATOR(pg_catalog.=) e.tick_id AND p.project OPERATOR(pg_catalog.=) e.project_id::text
    LIMIT p_limit;
END;
$$;

DO $$
DECLARE
    r record;
BEGIN
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_read_ticks(text[], bigint, integer) '
                              'SET search_path = pg_catalog, %I, pg_temp', pg_catalog.current_schema());
    ALTER FUNCTION lifecycle_outbox_read_ticks(text[], bigint, integer) SET plan_cache_mode = force_generic_plan;
    ALTER FUNCTION lifecycle_outbox_read_ticks(text[], bigint, integer) SET max_parallel_workers_per_gather = 0;
    -- As the readers of 0021 and 0022: plans that walk indexes in order, whatever the
    -- statistics when a session first calls it.
    ALTER FUNCTION lifecycle_outbox_read_ticks(text[], bigint, integer) SET enable_seqscan = off;
    ALTER FUNCTION lifecycle_outbox_read_ticks(text[], bigint, integer) SET enable_bitmapscan = off;
    REVOKE EXECUTE ON FUNCTION lifecycle_outbox_read_ticks(text[], bigint, integer) FROM PUBLIC;
    -- Whoever may call lifecycle_outbox_read_parts may call this one.
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role_name
        FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
        WHERE p.oid OPERATOR(pg_catalog.=) 'lifecycle_outbox_read_parts(text[], bigint[], integer)'::regprocedure
          AND a.grantee OPERATOR(pg_catalog.<>) 0 AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
          AND a.privilege_type OPERATOR(pg_catalog.=) 'EXECUTE'
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION lifecycle_outbox_read_ticks(text[], bigint, integer) TO %s', r.role_name);
    END LOOP;
END;
$$;

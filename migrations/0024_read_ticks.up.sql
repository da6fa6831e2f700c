-- One read of what was ticked since the consumer's last scan.
--
-- lifecycle_outbox_read_parts (0022) finds each project's parts by key, two probes of the part
-- key per project, then checks in SQL that each came back whole: on a 2-core machine
-- (pgbench, one session, 1,500 ticks of 27 events over 16 projects, the newest tick read) a
-- call for 16 projects cost 0.77-0.95 ms, against 0.27-0.41 ms for the same events read by
-- tick range in a function like the one below.
--
-- lifecycle_outbox_read_ticks(projects, tick, limit) reads the events of the given projects in
-- the ticks after tick, tick by tick in order, while they add up to limit events at most (so
-- nothing when the first such tick holds more): one walk of the tick key for all the projects,
-- one walk of the batch index per tick. Each row carries its tick and its part (the part's
-- first sequence and event count), so the caller serves a project only from the part holding
-- its next event on, while the parts come back whole and follow each other; any other
-- project (its next event in an earlier tick, an event deleted by hand, a tick gone) it reads
-- with lifecycle_outbox_read. A consumer passes the newest tick its previous scan saw: a
-- project it brought to its head then has its next event in a later tick. It runs as the
-- caller, so row-level security shows it only the projects granted to it.

CREATE FUNCTION lifecycle_outbox_read_ticks(p_projects text[], p_tick bigint, p_limit integer)
RETURNS TABLE (project_id text, sequence bigint, event_type lifecycle_event_type, task_id text, deleted_at timestamptz,
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
        -- key, at most p_limit ticks and p_limit parts (each part holds an event at least).
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
    ), parts AS (
        -- Those parts tick by tick while their events add up to p_limit at most.
        SELECT c.tick_id, c.project, c.first_sequence, c.events
        FROM (SELECT s.*, pg_catalog.sum(s.events) OVER (ORDER BY s.tick_id) AS upto FROM span s) c
        WHERE c.upto OPERATOR(pg_catalog.<=) p_limit
    ), ticks AS (
        -- Each tick once, with the projects to read in it and both snapshots (each looked up
        -- by its key: a join could scan the whole tick table).
        SELECT g.tick_id, g.projects,
               (SELECT c.snapshot FROM lifecycle_tick c WHERE c.tick_id OPERATOR(pg_catalog.=) g.tick_id) AS cur,
               (SELECT b.snapshot FROM lifecycle_tick b WHERE b.tick_id OPERATOR(pg_catalog.=) (g.tick_id OPERATOR(pg_catalog.-) 1)) AS prev
        FROM (SELECT p.tick_id, pg_catalog.array_agg(p.project) AS projects FROM parts p GROUP BY p.tick_id) g
    ), batch AS (
        -- A tick's batch for all its projects at once: one walk of the batch index per tick.
        -- The projects are filtered after the walk, not in it: with txid leading the index,
        -- PostgreSQL 15 would walk the range once per project of the list.
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
            OFFSET 0 -- keeps the project filter below out of the index conditions
        ) e
        WHERE e.project_id::text OPERATOR(pg_catalog.=) ANY (k.projects)
    )
    SELECT e.project_id::text,
           (p.first_sequence OPERATOR(pg_catalog.-) 1) OPERATOR(pg_catalog.+) pg_catalog.row_number() OVER w,
           e.event_type, e.task_id::text, e.deleted_at::timestamptz, e.prior_column::text,
           e.archived, e.writer_process_id::text, e.occurred_at::timestamptz,
           e.payload_version::smallint, e.trace_context::text, e.txid,
           e.tick_id, p.first_sequence, p.events
    FROM batch e
    JOIN parts p ON p.tick_id OPERATOR(pg_catalog.=) e.tick_id AND p.project OPERATOR(pg_catalog.=) e.project_id::text
    WINDOW w AS (PARTITION BY e.tick_id, e.project_id ORDER BY e.txid, e.deleted_at, e.task_id COLLATE "C");
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

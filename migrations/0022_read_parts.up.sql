-- One read of many projects' next parts, by tick.
--
-- A consumer's scan read the first batch of each project it woke for with one call of
-- lifecycle_outbox_read per project, and that read walked the batch index over each tick's
-- transaction range once per project (the index leads with txid, so a project's events in a
-- range are found by walking the whole range): with 16 projects in every tick, each tick's
-- range was walked 16 times per consumer, with five statements of the function per project.
--
-- lifecycle_outbox_read_parts(projects, after, limit) reads, for each project, its parts from the
-- one holding its next event, whole, up to limit events past its position, and walks each
-- tick's range once for all the projects. It returns what lifecycle_outbox_read would return
-- for them, and nothing for a project whose next event is in the frozen stream or in a part of
-- more than limit events, or whose parts do not all come back whole (an event deleted by hand,
-- a tick gone); the caller reads those with lifecycle_outbox_read. It runs as the caller, so
-- row-level security shows it only the projects granted to it.

CREATE FUNCTION lifecycle_outbox_read_parts(p_projects text[], p_after bigint[], p_limit integer)
RETURNS TABLE (project_id text, sequence bigint, event_type lifecycle_event_type, task_id text, deleted_at timestamptz,
               prior_column text, archived boolean, writer_process_id text, occurred_at timestamptz,
               payload_version smallint, trace_context text, txid xid8)
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF p_projects IS NULL OR p_after IS NULL
       OR pg_catalog.cardinality(p_projects) OPERATOR(pg_catalog.<>) pg_catalog.cardinality(p_after)
       OR pg_catalog.cardinality(p_projects) OPERATOR(pg_catalog.>) 10000
       OR p_limit IS NULL OR p_limit OPERATOR(pg_catalog.<) 1 OR p_limit OPERATOR(pg_catalog.>) 100000 THEN
        RAISE EXCEPTION 'p_projects and p_after must be arrays of one length (at most 10000) and p_limit between 1 and 100000'
            USING ERRCODE = '22023';
    END IF;

    RETURN QUERY
    WITH asked AS (
        SELECT a.project, a.after
        FROM ROWS FROM (pg_catalog.unnest(p_projects), pg_catalog.unnest(p_after)) AS a(project, after)
        WHERE a.project IS NOT NULL AND a.after IS NOT NULL
    ), parts AS (
        -- Each project's parts from the one holding its next event, whole, while what they hold
        -- past its position adds up to p_limit events at most. The first part is read whole
        -- (the rows before the position are numbered, then dropped), so it must hold p_limit
        -- events at most: a project inside a larger part gets nothing here.
        SELECT a.project, a.after, w.tick_id, w.first_sequence, w.events
        FROM asked a
        CROSS JOIN LATERAL (
            SELECT s.first_sequence AS start FROM lifecycle_tick_project s
            WHERE s.project_id OPERATOR(pg_catalog.=) a.project AND s.first_sequence OPERATOR(pg_catalog.<=) (a.after OPERATOR(pg_catalog.+) 1)
            ORDER BY s.first_sequence DESC
            LIMIT 1
        ) st
        CROSS JOIN LATERAL (
            SELECT f.tick_id, f.first_sequence, f.events,
                   pg_catalog.sum((f.first_sequence OPERATOR(pg_catalog.+) f.events OPERATOR(pg_catalog.-) 1)
                                  OPERATOR(pg_catalog.-) GREATEST(a.after, f.first_sequence OPERATOR(pg_catalog.-) 1))
                       OVER (ORDER BY f.first_sequence) AS upto,
                   pg_catalog.first_value(f.events) OVER (ORDER BY f.first_sequence) AS first_events
            FROM (SELECT tp.tick_id, tp.first_sequence, tp.events FROM lifecycle_tick_project tp
                  WHERE tp.project_id OPERATOR(pg_catalog.=) a.project AND tp.first_sequence OPERATOR(pg_catalog.>=) st.start
                  ORDER BY tp.first_sequence
                  LIMIT (p_limit OPERATOR(pg_catalog.+) 1)) f
        ) w
        WHERE w.upto OPERATOR(pg_catalog.<=) p_limit AND w.first_events OPERATOR(pg_catalog.<=) p_limit
          AND (w.first_sequence OPERATOR(pg_catalog.+) w.events OPERATOR(pg_catalog.-) 1) OPERATOR(pg_catalog.>) a.after
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
    ), whole AS (
        -- The projects every part of which came back with as many events as it counted. Any
        -- other (an event deleted by hand, a tick gone) is left to lifecycle_outbox_read, which
        -- stops at the gap or says which tick is gone.
        SELECT p.project
        FROM parts p
        LEFT JOIN (SELECT e.tick_id, e.project_id::text AS project, pg_catalog.count(*) AS n FROM batch e GROUP BY 1, 2) g
               ON g.tick_id OPERATOR(pg_catalog.=) p.tick_id AND g.project OPERATOR(pg_catalog.=) p.project
        GROUP BY p.project
        HAVING pg_catalog.bool_and(coalesce(g.n, 0) OPERATOR(pg_catalog.=) p.events)
    )
    SELECT n.project_id, n.sequence, n.event_type, n.task_id, n.deleted_at, n.prior_column, n.archived,
           n.writer_process_id, n.occurred_at, n.payload_version, n.trace_context, n.txid
    FROM (
        SELECT e.project_id::text AS project_id,
               (p.first_sequence OPERATOR(pg_catalog.-) 1) OPERATOR(pg_catalog.+) pg_catalog.row_number() OVER w AS sequence,
               e.event_type, e.task_id::text AS task_id, e.deleted_at::timestamptz AS deleted_at, e.prior_column::text AS prior_column,
               e.archived, e.writer_process_id::text AS writer_process_id, e.occurred_at::timestamptz AS occurred_at,
               e.payload_version::smallint AS payload_version, e.trace_context::text AS trace_context, e.txid, p.after
        FROM batch e
        JOIN parts p ON p.tick_id OPERATOR(pg_catalog.=) e.tick_id AND p.project OPERATOR(pg_catalog.=) e.project_id::text
        JOIN whole h ON h.project OPERATOR(pg_catalog.=) p.project
        WINDOW w AS (PARTITION BY e.tick_id, e.project_id ORDER BY e.txid, e.deleted_at, e.task_id COLLATE "C")
    ) n
    WHERE n.sequence OPERATOR(pg_catalog.>) n.after;
END;
$$;

DO $$
DECLARE
    r record;
BEGIN
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_read_parts(text[], bigint[], integer) '
                              'SET search_path = pg_catalog, %I, pg_temp', pg_catalog.current_schema());
    ALTER FUNCTION lifecycle_outbox_read_parts(text[], bigint[], integer) SET plan_cache_mode = force_generic_plan;
    ALTER FUNCTION lifecycle_outbox_read_parts(text[], bigint[], integer) SET max_parallel_workers_per_gather = 0;
    -- As the per-project reader (0021): plans that walk indexes in order, whatever the
    -- statistics when a session first calls it.
    ALTER FUNCTION lifecycle_outbox_read_parts(text[], bigint[], integer) SET enable_seqscan = off;
    ALTER FUNCTION lifecycle_outbox_read_parts(text[], bigint[], integer) SET enable_bitmapscan = off;
    REVOKE EXECUTE ON FUNCTION lifecycle_outbox_read_parts(text[], bigint[], integer) FROM PUBLIC;
    -- Whoever may call the reader may call this one.
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role_name
        FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
        WHERE p.oid OPERATOR(pg_catalog.=) 'lifecycle_outbox_read(text, bigint, integer, xid8, timestamptz, text)'::regprocedure
          AND a.grantee OPERATOR(pg_catalog.<>) 0 AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
          AND a.privilege_type OPERATOR(pg_catalog.=) 'EXECUTE'
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION lifecycle_outbox_read_parts(text[], bigint[], integer) TO %s', r.role_name);
    END LOOP;
END;
$$;

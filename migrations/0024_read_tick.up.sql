-- One read of many projects' events in one tick.
--
-- After each tick, every consumer that is caught up reads the tick's events of the projects it
-- woke for. lifecycle_outbox_read_parts serves any position, so it first looks up, for each
-- project, the part holding its next event and the parts after it, up to a limit; that plan is
-- large, and starting it (not running it) was a third of a consumer's time in the function
-- under load (perf on the consumers' backends, 16 writers and 8 consumers).
--
-- lifecycle_outbox_read_tick(projects, after, tick, limit) serves the caught-up case alone: for
-- each project whose part in tick starts right after its position (and holds at most limit
-- events), that part, whole, numbered on from the position. It walks the tick's range of the
-- batch index once for all the projects. A project with no part in tick, a part that starts
-- elsewhere (the consumer is behind, or past it), a larger part, or a part that does not come
-- back whole (an event deleted by hand) gets nothing: the caller reads it as before. It runs as
-- the caller, so row-level security shows it only the projects granted to it.

CREATE FUNCTION lifecycle_outbox_read_tick(p_projects text[], p_after bigint[], p_tick bigint, p_limit integer)
RETURNS TABLE (project_id text, sequence bigint, event_type lifecycle_event_type, task_id text, deleted_at timestamptz,
               prior_column text, archived boolean, writer_process_id text, occurred_at timestamptz,
               payload_version smallint, trace_context text, txid xid8)
LANGUAGE plpgsql STABLE
AS $$
BEGIN
    IF p_projects IS NULL OR p_after IS NULL OR p_tick IS NULL
       OR pg_catalog.cardinality(p_projects) OPERATOR(pg_catalog.<>) pg_catalog.cardinality(p_after)
       OR pg_catalog.cardinality(p_projects) OPERATOR(pg_catalog.>) 10000
       OR p_limit IS NULL OR p_limit OPERATOR(pg_catalog.<) 1 OR p_limit OPERATOR(pg_catalog.>) 100000 THEN
        RAISE EXCEPTION 'p_projects and p_after must be arrays of one length (at most 10000), p_tick must be given and p_limit between 1 and 100000'
            USING ERRCODE = '22023';
    END IF;

    RETURN QUERY
    WITH parts AS (
        -- Each project's part in the tick, when it starts right after the project's position.
        SELECT a.project, tp.first_sequence, tp.events
        FROM ROWS FROM (pg_catalog.unnest(p_projects), pg_catalog.unnest(p_after)) AS a(project, after)
        JOIN lifecycle_tick_project tp
          ON tp.tick_id OPERATOR(pg_catalog.=) p_tick AND tp.project_id OPERATOR(pg_catalog.=) a.project
        WHERE tp.first_sequence OPERATOR(pg_catalog.=) (a.after OPERATOR(pg_catalog.+) 1)
          AND tp.events OPERATOR(pg_catalog.<=) p_limit
    ), k AS (
        -- The tick's snapshot and the one before it (the tick table always holds the tick
        -- before a numbered one while its parts are stored).
        SELECT (SELECT c.snapshot FROM lifecycle_tick c WHERE c.tick_id OPERATOR(pg_catalog.=) p_tick) AS cur,
               (SELECT b.snapshot FROM lifecycle_tick b WHERE b.tick_id OPERATOR(pg_catalog.=) (p_tick OPERATOR(pg_catalog.-) 1)) AS prev
    ), batch AS (
        -- The tick's batch: transactions open at the tick before that have ended, then those
        -- that began since and had ended by the tick. One walk of the batch index; the projects
        -- are filtered after it, as in lifecycle_outbox_read_parts.
        SELECT e.*
        FROM k
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
            OFFSET 0 -- keeps the project filter out of the index conditions
        ) e
    )
    SELECT n.project_id, n.sequence, n.event_type, n.task_id, n.deleted_at, n.prior_column, n.archived,
           n.writer_process_id, n.occurred_at, n.payload_version, n.trace_context, n.txid
    FROM (
        SELECT e.project_id::text AS project_id,
               (p.first_sequence OPERATOR(pg_catalog.-) 1) OPERATOR(pg_catalog.+) pg_catalog.row_number() OVER w AS sequence,
               e.event_type, e.task_id::text AS task_id, e.deleted_at::timestamptz AS deleted_at, e.prior_column::text AS prior_column,
               e.archived, e.writer_process_id::text AS writer_process_id, e.occurred_at::timestamptz AS occurred_at,
               e.payload_version::smallint AS payload_version, e.trace_context::text AS trace_context, e.txid,
               p.events, pg_catalog.count(*) OVER (PARTITION BY e.project_id) AS found
        FROM batch e
        JOIN parts p ON p.project OPERATOR(pg_catalog.=) e.project_id::text
        WINDOW w AS (PARTITION BY e.project_id ORDER BY e.txid, e.deleted_at, e.task_id COLLATE "C")
    ) n
    -- A part that did not come back whole is left out: the caller reads its project alone.
    WHERE n.found OPERATOR(pg_catalog.=) n.events;
END;
$$;

DO $$
DECLARE
    r record;
BEGIN
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_read_tick(text[], bigint[], bigint, integer) '
                              'SET search_path = pg_catalog, %I, pg_temp', pg_catalog.current_schema());
    ALTER FUNCTION lifecycle_outbox_read_tick(text[], bigint[], bigint, integer) SET plan_cache_mode = force_generic_plan;
    ALTER FUNCTION lifecycle_outbox_read_tick(text[], bigint[], bigint, integer) SET max_parallel_workers_per_gather = 0;
    -- As the other readers (0021, 0022): plans that walk indexes in order, whatever the
    -- statistics when a session first calls it.
    ALTER FUNCTION lifecycle_outbox_read_tick(text[], bigint[], bigint, integer) SET enable_seqscan = off;
    ALTER FUNCTION lifecycle_outbox_read_tick(text[], bigint[], bigint, integer) SET enable_bitmapscan = off;
    REVOKE EXECUTE ON FUNCTION lifecycle_outbox_read_tick(text[], bigint[], bigint, integer) FROM PUBLIC;
    -- Whoever may call the reader may call this one.
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role_name
        FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
        WHERE p.oid OPERATOR(pg_catalog.=) 'lifecycle_outbox_read(text, bigint, integer, xid8, timestamptz, text)'::regprocedure
          AND a.grantee OPERATOR(pg_catalog.<>) 0 AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
          AND a.privilege_type OPERATOR(pg_catalog.=) 'EXECUTE'
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION lifecycle_outbox_read_tick(text[], bigint[], bigint, integer) TO %s', r.role_name);
    END LOOP;
END;
$$;

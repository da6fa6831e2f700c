-- Reads that cost their own rows: the reader finds its parts by key, and the module's two hot
-- functions run on generic plans.
--
-- lifecycle_outbox_read walked every part of a project at or above the one holding p_after, to
-- sort them, and read each part's two snapshots with two more statements: a read at the head
-- cost one index entry per part still stored, so it slowed with the retention window. It now
-- finds the part holding p_after + 1 with one backward probe of the part key, then reads at
-- most p_limit + 1 parts forward, each with both snapshots joined in.
--
-- Both functions run each statement with a parameter on a plan made per call by default
-- (PostgreSQL keeps custom plans while they look cheaper than the generic one), and planning
-- the row-level security of every table was most of their cost: on one 2-core machine
-- (PostgreSQL 15, pgbench, one session, 2,000 parts) a read of ten events at the head took
-- 0.87 ms with custom plans and 0.33 ms with generic ones, and a tick of one event 0.67-0.75 ms
-- against 0.51-0.57 ms. plan_cache_mode = force_generic_plan keeps one plan per statement and
-- session. Every statement of the two is shaped so that its generic plan is an index scan
-- bounded by its parameters (the keyed reads continue the batch index in order). A generic plan
-- is costed on the table's size, not the part's: over a 200,000-event log the reader's read of a
-- part from its start planned two parallel workers for every call, so the reader plans none (a
-- worker's start costs more than a page of events). And a generic plan is made once per session
-- from the statistics of that moment: on tables not yet analyzed, the step that finds a
-- project's last part before a position planned a bitmap scan of all the project's parts and a
-- sort (401 part rows fetched for a read of three events, TestReadsAtTheHeadCostTheirOwnParts),
-- and a pooled session would keep that plan. Every statement of the two functions is meant to
-- walk an index in order, so they plan without sequential or bitmap scans.

CREATE OR REPLACE FUNCTION lifecycle_outbox_read(p_project text, p_after bigint, p_limit integer,
                                      p_key_txid xid8, p_key_deleted_at timestamptz, p_key_task_id text)
RETURNS TABLE (project_id text, sequence bigint, event_type lifecycle_event_type, task_id text, deleted_at timestamptz,
               prior_column text, archived boolean, writer_process_id text, occurred_at timestamptz,
               payload_version smallint, trace_context text, txid xid8)
LANGUAGE plpgsql STABLE
AS $$
#variable_conflict use_column
DECLARE
    v_after bigint := p_after;
    v_left  integer := p_limit;
    v_got   integer;
    v_part  record;
    v_cur   pg_snapshot;
    v_prev  pg_snapshot;
    v_list  xid8[];
    v_key   boolean;
    v_skip  bigint;
    v_start bigint;
BEGIN
    IF p_project IS NULL OR p_after IS NULL OR p_after OPERATOR(pg_catalog.<) 0
       OR p_limit IS NULL OR p_limit OPERATOR(pg_catalog.<) 1 OR p_limit OPERATOR(pg_catalog.>) 100000 THEN
        RAISE EXCEPTION 'p_project and p_after (at least 0) must be set and p_limit between 1 and 100000' USING ERRCODE = '22023';
    END IF;

    -- The stream numbered before schema 18: its sequences are all below the log's.
    IF EXISTS (SELECT 1 FROM lifecycle_outbox o
               WHERE o.project_id OPERATOR(pg_catalog.=) p_project AND o.sequence OPERATOR(pg_catalog.>) p_after) THEN
        RETURN QUERY
        SELECT o.project_id, o.sequence, o.event_type, o.task_id, o.deleted_at, o.prior_column, o.archived,
               o.writer_process_id, o.occurred_at, o.payload_version, o.trace_context, NULL::xid8
        FROM lifecycle_outbox o
        WHERE o.project_id OPERATOR(pg_catalog.=) p_project AND o.sequence OPERATOR(pg_catalog.>) p_after
        ORDER BY o.sequence
        LIMIT p_limit;
        GET DIAGNOSTICS v_got = ROW_COUNT;
        IF v_got OPERATOR(pg_catalog.>=) p_limit THEN
            RETURN;
        END IF;
        v_left := v_left OPERATOR(pg_catalog.-) v_got;
        SELECT pg_catalog.max(o.sequence) INTO v_after FROM lifecycle_outbox o WHERE o.project_id OPERATOR(pg_catalog.=) p_project;
    END IF;

    -- The part holding p_after + 1, found by one backward probe of the part key: the read
    -- starts there, or at the first part when retention removed the parts before it.
    SELECT tp.first_sequence INTO v_start FROM lifecycle_tick_project tp
    WHERE tp.project_id OPERATOR(pg_catalog.=) p_project AND tp.first_sequence OPERATOR(pg_catalog.<=) (v_after OPERATOR(pg_catalog.+) 1)
    ORDER BY tp.first_sequence DESC
    LIMIT 1;
    -- A plain value, not an expression: under row-level security only a leakproof condition
    -- is checked inside the index scan, and COALESCE is not one.
    v_start := coalesce(v_start, 0);

    -- Each part holds one event at least, so p_limit + 1 parts are enough whatever was read of
    -- the first; they come in key order with both snapshots, one forward scan of the part key.
    FOR v_part IN
        SELECT tp.tick_id, tp.first_sequence, tp.events, c.snapshot AS cur, b.snapshot AS prev
        FROM lifecycle_tick_project tp
        LEFT JOIN lifecycle_tick c ON c.tick_id OPERATOR(pg_catalog.=) tp.tick_id
        LEFT JOIN lifecycle_tick b ON b.tick_id OPERATOR(pg_catalog.=) (tp.tick_id OPERATOR(pg_catalog.-) 1)
        WHERE tp.project_id OPERATOR(pg_catalog.=) p_project
          AND tp.first_sequence OPERATOR(pg_catalog.>=) v_start
        ORDER BY tp.first_sequence
        LIMIT (p_limit OPERATOR(pg_catalog.+) 1)
    LOOP
        EXIT WHEN v_left OPERATOR(pg_catalog.<=) 0;
        CONTINUE WHEN (v_part.first_sequence OPERATOR(pg_catalog.+) v_part.events OPERATOR(pg_catalog.-) 1) OPERATOR(pg_catalog.<=) v_after;
        v_cur := v_part.cur;
        v_prev := v_part.prev;
        IF v_cur IS NULL OR v_prev IS NULL THEN
            RAISE EXCEPTION 'tick % of project % was pruned', v_part.tick_id, p_project USING ERRCODE = 'LX003';
        END IF;
        v_list := ARRAY(SELECT pg_catalog.pg_snapshot_xip(v_prev) EXCEPT SELECT pg_catalog.pg_snapshot_xip(v_cur));
        -- The caller's key continues inside the tick that holds p_after.
        v_key := p_key_txid IS NOT NULL AND v_after OPERATOR(pg_catalog.=) p_after
                 AND p_after OPERATOR(pg_catalog.>=) v_part.first_sequence;

        IF v_key THEN
            -- The transactions finished since the tick before come first (their IDs are all
            -- below that tick's xmax), then the range; each part is read in index order from
            -- the key, so a page costs its own rows only.
            IF p_key_txid OPERATOR(pg_catalog.<) pg_catalog.pg_snapshot_xmax(v_prev) THEN
                RETURN QUERY
                SELECT b.project_id::text, v_after OPERATOR(pg_catalog.+) pg_catalog.row_number() OVER w, b.event_type, b.task_id::text,
                       b.deleted_at::timestamptz, b.prior_column::text, b.archived, b.writer_process_id::text, b.occurred_at::timestamptz,
                       b.payload_version::smallint, b.trace_context::text, b.txid
                FROM (SELECT e.* FROM lifecycle_event_log e
                      WHERE e.txid OPERATOR(pg_catalog.=) ANY (v_list) AND e.project_id OPERATOR(pg_catalog.=) p_project
                        AND (e.txid, e.deleted_at::timestamptz, e.task_id::text COLLATE "C")
                            OPERATOR(pg_catalog.>) (p_key_txid, p_key_deleted_at, p_key_task_id COLLATE "C")
                      ORDER BY e.txid, e.deleted_at, e.task_id COLLATE "C" LIMIT v_left) b
                WINDOW w AS (ORDER BY b.txid, b.deleted_at, b.task_id COLLATE "C");
                GET DIAGNOSTICS v_got = ROW_COUNT;
                v_left := v_left OPERATOR(pg_catalog.-) v_got;
                v_after := v_after OPERATOR(pg_catalog.+) v_got;
                EXIT WHEN v_left OPERATOR(pg_catalog.<=) 0;
                RETURN QUERY
                SELECT b.project_id::text, v_after OPERATOR(pg_catalog.+) pg_catalog.row_number() OVER w, b.event_type, b.task_id::text,
                       b.deleted_at::timestamptz, b.prior_column::text, b.archived, b.writer_process_id::text, b.occurred_at::timestamptz,
                       b.payload_version::smallint, b.trace_context::text, b.txid
                FROM (SELECT e.* FROM lifecycle_event_log e
                      WHERE e.txid OPERATOR(pg_catalog.>=) pg_catalog.pg_snapshot_xmax(v_prev)
                        AND e.txid OPERATOR(pg_catalog.<) pg_catalog.pg_snapshot_xmax(v_cur)
                        AND pg_catalog.pg_visible_in_snapshot(e.txid, v_cur) AND e.project_id OPERATOR(pg_catalog.=) p_project
                      ORDER BY e.txid, e.deleted_at, e.task_id COLLATE "C" LIMIT v_left) b
                WINDOW w AS (ORDER BY b.txid, b.deleted_at, b.task_id COLLATE "C");
            ELSE
                RETURN QUERY
                SELECT b.project_id::text, v_after OPERATOR(pg_catalog.+) pg_catalog.row_number() OVER w, b.event_type, b.task_id::text,
                       b.deleted_at::timestamptz, b.prior_column::text, b.archived, b.writer_process_id::text, b.occurred_at::timestamptz,
                       b.payload_version::smallint, b.trace_context::text, b.txid
                FROM (SELECT e.* FROM lifecycle_event_log e
                      WHERE e.txid OPERATOR(pg_catalog.>=) p_key_txid
                        AND e.txid OPERATOR(pg_catalog.<) pg_catalog.pg_snapshot_xmax(v_cur)
                        AND pg_catalog.pg_visible_in_snapshot(e.txid, v_cur) AND e.project_id OPERATOR(pg_catalog.=) p_project
                        AND (e.txid, e.deleted_at::timestamptz, e.task_id::text COLLATE "C")
                            OPERATOR(pg_catalog.>) (p_key_txid, p_key_deleted_at, p_key_task_id COLLATE "C")
                      ORDER BY e.txid, e.deleted_at, e.task_id COLLATE "C" LIMIT v_left) b
                WINDOW w AS (ORDER BY b.txid, b.deleted_at, b.task_id COLLATE "C");
            END IF;
        ELSE
            v_skip := GREATEST(v_after OPERATOR(pg_catalog.-) v_part.first_sequence OPERATOR(pg_catalog.+) 1, 0);
            RETURN QUERY
            SELECT b.project_id::text, v_part.first_sequence OPERATOR(pg_catalog.+) v_skip OPERATOR(pg_catalog.-) 1 OPERATOR(pg_catalog.+) pg_catalog.row_number() OVER w,
                   b.event_type, b.task_id::text, b.deleted_at::timestamptz, b.prior_column::text, b.archived, b.writer_process_id::text,
                   b.occurred_at::timestamptz, b.payload_version::smallint, b.trace_context::text, b.txid
            FROM (SELECT u.* FROM (
                      SELECT e.* FROM lifecycle_event_log e
                      WHERE e.txid OPERATOR(pg_catalog.=) ANY (v_list) AND e.project_id OPERATOR(pg_catalog.=) p_project
                      UNION ALL
                      SELECT e.* FROM lifecycle_event_log e
                      WHERE e.txid OPERATOR(pg_catalog.>=) pg_catalog.pg_snapshot_xmax(v_prev)
                        AND e.txid OPERATOR(pg_catalog.<) pg_catalog.pg_snapshot_xmax(v_cur)
                        AND pg_catalog.pg_visible_in_snapshot(e.txid, v_cur) AND e.project_id OPERATOR(pg_catalog.=) p_project) u
                  ORDER BY u.txid, u.deleted_at, u.task_id COLLATE "C" OFFSET v_skip LIMIT v_left) b
            WINDOW w AS (ORDER BY b.txid, b.deleted_at, b.task_id COLLATE "C");
        END IF;
        GET DIAGNOSTICS v_got = ROW_COUNT;
        v_left := v_left OPERATOR(pg_catalog.-) v_got;
        -- A read that began below this part (the parts before it were pruned) now stands
        -- where the part began plus what it returned.
        v_after := GREATEST(v_after, (v_part.first_sequence OPERATOR(pg_catalog.-) 1)) OPERATOR(pg_catalog.+) v_got;
        -- A part that returned fewer rows than it counted lost some: stop here, so the caller
        -- sees the hole (the next sequence it reads is not the one after its last).
        EXIT WHEN v_left OPERATOR(pg_catalog.>) 0
                  AND v_after OPERATOR(pg_catalog.<) (v_part.first_sequence OPERATOR(pg_catalog.+) v_part.events OPERATOR(pg_catalog.-) 1);
    END LOOP;
END;
$$;

-- CREATE OR REPLACE clears a function's settings: the reader's search path again, as 0019 set
-- it, and generic plans for both functions. No EXECUTE for PUBLIC, as before.
DO $$
BEGIN
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_read(text, bigint, integer, xid8, timestamptz, text) '
                              'SET search_path = pg_catalog, %I, pg_temp', pg_catalog.current_schema());
    ALTER FUNCTION lifecycle_outbox_read(text, bigint, integer, xid8, timestamptz, text) SET plan_cache_mode = force_generic_plan;
    ALTER FUNCTION lifecycle_outbox_read(text, bigint, integer, xid8, timestamptz, text) SET max_parallel_workers_per_gather = 0;
    ALTER FUNCTION lifecycle_outbox_read(text, bigint, integer, xid8, timestamptz, text) SET enable_seqscan = off;
    ALTER FUNCTION lifecycle_outbox_read(text, bigint, integer, xid8, timestamptz, text) SET enable_bitmapscan = off;
    ALTER FUNCTION lifecycle_outbox_tick(text) SET plan_cache_mode = force_generic_plan;
    ALTER FUNCTION lifecycle_outbox_tick(text) SET enable_seqscan = off;
    ALTER FUNCTION lifecycle_outbox_tick(text) SET enable_bitmapscan = off;
    REVOKE EXECUTE ON FUNCTION lifecycle_outbox_read(text, bigint, integer, xid8, timestamptz, text) FROM PUBLIC;
END;
$$;

-- The tick announces its ID.
--
-- A consumer that reads from a hot standby (Config.ReadDSN) must not read a tick's events there
-- before the standby has replayed that tick. Until now each scan learned which tick to wait for
-- by reading the primary's newest tick, one statement on the primary per scan and per consumer.
-- Now the ticker's notifications say it: before the notifications naming its projects, each tick
-- sends 'tick/<tick_id>' on the same channel. The payload is not a project ID ('/' is not
-- allowed in one), so consumers of earlier builds skip it as not theirs and keep working during a
-- rolling deploy. A notification is only a hint that anyone who may connect can send: a consumer
-- checks an announced tick on the primary before it lets a standby that has not replayed it make
-- it wait long or leave the standby.
--
-- lifecycle_outbox_unticked() says whether events committed that no tick numbered, in any
-- project. The elected ticker, idle, ticked once per PollInterval to bound the wait of an event
-- whose writer sent no hint (it died between its commit and its hint); now the consumer whose
-- ticker is elected asks this with its poll's read of heads, which costs no statement of its
-- own, and tells its ticker, so the idle ticker ticks once per TickFallbackInterval. It runs as
-- its owner, so that one consumer's question covers every project whatever its role may read
-- (it says no more than whether a tick would number something, which any consumer may cause
-- by ticking), on generic plans planned once per session: planned with each read of heads, its
-- statements cost more server CPU than the idle ticks they replace.

-- lifecycle_outbox_tick as in 0020, but the tick announces its own ID before its projects.
CREATE OR REPLACE FUNCTION lifecycle_outbox_tick(p_channel text)
RETURNS TABLE (tick_id bigint, projects integer, events bigint, legacy boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET lock_timeout = '1s'
AS $$
#variable_conflict use_column
DECLARE
    v_last_id  bigint;
    v_last     pg_snapshot;
    v_cur      pg_snapshot;
    v_list     xid8[];
    v_id       bigint;
    v_projects integer;
    v_events   bigint;
    v_legacy   boolean;
    v_xmax     numeric;
    v_newest   xid8;
BEGIN
    IF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed' THEN
        RAISE EXCEPTION 'lifecycle_outbox_tick must run in a READ COMMITTED transaction' USING ERRCODE = '25001';
    END IF;
    LOCK TABLE lifecycle_tick IN SHARE ROW EXCLUSIVE MODE;
    PERFORM pg_catalog.set_config('synchronous_commit', 'on', true);

    SELECT t.tick_id, t.snapshot INTO v_last_id, v_last FROM lifecycle_tick t ORDER BY t.tick_id DESC LIMIT 1;
    IF v_last_id IS NULL THEN
        RAISE EXCEPTION 'lifecycle_tick holds no tick: the schema was changed by hand' USING ERRCODE = 'LX002';
    END IF;
    -- The newest stored event, read before the snapshot below: its transaction had ended by
    -- then, so its ID is below the snapshot's xmax. (One backward probe of the batch index.)
    SELECT pg_catalog.max(e.txid) INTO v_newest FROM lifecycle_event_log e;
    -- A new statement, so a new snapshot: taken after the lock, after the last tick committed.
    SELECT pg_catalog.pg_current_snapshot() INTO v_cur;

    -- Every transaction ID the last tick or a stored event names was handed out before this
    -- snapshot, so each is below its xmax; one that is not comes from another cluster.

    IF pg_catalog.pg_snapshot_xmax(v_last) OPERATOR(pg_catalog.>) pg_catalog.pg_snapshot_xmax(v_cur)
       OR v_newest OPERATOR(pg_catalog.>=) pg_catalog.pg_snapshot_xmax(v_cur) THEN
        v_xmax := GREATEST(pg_catalog.pg_snapshot_xmax(v_last)::text::numeric,
                           coalesce(v_newest::text::numeric OPERATOR(pg_catalog.+) 1, 0));
        RAISE EXCEPTION 'the cluster''s transaction IDs are behind tick % or the events stored (up to %; the cluster is at %): the database was moved into another cluster by a logical dump or logical replication, and ticking now would hide events',
            v_last_id, v_xmax, pg_catalog.pg_snapshot_xmax(v_cur)
            USING ERRCODE = 'LX001',
                  HINT = pg_catalog.format('Stop the new cluster and run pg_resetwal --epoch=%s on it before opening it (docs/operations.md, "Moving the database").',
                                           pg_catalog.floor(v_xmax OPERATOR(pg_catalog./) 4294967296) OPERATOR(pg_catalog.+) 1);
    END IF;

    v_legacy := EXISTS (SELECT 1 FROM lifecycle_outbox_pending)
                OR EXISTS (SELECT 1 FROM lifecycle_outbox o WHERE o.sequence IS NULL);

    -- The transactions open at the last tick that have finished since. Bounded by the number
    -- of transactions that can be open at once, however long any of them has been open.
    v_list := ARRAY(SELECT pg_catalog.pg_snapshot_xip(v_last) EXCEPT SELECT pg_catalog.pg_snapshot_xip(v_cur));
    v_id := v_last_id OPERATOR(pg_catalog.+) 1;

    WITH batch AS (
        SELECT e.project_id FROM lifecycle_event_log e WHERE e.txid OPERATOR(pg_catalog.=) ANY (v_list)
        UNION ALL
        SELECT e.project_id FROM lifecycle_event_log e
        WHERE e.txid OPERATOR(pg_catalog.>=) pg_catalog.pg_snapshot_xmax(v_last)
          AND e.txid OPERATOR(pg_catalog.<) pg_catalog.pg_snapshot_xmax(v_cur)
          AND pg_catalog.pg_visible_in_snapshot(e.txid, v_cur)
    ), counted AS (
        SELECT b.project_id::text AS project_id, pg_catalog.count(*) AS n FROM batch b GROUP BY 1
    ), known AS (
        -- A heads row for a project numbered the first time; nothing is written for the others.
        INSERT INTO lifecycle_outbox_heads (project_id)
        SELECT c.project_id FROM counted c ORDER BY c.project_id
        ON CONFLICT (project_id) DO NOTHING
        RETURNING 1
    ), parts AS (
        -- Each project's part numbers on from its last part, or from its head row (the frozen
        -- stream's head, raised by retention when it pruned every part).
        INSERT INTO lifecycle_tick_project (tick_id, project_id, first_sequence, events)
        SELECT v_id, c.project_id,
               GREATEST(coalesce((SELECT tp.first_sequence OPERATOR(pg_catalog.+) tp.events FROM lifecycle_tick_project tp
                                  WHERE tp.project_id OPERATOR(pg_catalog.=) c.project_id ORDER BY tp.first_sequence DESC LIMIT 1), 1),
                        coalesce((SELECT h.last_sequence OPERATOR(pg_catalog.+) 1 FROM lifecycle_outbox_heads h
                                  WHERE h.project_id OPERATOR(pg_catalog.=) c.project_id), 1)),
               c.n
        FROM counted c
        RETURNING lifecycle_tick_project.project_id, lifecycle_tick_project.events
    )
    SELECT pg_catalog.count(*), coalesce(pg_catalog.sum(p.events), 0) INTO v_projects, v_events FROM parts p;

    IF v_projects OPERATOR(pg_catalog.=) 0 THEN
        RETURN QUERY SELECT NULL::bigint, 0, 0::bigint, v_legacy;
        RETURN;
    END IF;
    INSERT INTO lifecycle_tick (tick_id, snapshot) VALUES (v_id, v_cur);
    IF p_channel IS NOT NULL THEN
        -- The tick's ID first, then its projects: notifications of one transaction arrive in
        -- the order they were sent, so a consumer knows which tick woke it before it scans.
        PERFORM pg_catalog.pg_notify(p_channel, 'tick/' OPERATOR(pg_catalog.||) v_id::text);
        PERFORM pg_catalog.pg_notify(p_channel, p.project_id::text)
        FROM lifecycle_tick_project p WHERE p.tick_id OPERATOR(pg_catalog.=) v_id ORDER BY p.project_id;
    END IF;
    RETURN QUERY SELECT v_id, v_projects, v_events, v_legacy;
END;
$$;


CREATE FUNCTION lifecycle_outbox_unticked()
RETURNS boolean
LANGUAGE plpgsql STABLE SECURITY DEFINER
AS $$
DECLARE
    v_snapshot pg_snapshot;
BEGIN
    SELECT t.snapshot INTO v_snapshot FROM lifecycle_tick t ORDER BY t.tick_id DESC LIMIT 1;
    IF v_snapshot IS NULL THEN
        RETURN false;
    END IF;
    -- A transaction that started after the newest tick's snapshot (from its xmax on, by the
    -- batch index), or one the snapshot shows as running (one probe each: at most as many as
    -- can be open at once), has committed an event; or a writer of schema 16 or earlier left
    -- rows for the ticker to adopt. Rows of transactions still running are not visible.
    RETURN EXISTS (SELECT 1 FROM lifecycle_event_log e
                   WHERE e.txid OPERATOR(pg_catalog.>=) pg_catalog.pg_snapshot_xmax(v_snapshot))
        OR EXISTS (SELECT 1 FROM pg_catalog.pg_snapshot_xip(v_snapshot) AS x (txid),
                   LATERAL (SELECT 1 FROM lifecycle_event_log e WHERE e.txid OPERATOR(pg_catalog.=) x.txid LIMIT 1) AS y)
        OR EXISTS (SELECT 1 FROM lifecycle_outbox_pending)
        OR EXISTS (SELECT 1 FROM lifecycle_outbox o WHERE o.sequence IS NULL);
END;
$$;

DO $$
DECLARE
    r record;
BEGIN
    -- CREATE OR REPLACE clears a function's settings: the ticker's again, as 0020 and 0021
    -- set them.
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_tick(text) SET search_path = pg_catalog, %I, pg_temp', pg_catalog.current_schema());
    ALTER FUNCTION lifecycle_outbox_tick(text) SET plan_cache_mode = force_generic_plan;
    ALTER FUNCTION lifecycle_outbox_tick(text) SET enable_seqscan = off;
    ALTER FUNCTION lifecycle_outbox_tick(text) SET enable_bitmapscan = off;
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_unticked() SET search_path = pg_catalog, %I, pg_temp', pg_catalog.current_schema());
    -- As the readers (0021, 0022): one generic plan per statement and session, walking indexes.
    ALTER FUNCTION lifecycle_outbox_unticked() SET plan_cache_mode = force_generic_plan;
    ALTER FUNCTION lifecycle_outbox_unticked() SET max_parallel_workers_per_gather = 0;
    ALTER FUNCTION lifecycle_outbox_unticked() SET enable_seqscan = off;
    ALTER FUNCTION lifecycle_outbox_unticked() SET enable_bitmapscan = off;
    REVOKE EXECUTE ON FUNCTION lifecycle_outbox_unticked() FROM PUBLIC;
    -- Whoever may tick may ask.
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role_name
        FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
        WHERE p.oid OPERATOR(pg_catalog.=) 'lifecycle_outbox_tick(text)'::regprocedure
          AND a.grantee OPERATOR(pg_catalog.<>) 0 AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
          AND a.privilege_type OPERATOR(pg_catalog.=) 'EXECUTE'
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION lifecycle_outbox_unticked() TO %s', r.role_name);
    END LOOP;
END;
$$;

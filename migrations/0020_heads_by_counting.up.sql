-- Heads by counting: a tick writes no version of a heads row.
--
-- Until now each tick raised the head of every project it numbered, an UPDATE of the same heads
-- row many times a second. While an unrelated transaction held an xid open, none of those row
-- versions could be pruned, and every lookup of a head (the ticker's, each consumer's scan, the
-- status) walked all of them: in outbox-bench longtx (1,000 deletes/s, 300 s, an xid held open
-- throughout) the tick's mean time grew from 3.0 ms in the first minute to 13.3 ms in the last,
-- and the delivery p99 from 68 ms to 293 ms.
--
-- Now a project's head is where its last part ends (lifecycle_tick_project, one backward probe
-- of its sequence key), or its heads row's last_sequence when it has no part: the frozen
-- stream's head, raised by retention to what it pruned. The view lifecycle_outbox_head gives
-- both, with the pruned floor, as the caller sees them (security_invoker: row-level security of
-- the caller applies). The ticker inserts a heads row only for a project it numbers the first
-- time, and otherwise writes nothing but the tick and its parts, which are only ever inserted.

-- A project's head and pruned floor, as the caller may see them.
CREATE VIEW lifecycle_outbox_head WITH (security_invoker = true) AS
SELECT h.project_id, GREATEST(h.last_sequence, coalesce(t.last_sequence, 0)) AS last_sequence, h.pruned_through
FROM lifecycle_outbox_heads h
LEFT JOIN LATERAL (
    SELECT (tp.first_sequence OPERATOR(pg_catalog.+) tp.events) OPERATOR(pg_catalog.-) 1 AS last_sequence
    FROM lifecycle_tick_project tp
    WHERE tp.project_id OPERATOR(pg_catalog.=) h.project_id
    ORDER BY tp.first_sequence DESC
    LIMIT 1
) t ON true;

-- Whoever may read the heads may read them through the view.
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role_name
        FROM pg_catalog.pg_class c, pg_catalog.aclexplode(c.relacl) a
        WHERE c.oid OPERATOR(pg_catalog.=) 'lifecycle_outbox_heads'::regclass AND a.grantee OPERATOR(pg_catalog.<>) 0
          AND a.grantee OPERATOR(pg_catalog.<>) c.relowner AND a.privilege_type OPERATOR(pg_catalog.=) 'SELECT'
    LOOP
        EXECUTE pg_catalog.format('GRANT SELECT ON lifecycle_outbox_head TO %s', r.role_name);
    END LOOP;
END;
$$;

-- lifecycle_outbox_tick as in 0018, but a part numbers on from the project's last part.
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
        PERFORM pg_catalog.pg_notify(p_channel, p.project_id::text)
        FROM lifecycle_tick_project p WHERE p.tick_id OPERATOR(pg_catalog.=) v_id ORDER BY p.project_id;
    END IF;
    RETURN QUERY SELECT v_id, v_projects, v_events, v_legacy;
END;
$$;

-- lifecycle_outbox_prune as in 0019, but the head comes from the view, and the heads row's
-- last_sequence rises with the floor.
CREATE OR REPLACE FUNCTION lifecycle_outbox_prune(p_project text, p_limit integer, p_after bigint, p_offset interval, p_window interval)
RETURNS TABLE (pruned bigint, max_sequence bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
#variable_conflict use_column
DECLARE
    v_roles   name[];
    v_through bigint;
    v_before  timestamptz;
    v_pruned  bigint := 0;  -- events deleted, frozen stream and log
    v_max     bigint := 0;  -- the highest sequence deleted
    v_taken   bigint := 0;  -- events counted by the parts deleted, towards p_limit
    v_part    record;
    v_cur     pg_snapshot;
    v_prev    pg_snapshot;
    v_list    xid8[];
    v_rows    bigint;
BEGIN
    IF p_project IS NULL OR p_limit IS NULL OR p_limit OPERATOR(pg_catalog.<) 1 OR p_limit OPERATOR(pg_catalog.>) 100000 THEN
        RAISE EXCEPTION 'p_project must be set and p_limit between 1 and 100000' USING ERRCODE = '22023';
    END IF;
    IF p_after IS NULL OR p_offset IS NULL OR p_window IS NULL OR p_window OPERATOR(pg_catalog.<) '1 hour'::interval THEN
        RAISE EXCEPTION 'p_after and p_offset must be set and p_window at least an hour' USING ERRCODE = '22023';
    END IF;
    v_roles := ARRAY(SELECT r.rolname FROM pg_catalog.pg_roles r WHERE pg_catalog.pg_has_role(SESSION_USER, r.oid, 'MEMBER'));
    IF NOT EXISTS (SELECT 1 FROM lifecycle_project_access a
                   WHERE a.role_name OPERATOR(pg_catalog.=) ANY (v_roles)
                     AND (a.project_id OPERATOR(pg_catalog.=) '*' OR a.project_id OPERATOR(pg_catalog.=) p_project)) THEN
        RAISE EXCEPTION 'permission denied to prune project %', p_project USING ERRCODE = '42501';
    END IF;

    -- The slowest live cursor, read in this transaction: one created or reinstated since the
    -- caller planned holds its events back too. A cursor never positioned counts as zero.
    v_through := coalesce(
        (SELECT pg_catalog.min(coalesce(c.last_acked_sequence, 0)) FROM lifecycle_consumer_cursors c
         WHERE c.project_id OPERATOR(pg_catalog.=) p_project AND c.retired_at IS NULL),
        (SELECT h.last_sequence FROM lifecycle_outbox_head h WHERE h.project_id OPERATOR(pg_catalog.=) p_project),
        0);
    v_before := (pg_catalog.now() OPERATOR(pg_catalog.+) p_offset) OPERATOR(pg_catalog.-) p_window;

    IF v_through OPERATOR(pg_catalog.>) 0 THEN
        -- The frozen stream, row by row. From above p_after: a batch that started from the
        -- bottom again would step over the index entries of every row the sweep deleted so far.
        WITH doomed AS (
            SELECT o.ctid AS row_id FROM lifecycle_outbox o
            WHERE o.project_id OPERATOR(pg_catalog.=) p_project AND o.sequence IS NOT NULL
              AND o.sequence OPERATOR(pg_catalog.<=) v_through AND o.sequence OPERATOR(pg_catalog.>) p_after
              AND o.occurred_at OPERATOR(pg_catalog.<) v_before
              AND NOT EXISTS (
                  SELECT 1 FROM lifecycle_consumer_deliveries d
                  JOIN lifecycle_consumer_cursors c ON c.project_id OPERATOR(pg_catalog.=) d.project_id
                                                   AND c.consumer_id OPERATOR(pg_catalog.=) d.consumer_id
                  WHERE d.project_id OPERATOR(pg_catalog.=) o.project_id AND d.sequence OPERATOR(pg_catalog.=) o.sequence
                    AND d.state OPERATOR(pg_catalog.<>) 'resolved' AND c.retired_at IS NULL)
            ORDER BY o.sequence
            LIMIT p_limit
        ), gone AS (
            DELETE FROM lifecycle_outbox o USING doomed WHERE o.ctid OPERATOR(pg_catalog.=) doomed.row_id
            RETURNING o.sequence
        )
        SELECT pg_catalog.count(*), coalesce(pg_catalog.max(gone.sequence), 0) INTO v_pruned, v_max FROM gone;
        v_taken := v_pruned;

        -- The log, whole parts in tick order (a project's parts are in sequence order), from
        -- above p_after as for the stream. A part whose tick is inside the window ends the
        -- batch: ticks are taken one at a time, so every later one is newer.
        FOR v_part IN
            SELECT tp.tick_id, tp.first_sequence, tp.events,
                   ((tp.first_sequence OPERATOR(pg_catalog.+) tp.events) OPERATOR(pg_catalog.-) 1) AS last_sequence,
                   t.ticked_at
            FROM lifecycle_tick_project tp
            LEFT JOIN lifecycle_tick t ON t.tick_id OPERATOR(pg_catalog.=) tp.tick_id
            WHERE tp.project_id OPERATOR(pg_catalog.=) p_project
              AND tp.first_sequence OPERATOR(pg_catalog.>) p_after AND tp.first_sequence OPERATOR(pg_catalog.<=) v_through
            ORDER BY tp.first_sequence
        LOOP
            EXIT WHEN v_taken OPERATOR(pg_catalog.>=) p_limit;
            -- A cursor inside the part keeps all of it, and all that follows.
            EXIT WHEN v_part.last_sequence OPERATOR(pg_catalog.>) v_through;
            EXIT WHEN v_part.ticked_at OPERATOR(pg_catalog.>=) v_before;
            -- An open delivery of a live consumer anywhere in the part keeps the part.
            CONTINUE WHEN EXISTS (
                SELECT 1 FROM lifecycle_consumer_deliveries d
                JOIN lifecycle_consumer_cursors c ON c.project_id OPERATOR(pg_catalog.=) d.project_id
                                                 AND c.consumer_id OPERATOR(pg_catalog.=) d.consumer_id
                WHERE d.project_id OPERATOR(pg_catalog.=) p_project
                  AND d.sequence OPERATOR(pg_catalog.>=) v_part.first_sequence
                  AND d.sequence OPERATOR(pg_catalog.<=) v_part.last_sequence
                  AND d.state OPERATOR(pg_catalog.<>) 'resolved' AND c.retired_at IS NULL);

            -- The part's row first: it locks the part against a concurrent prune of the same
            -- project, and finds it gone when that one took it (and may have removed its ticks).
            DELETE FROM lifecycle_tick_project tp
            WHERE tp.tick_id OPERATOR(pg_catalog.=) v_part.tick_id AND tp.project_id OPERATOR(pg_catalog.=) p_project;
            GET DIAGNOSTICS v_rows = ROW_COUNT;
            CONTINUE WHEN v_rows OPERATOR(pg_catalog.=) 0;

            -- While the row existed no tick it needs could go: read its batch's bounds.
            v_cur := NULL;
            v_prev := NULL;
            SELECT c.snapshot, p.snapshot INTO v_cur, v_prev
            FROM lifecycle_tick c, lifecycle_tick p
            WHERE c.tick_id OPERATOR(pg_catalog.=) v_part.tick_id
              AND p.tick_id OPERATOR(pg_catalog.=) (v_part.tick_id OPERATOR(pg_catalog.-) 1);
            IF v_cur IS NULL OR v_prev IS NULL THEN
                RAISE EXCEPTION 'tick % of project % or the one before it is missing: the schema was changed by hand', v_part.tick_id, p_project
                    USING ERRCODE = 'LX003';
            END IF;

            -- The transactions open at the tick before that finished by this one, then the
            -- range; the same two halves the ticker counted, each by the batch index.
            v_list := ARRAY(SELECT pg_catalog.pg_snapshot_xip(v_prev) EXCEPT SELECT pg_catalog.pg_snapshot_xip(v_cur));
            IF pg_catalog.cardinality(v_list) OPERATOR(pg_catalog.>) 0 THEN
                DELETE FROM lifecycle_event_log e
                WHERE e.txid OPERATOR(pg_catalog.=) ANY (v_list) AND e.project_id OPERATOR(pg_catalog.=) p_project;
                GET DIAGNOSTICS v_rows = ROW_COUNT;
                v_pruned := v_pruned OPERATOR(pg_catalog.+) v_rows;
            END IF;
            DELETE FROM lifecycle_event_log e
            WHERE e.txid OPERATOR(pg_catalog.>=) pg_catalog.pg_snapshot_xmax(v_prev)
              AND e.txid OPERATOR(pg_catalog.<) pg_catalog.pg_snapshot_xmax(v_cur)
              AND pg_catalog.pg_visible_in_snapshot(e.txid, v_cur)
              AND e.project_id OPERATOR(pg_catalog.=) p_project;
            GET DIAGNOSTICS v_rows = ROW_COUNT;
            v_pruned := v_pruned OPERATOR(pg_catalog.+) v_rows;
            v_taken := v_taken OPERATOR(pg_catalog.+) v_part.events;
            v_max := GREATEST(v_max, v_part.last_sequence);
        END LOOP;

        -- The heads row after the deletes. Its last_sequence rises with the floor: once every
        -- part of a project is gone, the ticker numbers on from it.
        IF v_max OPERATOR(pg_catalog.>) 0 THEN
            UPDATE lifecycle_outbox_heads h
            SET pruned_through = GREATEST(h.pruned_through, v_max), last_sequence = GREATEST(h.last_sequence, v_max),
                pruned_at = (pg_catalog.now() OPERATOR(pg_catalog.+) p_offset)
            WHERE h.project_id OPERATOR(pg_catalog.=) p_project;
        END IF;
    END IF;

    -- The ticks no remaining part needs (a part at tick t reads ticks t and t-1), oldest first,
    -- at most p_limit, never the newest. Only when the owner sees every project's parts, as the
    -- migrations grant it: a part it could not see would lose its ticks.
    IF EXISTS (SELECT 1 FROM lifecycle_project_access a
               WHERE a.role_name OPERATOR(pg_catalog.=) CURRENT_USER AND a.project_id OPERATOR(pg_catalog.=) '*')
       AND EXISTS (SELECT 1 FROM lifecycle_tick t
                   WHERE t.tick_id OPERATOR(pg_catalog.<) LEAST(
                       coalesce(((SELECT pg_catalog.min(tp.tick_id) FROM lifecycle_tick_project tp) OPERATOR(pg_catalog.-) 1),
                                (SELECT pg_catalog.max(k.tick_id) FROM lifecycle_tick k)),
                       (SELECT pg_catalog.max(k.tick_id) FROM lifecycle_tick k))) THEN
        BEGIN
            -- Never wait for the ticker; and once held, the ticker waits only for this commit.
            LOCK TABLE lifecycle_tick IN ROW EXCLUSIVE MODE NOWAIT;
            -- A new statement, so a snapshot taken under the lock: every tick committed.
            DELETE FROM lifecycle_tick t
            USING (SELECT (SELECT pg_catalog.min(tp.tick_id) FROM lifecycle_tick_project tp) AS needed,
                          (SELECT pg_catalog.min(k.tick_id) FROM lifecycle_tick k) AS oldest,
                          (SELECT pg_catalog.max(k.tick_id) FROM lifecycle_tick k) AS newest) b
            WHERE t.tick_id OPERATOR(pg_catalog.<) LEAST(coalesce((b.needed OPERATOR(pg_catalog.-) 1), b.newest), b.newest)
              AND t.tick_id OPERATOR(pg_catalog.<) (b.oldest OPERATOR(pg_catalog.+) p_limit);
        EXCEPTION WHEN lock_not_available OR deadlock_detected THEN
            NULL; -- the ticker holds the table, or a concurrent prune the same ticks: the next call goes on
        END;
    END IF;

    RETURN QUERY SELECT v_pruned, v_max;
END;
$$;

DO $$
BEGIN
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_tick(text) SET search_path = pg_catalog, %I, pg_temp', pg_catalog.current_schema());
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_prune(text, integer, bigint, interval, interval) '
                              'SET search_path = pg_catalog, %I, pg_temp', pg_catalog.current_schema());
END;
$$;

-- Retention of the event log: a project's part of a tick goes whole, and ticks go once no part
-- needs them.
--
-- Since schema 18 an event's sequence is not stored: it is the first sequence of its project's
-- part of its tick plus its rank in that part (lifecycle_tick_project, lifecycle_outbox_read).
-- Deleting some events of a part would renumber the others, so that a consumer would see a
-- sequence it acknowledged carry another event and skip the one it had not. Pruning therefore
-- deletes a project's part of a tick whole, its events and its row together, or not at all:
--   - only when its last sequence (first_sequence + events - 1) is at or below the slowest live
--     cursor: a cursor inside a part keeps the whole part;
--   - only when its tick is older than the window;
--   - never when an open delivery of a live consumer points into it (a dead letter must stay
--     replayable);
--   - in tick order, from above where the sweep's last batch ended, until the batch's limit is
--     reached, and at least one part however large (a part is never split).
-- A part's events are exactly the project's events of its tick's batch: those whose transaction
-- is visible in the tick's snapshot and was not in the previous tick's (the batch predicate of
-- lifecycle_outbox_tick and lifecycle_outbox_read). The floor rises, as before, to the highest
-- sequence deleted, in the same transaction.
--
-- A tick holds no project data, but reading a part needs its tick and the one before it. Once
-- no remaining part needs a tick it is deleted, oldest first and a bounded number per call,
-- except the newest: the ticker takes each new tick's batch from it. That delete conflicts
-- with the ticker's SHARE ROW EXCLUSIVE lock, so it is tried without waiting, after everything
-- else, and left to the next call when the ticker holds the table: waiting there could also
-- deadlock against a ticker waiting for the heads row this call has just updated.
--
-- The frozen stream of before schema 18 (lifecycle_outbox) is pruned row by row as in 0017.

-- lifecycle_outbox_prune deletes events of p_project above p_after that every live consumer
-- acknowledged, that are older than p_window on the caller's clock (now shifted by p_offset),
-- and that no open delivery of a live consumer points at: first rows of the frozen stream, up
-- to p_limit of them; then, while fewer than p_limit events were taken, whole parts of the log.
-- It raises the floor to the highest sequence it deleted, then deletes the ticks no remaining
-- part needs. It returns how many events it deleted and that sequence (0 when none). The
-- caller's projects are those granted to the session's login role or a role it is a member of.
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
        (SELECT h.last_sequence FROM lifecycle_outbox_heads h WHERE h.project_id OPERATOR(pg_catalog.=) p_project),
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

        -- The heads row, which the ticker locks, after the deletes: the ticker waits at most
        -- for this commit.
        IF v_max OPERATOR(pg_catalog.>) 0 THEN
            UPDATE lifecycle_outbox_heads h
            SET pruned_through = GREATEST(h.pruned_through, v_max), pruned_at = (pg_catalog.now() OPERATOR(pg_catalog.+) p_offset)
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

-- lifecycle_outbox_read, as in 0018 but for where a read stands after a part that began above
-- it. A read starting below the first stored part (once retention removed the parts before it:
-- the event stream's replay reads pages from aligned starts, a tool reads from 0) counted what
-- it returned from where it started instead of from the part's start, took the next part for
-- a hole, and stopped after the first part.
--
-- It returns up to p_limit events of p_project numbered after p_after, in order, with their
-- sequences: first from the frozen stream, then tick by tick from the log. It runs as the
-- caller, so row-level security shows it only the projects granted to it. p_key_* is the key
-- (txid, deleted_at, task_id) of the event at p_after, when the caller has it; see 0018.
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

    FOR v_part IN
        SELECT tp.tick_id, tp.first_sequence, tp.events FROM lifecycle_tick_project tp
        WHERE tp.project_id OPERATOR(pg_catalog.=) p_project
          AND tp.first_sequence OPERATOR(pg_catalog.>=) coalesce(
              (SELECT pg_catalog.max(t.first_sequence) FROM lifecycle_tick_project t
               WHERE t.project_id OPERATOR(pg_catalog.=) p_project AND t.first_sequence OPERATOR(pg_catalog.<=) (v_after OPERATOR(pg_catalog.+) 1)), 0)
        ORDER BY tp.first_sequence
    LOOP
        EXIT WHEN v_left OPERATOR(pg_catalog.<=) 0;
        CONTINUE WHEN (v_part.first_sequence OPERATOR(pg_catalog.+) v_part.events OPERATOR(pg_catalog.-) 1) OPERATOR(pg_catalog.<=) v_after;
        SELECT t.snapshot INTO v_cur FROM lifecycle_tick t WHERE t.tick_id OPERATOR(pg_catalog.=) v_part.tick_id;
        SELECT t.snapshot INTO v_prev FROM lifecycle_tick t WHERE t.tick_id OPERATOR(pg_catalog.=) (v_part.tick_id OPERATOR(pg_catalog.-) 1);
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

-- As 0017 and 0018 set them: the module's schema pinned after pg_catalog, no EXECUTE for
-- PUBLIC (the grants to the roles are the functions' own and outlive the new definitions).
DO $$
BEGIN
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_prune(text, integer, bigint, interval, interval) '
                              'SET search_path = pg_catalog, %I, pg_temp', pg_catalog.current_schema());
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_read(text, bigint, integer, xid8, timestamptz, text) '
                              'SET search_path = pg_catalog, %I, pg_temp', pg_catalog.current_schema());
    REVOKE EXECUTE ON FUNCTION lifecycle_outbox_prune(text, integer, bigint, interval, interval) FROM PUBLIC;
    REVOKE EXECUTE ON FUNCTION lifecycle_outbox_read(text, bigint, integer, xid8, timestamptz, text) FROM PUBLIC;
END;
$$;

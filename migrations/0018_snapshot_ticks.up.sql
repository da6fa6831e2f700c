-- Ordering by snapshot ticks: each event written once, one numbering actor, consumers that read.
--
-- Until now a writer inserted a pending row and consumers ran the sequencer, which deleted
-- pending rows and inserted them, numbered, into the stream: every event was written twice,
-- every consumer repeated the numbering, and while an unrelated transaction held an xid open
-- the deleted pending rows could not be vacuumed, so every sequencer call walked all of them
-- again (a step grew from 4 ms to 53 ms within 30 s at 1,000 deletes/s).
--
-- Now a writer inserts the event once into lifecycle_event_log, with the writing transaction's
-- ID (txid), and nothing ever updates it. A ticker (lifecycle_outbox_tick, one at a time)
-- stores the current transaction snapshot as a tick whenever events committed since the last
-- tick. Tick n's batch is the events whose transaction is visible in tick n's snapshot and was
-- not in tick n-1's: every committed event falls in exactly one batch (the first tick taken
-- after its commit), whatever else is still open, and a rolled-back one in none. The ticker
-- counts each batch per project and stores one row per (tick, project): the project's part of
-- the batch, numbered from the project's head on. An event's sequence is then
--     first_sequence + its rank in the project's part of the tick - 1,
-- ranked by (txid, deleted_at, task_id), computed when it is read (lifecycle_outbox_read). It
-- is the same contiguous per-project sequence as before: cursors, Last-Event-ID, replay,
-- status and reconciliation keep their meaning, and the head goes on from where the stream
-- stopped, with no cursor rewritten.
--
-- The stream (lifecycle_outbox) is frozen: it keeps the events numbered before this
-- migration, up to each project's head, and lifecycle_outbox_read reads it first. Writers of
-- schema 16 and earlier may still insert pending rows (or, schema 6 and earlier, unnumbered
-- stream rows) during a rolling deploy; lifecycle_outbox_adopt_legacy moves those into the log,
-- where the next tick numbers them like any other event. The sequencer functions are dropped:
-- only a consumer of this schema version can run here, and it does not number.
--
-- The xid timeline is load-bearing: ticks compare transaction IDs, which a physical replica, a
-- failover or pg_upgrade keeps but a logical dump and restore into another cluster does not.
-- The ticker refuses to tick when the last tick is ahead of the cluster's transaction IDs, and
-- says what to do (docs/operations.md, "Moving the database").

-- The events, written once by the writer hook in the delete transaction.
CREATE TABLE lifecycle_event_log (
    project_id        lifecycle_identifier      NOT NULL,
    task_id           lifecycle_task_id         NOT NULL,
    deleted_at        lifecycle_instant         NOT NULL,
    event_type        lifecycle_event_type      NOT NULL,
    archived          boolean                   NOT NULL,
    payload_version   lifecycle_payload_version NOT NULL,
    occurred_at       lifecycle_instant         NOT NULL,
    writer_process_id lifecycle_identifier      NOT NULL,
    prior_column      lifecycle_label,
    trace_context     lifecycle_trace_context,
    -- The writing transaction; a writer may not set it (it has no INSERT on this column).
    txid              xid8                      NOT NULL DEFAULT pg_catalog.pg_current_xact_id(),
    -- The identity, and the writer's ON CONFLICT arbiter. deleted_at before task_id: a
    -- project's inserts land at the end of its range instead of at random places in it.
    CONSTRAINT lifecycle_event_log_pkey PRIMARY KEY (project_id, deleted_at, task_id)
);

-- A tick's batch is a range of transaction IDs (plus the few that were open at the tick
-- before): the ticker counts it across projects, a reader takes its project's part of it.
CREATE INDEX lifecycle_event_log_batch ON lifecycle_event_log (txid, project_id);

ALTER TABLE lifecycle_event_log ENABLE ROW LEVEL SECURITY;
ALTER TABLE lifecycle_event_log FORCE ROW LEVEL SECURITY;
CREATE POLICY lifecycle_event_log_project_scope ON lifecycle_event_log
    USING (EXISTS (SELECT 1 FROM lifecycle_project_access a
                   WHERE a.role_name OPERATOR(pg_catalog.=) CURRENT_USER AND a.project_id OPERATOR(pg_catalog.=) '*')
           OR EXISTS (SELECT 1 FROM lifecycle_project_access a
                   WHERE a.role_name OPERATOR(pg_catalog.=) CURRENT_USER AND a.project_id OPERATOR(pg_catalog.=) lifecycle_event_log.project_id::text))
    WITH CHECK (EXISTS (SELECT 1 FROM lifecycle_project_access a
                   WHERE a.role_name OPERATOR(pg_catalog.=) CURRENT_USER AND a.project_id OPERATOR(pg_catalog.=) '*')
           OR EXISTS (SELECT 1 FROM lifecycle_project_access a
                   WHERE a.role_name OPERATOR(pg_catalog.=) CURRENT_USER AND a.project_id OPERATOR(pg_catalog.=) lifecycle_event_log.project_id::text));

-- The ticks: transaction snapshots, numbered 1, 2, 3, ... with no gap. Tick n's batch is what
-- its snapshot sees and tick n-1's did not. They hold no project data.
CREATE TABLE lifecycle_tick (
    tick_id   bigint      PRIMARY KEY CHECK (tick_id OPERATOR(pg_catalog.>) 0),
    snapshot  pg_snapshot NOT NULL,
    ticked_at timestamptz NOT NULL DEFAULT pg_catalog.clock_timestamp()
);

-- Each project's part of each tick's batch: how many events, and the sequence of the first.
CREATE TABLE lifecycle_tick_project (
    tick_id        bigint               NOT NULL,
    project_id     lifecycle_identifier NOT NULL,
    first_sequence bigint               NOT NULL CHECK (first_sequence OPERATOR(pg_catalog.>) 0),
    events         integer              NOT NULL CHECK (events OPERATOR(pg_catalog.>) 0),
    PRIMARY KEY (tick_id, project_id),
    -- A reader finds the tick that holds a sequence by this.
    CONSTRAINT lifecycle_tick_project_sequence UNIQUE (project_id, first_sequence)
);

ALTER TABLE lifecycle_tick_project ENABLE ROW LEVEL SECURITY;
ALTER TABLE lifecycle_tick_project FORCE ROW LEVEL SECURITY;
CREATE POLICY lifecycle_tick_project_project_scope ON lifecycle_tick_project
    USING (EXISTS (SELECT 1 FROM lifecycle_project_access a
                   WHERE a.role_name OPERATOR(pg_catalog.=) CURRENT_USER AND a.project_id OPERATOR(pg_catalog.=) '*')
           OR EXISTS (SELECT 1 FROM lifecycle_project_access a
                   WHERE a.role_name OPERATOR(pg_catalog.=) CURRENT_USER AND a.project_id OPERATOR(pg_catalog.=) lifecycle_tick_project.project_id::text));

-- A consumer that finds a hole in a stream (an event counted by its tick but no longer stored,
-- which only the owner can cause) records it and reconciles the project, for this reason.
ALTER DOMAIN lifecycle_reconcile_reason DROP CONSTRAINT lifecycle_reconcile_reason_check;
ALTER DOMAIN lifecycle_reconcile_reason ADD CONSTRAINT lifecycle_reconcile_reason_check
    CHECK (VALUE OPERATOR(pg_catalog.=) ANY (ARRAY['missing_cursor', 'cursor_ahead_of_head', 'cursor_below_pruned_floor', 'stream_hole']));

-- The log is numbered on from each project's head, and the reader reads the frozen stream up to
-- its last sequence before the log: a stream row numbered above its head (only a row numbered by
-- hand can be) would take the sequence of a log event and hide it. The head is raised to it.
-- (A project whose ID is not one gets no head: no consumer can serve it.)
INSERT INTO lifecycle_outbox_heads AS h (project_id, last_sequence, sequenced_at)
SELECT o.project_id, pg_catalog.max(o.sequence), pg_catalog.now()
FROM lifecycle_outbox o
WHERE o.sequence IS NOT NULL AND o.project_id OPERATOR(pg_catalog.~) '^[A-Za-z0-9][A-Za-z0-9._:-]*$'
  AND pg_catalog.octet_length(o.project_id) OPERATOR(pg_catalog.<=) 128
GROUP BY o.project_id
ON CONFLICT (project_id) DO UPDATE SET last_sequence = EXCLUDED.last_sequence, sequenced_at = EXCLUDED.sequenced_at
WHERE h.last_sequence OPERATOR(pg_catalog.<) EXCLUDED.last_sequence;

-- The rows writers of schema 6 and earlier left in the stream unnumbered are numbered there, as
-- the sequencer did (after the head, by occurred_at), while the log is still empty, so that the
-- stream stays below it. Those written before the stream's checks (schema 5) may hold what the
-- log's types refuse (deleted_at 'infinity', a malformed ID): moving one into the log would fail
-- lifecycle_outbox_adopt_legacy, and with it every tick's adoption of every older writer's rows.
-- Numbered here, the consumer parks such a row as undecodable, as before. The rows such writers
-- add from now on passed those checks, which are the log's types, and are adopted.
WITH legacy AS (
    SELECT o.ctid AS row_id, o.project_id,
           pg_catalog.row_number() OVER (PARTITION BY o.project_id ORDER BY o.occurred_at, o.deleted_at, o.task_id) AS rn
    FROM lifecycle_outbox o WHERE o.sequence IS NULL
), base AS (
    SELECT l.project_id, pg_catalog.count(*) AS n,
           GREATEST(coalesce((SELECT h.last_sequence FROM lifecycle_outbox_heads h WHERE h.project_id OPERATOR(pg_catalog.=) l.project_id), 0),
                    coalesce((SELECT pg_catalog.max(o.sequence) FROM lifecycle_outbox o WHERE o.project_id OPERATOR(pg_catalog.=) l.project_id), 0)) AS last
    FROM legacy l GROUP BY l.project_id
), numbered AS (
    UPDATE lifecycle_outbox o SET sequence = b.last OPERATOR(pg_catalog.+) l.rn
    FROM legacy l JOIN base b ON b.project_id OPERATOR(pg_catalog.=) l.project_id
    WHERE o.ctid OPERATOR(pg_catalog.=) l.row_id
    RETURNING o.project_id
)
INSERT INTO lifecycle_outbox_heads AS h (project_id, last_sequence, sequenced_at)
SELECT b.project_id, b.last OPERATOR(pg_catalog.+) b.n, pg_catalog.now()
FROM base b
WHERE b.project_id OPERATOR(pg_catalog.~) '^[A-Za-z0-9][A-Za-z0-9._:-]*$' AND pg_catalog.octet_length(b.project_id) OPERATOR(pg_catalog.<=) 128
ORDER BY b.project_id
ON CONFLICT (project_id) DO UPDATE SET last_sequence = EXCLUDED.last_sequence, sequenced_at = EXCLUDED.sequenced_at;

-- The first tick: the log is empty, so its batch is empty; it is the "tick before" of the next.
INSERT INTO lifecycle_tick (tick_id, snapshot) VALUES (1, pg_catalog.pg_current_snapshot());

-- lifecycle_outbox_tick takes a tick if any event committed since the last one, numbers its
-- batch per project from each project's head, and notifies p_channel (when not NULL) once per
-- project with new events, at commit. It returns the new tick's ID (NULL when there was
-- nothing new), how many projects and events it numbered, and whether rows of older writers
-- wait to be adopted (lifecycle_outbox_adopt_legacy), which the caller then adopts and ticks.
--
-- One ticker at a time: the SHARE ROW EXCLUSIVE lock on the tick table, which only the owner
-- can take, serialises them, so each tick's snapshot is taken after the previous tick
-- committed and the snapshots only grow. Readers take no lock that conflicts. Two tickers at
-- once are safe: the second waits (at most lock_timeout) and usually finds nothing new.
--
-- A tick commits durably whatever the session's synchronous_commit: a sequence a reader has
-- seen is never numbered again after a crash. Its commit record also flushes every earlier
-- commit, so no transaction it counted can be lost either, even one that committed
-- asynchronously.
CREATE FUNCTION lifecycle_outbox_tick(p_channel text)
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
    ), numbered AS (
        -- Heads rows locked in project order, as everyone else locks them.
        INSERT INTO lifecycle_outbox_heads AS h (project_id, last_sequence, sequenced_at)
        SELECT c.project_id, c.n, pg_catalog.now() FROM counted c ORDER BY c.project_id
        ON CONFLICT (project_id) DO UPDATE
        SET last_sequence = h.last_sequence OPERATOR(pg_catalog.+) EXCLUDED.last_sequence, sequenced_at = EXCLUDED.sequenced_at
        RETURNING h.project_id, h.last_sequence
    ), parts AS (
        INSERT INTO lifecycle_tick_project (tick_id, project_id, first_sequence, events)
        SELECT v_id, n.project_id, n.last_sequence OPERATOR(pg_catalog.-) c.n OPERATOR(pg_catalog.+) 1, c.n
        FROM numbered n JOIN counted c ON c.project_id OPERATOR(pg_catalog.=) n.project_id
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

-- lifecycle_outbox_adopt_legacy moves up to p_limit committed rows of older writers (pending
-- rows, and unnumbered stream rows of schema 6 and earlier) into the log, where the next tick
-- numbers them, and returns how many it moved. A row whose identity is already in the log is
-- the same event recorded twice and is dropped.
CREATE FUNCTION lifecycle_outbox_adopt_legacy(p_limit integer)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET lock_timeout = '1s'
AS $$
DECLARE
    v_pending bigint;
    v_stream  bigint;
BEGIN
    IF p_limit IS NULL OR p_limit OPERATOR(pg_catalog.<) 1 OR p_limit OPERATOR(pg_catalog.>) 100000 THEN
        RAISE EXCEPTION 'p_limit must be between 1 and 100000' USING ERRCODE = '22023';
    END IF;
    WITH moved AS (
        DELETE FROM lifecycle_outbox_pending p
        WHERE p.ctid OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT q.ctid FROM lifecycle_outbox_pending q LIMIT p_limit))
        RETURNING p.project_id, p.task_id, p.deleted_at, p.event_type, p.archived, p.payload_version, p.occurred_at,
                  p.writer_process_id, p.prior_column, p.trace_context
    ), adopted AS (
        INSERT INTO lifecycle_event_log (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at,
                                         writer_process_id, prior_column, trace_context)
        SELECT * FROM moved ON CONFLICT DO NOTHING RETURNING 1
    )
    SELECT pg_catalog.count(*) INTO v_pending FROM adopted;

    WITH moved AS (
        DELETE FROM lifecycle_outbox o
        WHERE o.ctid OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT q.ctid FROM lifecycle_outbox q WHERE q.sequence IS NULL LIMIT p_limit))
          AND o.sequence IS NULL
        RETURNING o.project_id, o.task_id, o.deleted_at, o.event_type, o.archived, o.payload_version, o.occurred_at,
                  o.writer_process_id, o.prior_column, o.trace_context
    ), adopted AS (
        INSERT INTO lifecycle_event_log (project_id, task_id, deleted_at, event_type, archived, payload_version, occurred_at,
                                         writer_process_id, prior_column, trace_context)
        SELECT * FROM moved ON CONFLICT DO NOTHING RETURNING 1
    )
    SELECT pg_catalog.count(*) INTO v_stream FROM adopted;
    RETURN v_pending OPERATOR(pg_catalog.+) v_stream;
END;
$$;

-- lifecycle_outbox_read returns up to p_limit events of p_project numbered after p_after, in
-- order, with their sequences: first from the frozen stream, then tick by tick from the log.
-- It runs as the caller, so row-level security shows it only the projects granted to it.
--
-- p_key_* is the key (txid, deleted_at, task_id) of the event at p_after, when the caller has
-- it (it is the last column of every row returned): the read then continues after that key
-- inside the tick that holds it, by the index, however large the tick. Without it, a read that
-- starts inside a tick numbers that tick's part from its start and skips what is at or below
-- p_after: once, after a restart, bounded by the tick's size.
CREATE FUNCTION lifecycle_outbox_read(p_project text, p_after bigint, p_limit integer,
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
        v_after := v_after OPERATOR(pg_catalog.+) v_got;
        -- A part that returned fewer rows than it counted lost some: stop here, so the caller
        -- sees the hole (the next sequence it reads is not the one after its last).
        EXIT WHEN v_left OPERATOR(pg_catalog.>) 0
                  AND v_after OPERATOR(pg_catalog.<) (v_part.first_sequence OPERATOR(pg_catalog.+) v_part.events OPERATOR(pg_catalog.-) 1);
    END LOOP;
END;
$$;

-- Functions run with the module's schema pinned first after pg_catalog, as the others do.
DO $$
DECLARE
    r record;
    v_schema constant text := pg_catalog.current_schema();
BEGIN
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_tick(text) SET search_path = pg_catalog, %I, pg_temp', v_schema);
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_adopt_legacy(integer) SET search_path = pg_catalog, %I, pg_temp', v_schema);
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_read(text, bigint, integer, xid8, timestamptz, text) '
                              'SET search_path = pg_catalog, %I, pg_temp', v_schema);
    REVOKE EXECUTE ON FUNCTION lifecycle_outbox_tick(text) FROM PUBLIC;
    REVOKE EXECUTE ON FUNCTION lifecycle_outbox_adopt_legacy(integer) FROM PUBLIC;
    REVOKE EXECUTE ON FUNCTION lifecycle_outbox_read(text, bigint, integer, xid8, timestamptz, text) FROM PUBLIC;

    -- Writers (INSERT on the pending table) insert into the log and read what their repeat
    -- reads; no role but the owner sets txid, updates or deletes.
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role_name
        FROM pg_catalog.pg_attribute t, pg_catalog.aclexplode(t.attacl) a
        WHERE t.attrelid OPERATOR(pg_catalog.=) 'lifecycle_outbox_pending'::regclass AND t.attname OPERATOR(pg_catalog.=) 'task_id'
          AND a.privilege_type OPERATOR(pg_catalog.=) 'INSERT' AND a.grantee OPERATOR(pg_catalog.<>) 0
    LOOP
        EXECUTE pg_catalog.format('GRANT INSERT (project_id, task_id, deleted_at, event_type, archived, payload_version, '
            'occurred_at, writer_process_id, prior_column, trace_context), '
            'SELECT (project_id, task_id, deleted_at, writer_process_id, occurred_at) ON lifecycle_event_log TO %s', r.role_name);
    END LOOP;

    -- Readers of the stream read the log and the ticks, and may call the reader.
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role_name
        FROM pg_catalog.pg_class c, pg_catalog.aclexplode(c.relacl) a
        WHERE c.oid OPERATOR(pg_catalog.=) 'lifecycle_outbox'::regclass AND a.grantee OPERATOR(pg_catalog.<>) 0
          AND a.grantee OPERATOR(pg_catalog.<>) c.relowner AND a.privilege_type OPERATOR(pg_catalog.=) 'SELECT'
    LOOP
        EXECUTE pg_catalog.format('GRANT SELECT ON lifecycle_event_log, lifecycle_tick, lifecycle_tick_project TO %s', r.role_name);
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION lifecycle_outbox_read(text, bigint, integer, xid8, timestamptz, text) TO %s', r.role_name);
    END LOOP;

    -- Consumers (who could run the sequencer) tick and adopt instead, and number nothing themselves.
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role_name
        FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
        WHERE p.oid OPERATOR(pg_catalog.=) 'lifecycle_outbox_sequence(text[], integer, text, interval, text, interval)'::regprocedure
          AND a.grantee OPERATOR(pg_catalog.<>) 0 AND a.grantee OPERATOR(pg_catalog.<>) p.proowner
          AND a.privilege_type OPERATOR(pg_catalog.=) 'EXECUTE'
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION lifecycle_outbox_tick(text), lifecycle_outbox_adopt_legacy(integer) TO %s', r.role_name);
        EXECUTE pg_catalog.format('REVOKE UPDATE (sequence) ON lifecycle_outbox FROM %s', r.role_name);
        EXECUTE pg_catalog.format('REVOKE INSERT (project_id), UPDATE (last_sequence, sequenced_at) ON lifecycle_outbox_heads FROM %s', r.role_name);
    END LOOP;
END;
$$;

DROP FUNCTION lifecycle_outbox_sequence(text[], integer, text, interval, text, interval);
DROP FUNCTION lifecycle_outbox_sequence(text[], integer);
DROP FUNCTION lifecycle_outbox_release_sequencer(text);

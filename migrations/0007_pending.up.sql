-- A narrow pending table on the writer's path; the sequencer moves rows into the stream.
--
-- Until now a writer inserted an unnumbered row into lifecycle_outbox: a heap tuple, the primary
-- key and the unsequenced index, and eight table checks, each of which PostgreSQL rebuilds
-- from its stored expression for every single-row insert. Sequencing then updated the row (a
-- second heap tuple and new index entries) and pruning deleted both. Now the delete
-- transaction inserts into lifecycle_outbox_pending: one heap tuple, one index, and checks on
-- the column types (domains), which the server keeps compiled. The sequencer deletes a batch of
-- committed pending rows and inserts them, numbered, into lifecycle_outbox in one statement, so
-- the stream only ever holds numbered rows and the insert's checks are paid once per batch.
--
-- Rows written into lifecycle_outbox with no sequence (by writers of schema 6, during a rolling
-- deploy) are still numbered, first, so nothing written either way is skipped.

-- The checks of 0005, as types. A domain's check is kept compiled with the type, so a column of
-- one costs a value test per row and no per-statement set-up.
CREATE DOMAIN lifecycle_identifier AS text
    CHECK (VALUE OPERATOR(pg_catalog.~) '^[A-Za-z0-9][A-Za-z0-9._:-]*$' AND pg_catalog.octet_length(VALUE) OPERATOR(pg_catalog.<=) 128);
CREATE DOMAIN lifecycle_task_id AS text
    CHECK (pg_catalog.octet_length(VALUE) BETWEEN 1 AND 256
           AND VALUE OPERATOR(pg_catalog.!~) '[\x01-\x20\x7f-\xa0\u1680\u2000-\u200f\u2028-\u202f\u205f-\u206f\u3000\ufeff]');
CREATE DOMAIN lifecycle_label AS text
    CHECK (pg_catalog.octet_length(VALUE) BETWEEN 1 AND 128 AND VALUE OPERATOR(pg_catalog.!~) '[\x01-\x1f\x7f-\x9f]');
CREATE DOMAIN lifecycle_instant AS timestamptz
    CHECK (VALUE BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00');
CREATE DOMAIN lifecycle_payload_version AS smallint CHECK (VALUE OPERATOR(pg_catalog.>) 0);
CREATE DOMAIN lifecycle_trace_context AS text
    CHECK (pg_catalog.length(VALUE) OPERATOR(pg_catalog.<=) 600
           AND VALUE OPERATOR(pg_catalog.~) '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}( |$)');

-- What the writer hook inserts: the event's columns, its identity as the one index.
CREATE TABLE lifecycle_outbox_pending (
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
    PRIMARY KEY (project_id, task_id, deleted_at)
) WITH (
    -- A queue: rows live for milliseconds while consumers run. Vacuum it by dead rows, not by
    -- a fraction of a size that swings from nothing to a backlog.
    autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 10000,
    autovacuum_vacuum_insert_scale_factor = 0, autovacuum_vacuum_insert_threshold = 100000
);

ALTER TABLE lifecycle_outbox_pending ENABLE ROW LEVEL SECURITY;
ALTER TABLE lifecycle_outbox_pending FORCE ROW LEVEL SECURITY;
CREATE POLICY lifecycle_outbox_pending_project_scope ON lifecycle_outbox_pending
    USING (project_id OPERATOR(pg_catalog.=) ANY (SELECT a.project_id FROM lifecycle_project_access a WHERE a.role_name OPERATOR(pg_catalog.=) CURRENT_USER)
           OR EXISTS (SELECT 1 FROM lifecycle_project_access a WHERE a.role_name OPERATOR(pg_catalog.=) CURRENT_USER AND a.project_id OPERATOR(pg_catalog.=) '*'))
    WITH CHECK (project_id OPERATOR(pg_catalog.=) ANY (SELECT a.project_id FROM lifecycle_project_access a WHERE a.role_name OPERATOR(pg_catalog.=) CURRENT_USER)
           OR EXISTS (SELECT 1 FROM lifecycle_project_access a WHERE a.role_name OPERATOR(pg_catalog.=) CURRENT_USER AND a.project_id OPERATOR(pg_catalog.=) '*'));

-- Roles that could write events keep doing so, now into the pending table; every role that
-- could read the outbox may read what is pending (status, reconciliation, the writer's repeat).
DO $$
DECLARE
    r record;
BEGIN
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role_name, a.privilege_type
        FROM pg_catalog.pg_class c, pg_catalog.aclexplode(c.relacl) a
        WHERE c.oid = 'lifecycle_outbox'::regclass AND a.grantee <> 0 AND a.grantee <> c.relowner
          AND a.privilege_type IN ('SELECT', 'INSERT')
        UNION
        SELECT DISTINCT a.grantee::regrole::text, 'INSERT'
        FROM pg_catalog.pg_attribute t, pg_catalog.aclexplode(t.attacl) a
        WHERE t.attrelid = 'lifecycle_outbox'::regclass AND t.attname = 'task_id' AND a.privilege_type = 'INSERT'
          AND a.grantee <> 0
    LOOP
        IF r.privilege_type = 'SELECT' THEN
            EXECUTE pg_catalog.format('GRANT SELECT ON lifecycle_outbox_pending TO %s', r.role_name);
        ELSE
            EXECUTE pg_catalog.format('GRANT INSERT (project_id, task_id, deleted_at, event_type, archived, payload_version, '
                'occurred_at, writer_process_id, prior_column, trace_context) ON lifecycle_outbox_pending TO %s', r.role_name);
        END IF;
    END LOOP;
END;
$$;

-- The sequencer, now a mover. It runs as the owner (SECURITY DEFINER), because moving a row
-- deletes it from the pending table, and a role holding DELETE there could LOCK that table and
-- stop every writer of every project. What the caller may sequence is decided here instead: the
-- projects granted in lifecycle_project_access to the session's login role or a role it is a
-- member of. The caller still needs EXECUTE (consumer roles only).
--
-- Each project in sorted order: take its heads row lock, which serialises the sequencers of the
-- project and which writers never take (or skip the project while another holds it); number its legacy
-- unnumbered rows in the stream; then move up to the rest of p_limit pending rows. READ
-- COMMITTED gives every statement a fresh snapshot, so a move sees every row and every earlier
-- move that committed before the lock was granted; a row that commits later is moved later.
-- A positive p_limit waits for a project's heads row lock (at most lock_timeout); a negative one
-- numbers at most -p_limit rows per project and skips a project whose lock another sequencer
-- holds, returning it with assigned -1 (the consumer's scan, which calls again soon).
-- A batch is taken in key order (a task's deletions in their order) and numbered by
-- occurred_at within the batch. A pending row whose identity the stream already holds is
-- dropped, so an identity is delivered once however often it was written.
CREATE OR REPLACE FUNCTION lifecycle_outbox_sequence(p_projects text[], p_limit integer)
RETURNS TABLE (project_id text, last_sequence bigint, pruned_through bigint, assigned integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET enable_hashjoin = off
SET enable_mergejoin = off
SET lock_timeout = '1s'
-- Every statement reaches rows by index. A plan chosen while a table was small (a seq scan and
-- sort of the pending table for each batch, say) could otherwise be kept by the plan cache as
-- the table grows, and turn the move of a backlog quadratic.
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    v_every    boolean;
    v_allowed  text[];
    v_projects text[];
    v_project  text;
    v_last     bigint;
    v_count    integer;
    v_max      bigint;
    v_assigned jsonb := '{}';
    v_skip     boolean;
    v_locked   text[];
    v_base     bigint[];
    v_room     integer[];
    v_legacy   jsonb := '{}';
    v_i        integer;
    v_moved_projects text[];
    v_moved_counts   integer[];
    v_moved_max      bigint[];
BEGIN
    IF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed' THEN
        RAISE EXCEPTION 'lifecycle_outbox_sequence must run at READ COMMITTED, not %',
            pg_catalog.current_setting('transaction_isolation') USING ERRCODE = '25000';
    END IF;
    IF p_limit IS NULL OR p_limit OPERATOR(pg_catalog.=) 0 THEN
        RAISE EXCEPTION 'p_limit must not be 0' USING ERRCODE = '22023';
    END IF;
    v_skip := p_limit OPERATOR(pg_catalog.<) 0;
    p_limit := pg_catalog.abs(p_limit);

    SELECT coalesce(pg_catalog.bool_or(a.project_id OPERATOR(pg_catalog.=) '*'), false), pg_catalog.array_agg(a.project_id)
    INTO v_every, v_allowed
    FROM lifecycle_project_access a
    JOIN pg_catalog.pg_roles r ON r.rolname OPERATOR(pg_catalog.=) a.role_name -- a dropped role's rows grant nothing
    WHERE pg_catalog.pg_has_role(SESSION_USER, r.oid, 'MEMBER');

    IF p_projects IS NULL THEN
        -- Every project with something to number: a loose scan of the pending key, one probe
        -- per project, and the legacy index.
        WITH RECURSIVE loose(p) AS (
            SELECT pg_catalog.min(q.project_id::text) FROM lifecycle_outbox_pending q
            UNION ALL
            SELECT (SELECT pg_catalog.min(q.project_id::text) FROM lifecycle_outbox_pending q
                    WHERE q.project_id::text OPERATOR(pg_catalog.>) loose.p)
            FROM loose WHERE loose.p IS NOT NULL
        )
        SELECT pg_catalog.array_agg(DISTINCT x.p ORDER BY x.p) INTO v_projects
        FROM (SELECT loose.p FROM loose WHERE loose.p IS NOT NULL
              UNION
              SELECT o.project_id FROM lifecycle_outbox o WHERE o.sequence IS NULL) x
        WHERE v_every OR x.p OPERATOR(pg_catalog.=) ANY (v_allowed);
    ELSE
        SELECT pg_catalog.array_agg(DISTINCT x.p ORDER BY x.p) INTO v_projects
        FROM pg_catalog.unnest(p_projects) AS x(p)
        WHERE (v_every OR x.p OPERATOR(pg_catalog.=) ANY (v_allowed))
          AND (EXISTS (SELECT 1 FROM lifecycle_outbox_pending q WHERE q.project_id::text OPERATOR(pg_catalog.=) x.p)
               OR EXISTS (SELECT 1 FROM lifecycle_outbox o WHERE o.project_id OPERATOR(pg_catalog.=) x.p AND o.sequence IS NULL));
    END IF;

    -- The heads rows of projects numbered for the first time. Only those: an insert that
    -- meets an existing row another sequencer is updating would wait for it.
    INSERT INTO lifecycle_outbox_heads AS h (project_id)
    SELECT x.p FROM pg_catalog.unnest(v_projects) AS x(p)
    WHERE NOT EXISTS (SELECT 1 FROM lifecycle_outbox_heads h WHERE h.project_id OPERATOR(pg_catalog.=) x.p)
    ON CONFLICT (project_id) DO NOTHING;

    -- Lock the heads rows in project order, so that two sequencers cannot deadlock; with v_skip
    -- the rows another sequencer holds are left out and those projects reported busy.
    IF v_skip THEN
        SELECT pg_catalog.array_agg(l.project_id ORDER BY l.project_id), pg_catalog.array_agg(l.last_sequence ORDER BY l.project_id)
        INTO v_locked, v_base
        FROM (SELECT h.project_id, h.last_sequence FROM lifecycle_outbox_heads h
              WHERE h.project_id OPERATOR(pg_catalog.=) ANY (v_projects)
              ORDER BY h.project_id FOR UPDATE SKIP LOCKED) AS l;
    ELSE
        SELECT pg_catalog.array_agg(l.project_id ORDER BY l.project_id), pg_catalog.array_agg(l.last_sequence ORDER BY l.project_id)
        INTO v_locked, v_base
        FROM (SELECT h.project_id, h.last_sequence FROM lifecycle_outbox_heads h
              WHERE h.project_id OPERATOR(pg_catalog.=) ANY (v_projects)
              ORDER BY h.project_id FOR UPDATE) AS l;
    END IF;
    v_locked := coalesce(v_locked, '{}');
    v_base := coalesce(v_base, '{}');
    SELECT coalesce(pg_catalog.jsonb_object_agg(x.p, -1), '{}') INTO v_assigned
    FROM pg_catalog.unnest(v_projects) AS x(p) WHERE x.p OPERATOR(pg_catalog.<>) ALL (v_locked);
    v_room := pg_catalog.array_fill(p_limit, ARRAY[pg_catalog.cardinality(v_locked)]);

    -- Legacy rows first (rare: a writer of schema 6 during a rolling deploy), one project at a
    -- time, moving that project's base and room.
    FOR v_i IN 1 .. pg_catalog.cardinality(v_locked) LOOP
        CONTINUE WHEN NOT EXISTS (SELECT 1 FROM lifecycle_outbox o WHERE o.project_id OPERATOR(pg_catalog.=) v_locked[v_i] AND o.sequence IS NULL);
        v_last := v_base[v_i];
        WITH legacy AS (
            SELECT o.ctid AS row_id, pg_catalog.row_number() OVER (ORDER BY o.occurred_at) AS rn
            FROM lifecycle_outbox o
            WHERE o.project_id OPERATOR(pg_catalog.=) v_locked[v_i] AND o.sequence IS NULL
            ORDER BY o.occurred_at
            LIMIT p_limit
        ), numbered AS (
            UPDATE lifecycle_outbox o
            SET sequence = v_last OPERATOR(pg_catalog.+) legacy.rn
            FROM legacy
            WHERE o.ctid OPERATOR(pg_catalog.=) legacy.row_id AND o.sequence IS NULL
            RETURNING o.sequence
        )
        SELECT pg_catalog.count(*), coalesce(pg_catalog.max(numbered.sequence), v_last) INTO v_count, v_max FROM numbered;
        IF v_max OPERATOR(pg_catalog.-) v_last OPERATOR(pg_catalog.<>) v_count THEN
            RAISE EXCEPTION 'sequencer for project % would leave a gap (last %, max %, count %)',
                v_locked[v_i], v_last, v_max, v_count USING ERRCODE = 'XX000';
        END IF;
        v_base[v_i] := v_max;
        v_room[v_i] := p_limit OPERATOR(pg_catalog.-) v_count;
        v_legacy := v_legacy OPERATOR(pg_catalog.||) pg_catalog.jsonb_build_object(v_locked[v_i], v_count);
    END LOOP;

    -- Every locked project's pending batch in one statement: taken in key order (a task's
    -- deletions in their order), numbered from the project's base by occurred_at within the
    -- batch, moved into the stream. A pending row whose identity the stream holds is dropped.
    WITH locked AS (
        SELECT l.project_id, l.base, l.room
        FROM ROWS FROM (pg_catalog.unnest(v_locked), pg_catalog.unnest(v_base), pg_catalog.unnest(v_room)) AS l(project_id, base, room)
        WHERE l.room OPERATOR(pg_catalog.>) 0
    ), batch AS (
        SELECT b.row_id
        FROM locked l
        CROSS JOIN LATERAL (
            SELECT q.ctid AS row_id
            FROM lifecycle_outbox_pending q
            WHERE q.project_id::text OPERATOR(pg_catalog.=) l.project_id
            ORDER BY q.project_id, q.task_id, q.deleted_at
            LIMIT l.room) AS b
    ), moved AS (
        DELETE FROM lifecycle_outbox_pending q
        USING batch
        WHERE q.ctid OPERATOR(pg_catalog.=) batch.row_id
        RETURNING q.*
    ), fresh AS (
        SELECT m.*, pg_catalog.row_number() OVER (PARTITION BY m.project_id ORDER BY m.occurred_at, m.task_id, m.deleted_at) AS rn
        FROM moved m
        WHERE NOT EXISTS (
            SELECT 1 FROM lifecycle_outbox o
            WHERE o.project_id OPERATOR(pg_catalog.=) m.project_id::text AND o.task_id OPERATOR(pg_catalog.=) m.task_id::text
              AND o.deleted_at OPERATOR(pg_catalog.=) m.deleted_at::timestamptz)
    ), numbered AS (
        INSERT INTO lifecycle_outbox
            (project_id, task_id, deleted_at, sequence, event_type, archived, payload_version, occurred_at,
             writer_process_id, prior_column, trace_context)
        SELECT f.project_id, f.task_id, f.deleted_at, l.base OPERATOR(pg_catalog.+) f.rn, f.event_type, f.archived,
               f.payload_version, f.occurred_at, f.writer_process_id, f.prior_column, f.trace_context
        FROM fresh f JOIN locked l ON l.project_id OPERATOR(pg_catalog.=) f.project_id::text
        RETURNING lifecycle_outbox.project_id, lifecycle_outbox.sequence
    )
    SELECT pg_catalog.array_agg(r.project_id), pg_catalog.array_agg(r.n), pg_catalog.array_agg(r.top)
    INTO v_moved_projects, v_moved_counts, v_moved_max
    FROM (SELECT numbered.project_id, pg_catalog.count(*)::integer AS n, pg_catalog.max(numbered.sequence) AS top
          FROM numbered GROUP BY numbered.project_id) AS r;

    -- Only a sequencer holding the heads lock numbers rows, so nothing can be skipped here;
    -- if it ever were, a gap would follow, and a gap must never commit.
    FOR v_i IN 1 .. coalesce(pg_catalog.cardinality(v_moved_projects), 0) LOOP
        v_project := v_moved_projects[v_i];
        v_last := v_base[pg_catalog.array_position(v_locked, v_project)];
        IF v_moved_max[v_i] OPERATOR(pg_catalog.-) v_last OPERATOR(pg_catalog.<>) v_moved_counts[v_i] THEN
            RAISE EXCEPTION 'sequencer for project % would leave a gap (last %, max %, count %)',
                v_project, v_last, v_moved_max[v_i], v_moved_counts[v_i] USING ERRCODE = 'XX000';
        END IF;
        v_base[pg_catalog.array_position(v_locked, v_project)] := v_moved_max[v_i];
    END LOOP;

    -- Move the heads of the projects that got numbers, and report what each was assigned.
    UPDATE lifecycle_outbox_heads h
    SET last_sequence = l.base, sequenced_at = pg_catalog.now()
    FROM ROWS FROM (pg_catalog.unnest(v_locked), pg_catalog.unnest(v_base)) AS l(project_id, base)
    WHERE h.project_id OPERATOR(pg_catalog.=) l.project_id AND h.last_sequence OPERATOR(pg_catalog.<>) l.base;
    SELECT v_assigned OPERATOR(pg_catalog.||) coalesce(pg_catalog.jsonb_object_agg(l.p,
               coalesce((v_legacy OPERATOR(pg_catalog.->>) l.p)::integer, 0)
               OPERATOR(pg_catalog.+) coalesce(m.n, 0)), '{}')
    INTO v_assigned
    FROM pg_catalog.unnest(v_locked) AS l(p)
    LEFT JOIN ROWS FROM (pg_catalog.unnest(v_moved_projects), pg_catalog.unnest(v_moved_counts)) AS m(p, n) ON m.p OPERATOR(pg_catalog.=) l.p;

    RETURN QUERY
        SELECT h.project_id, h.last_sequence, h.pruned_through,
               coalesce((v_assigned OPERATOR(pg_catalog.->>) h.project_id)::integer, 0)
        FROM lifecycle_outbox_heads h
        WHERE (p_projects IS NULL OR h.project_id OPERATOR(pg_catalog.=) ANY (p_projects))
          AND (v_every OR h.project_id OPERATOR(pg_catalog.=) ANY (v_allowed));
END;
$$;

DO $$
BEGIN
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_sequence(text[], integer) SET search_path = pg_catalog, %I, pg_temp',
                              pg_catalog.current_schema());
END;
$$;

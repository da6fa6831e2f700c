-- The transactional outbox and its per-project sequencer.
--
-- Writers insert rows with a NULL sequence inside the host's delete transaction: one plain insert,
-- no lock that another delete waits on. The sequencer (lifecycle_outbox_sequence, run by
-- consumers) later assigns contiguous per-project sequences to the committed rows it can see,
-- serialised per project by a row lock on lifecycle_outbox_heads that writers never take. A row
-- that commits later is sequenced later, so a reader of "sequence > cursor" never skips one.

-- The allowed event types. An enum makes the database itself refuse any other value; adding a
-- lifecycle event is a deliberate migration (ALTER TYPE ... ADD VALUE).
CREATE TYPE lifecycle_event_type AS ENUM ('task:deleted');

-- The row is kept small on purpose: it is written inside every delete transaction, so each byte,
-- index entry and check costs every delete. The event identity is (project, task, deletedAt):
-- the event ID "task-deleted:<taskId>:<deletedAt>" is formatted from it when read, not stored.
-- Identifiers are validated by the writer before it inserts.
CREATE TABLE lifecycle_outbox (
    project_id        text                 NOT NULL,
    task_id           text                 NOT NULL,
    -- The stored deleted_at of the first transition: the deletion's identity.
    deleted_at        timestamptz          NOT NULL,
    -- NULL until the sequencer assigns it; then 1, 2, 3, ... per project with no gap.
    sequence          bigint               CHECK (sequence > 0),
    event_type        lifecycle_event_type NOT NULL,
    archived          boolean              NOT NULL,
    payload_version   smallint             NOT NULL CHECK (payload_version > 0),
    occurred_at       timestamptz          NOT NULL,
    writer_process_id text                 NOT NULL,
    prior_column      text,
    PRIMARY KEY (project_id, task_id, deleted_at)
);

-- Readers walk a project's stream by sequence. Partial, so a writer's insert does not touch it.
CREATE UNIQUE INDEX lifecycle_outbox_project_sequence
    ON lifecycle_outbox (project_id, sequence) WHERE sequence IS NOT NULL;

-- The sequencer's work list, in the order it numbers them. It only holds rows not sequenced
-- yet, so it stays small.
CREATE INDEX lifecycle_outbox_unsequenced
    ON lifecycle_outbox (project_id, occurred_at) WHERE sequence IS NULL;

-- The event ID of a task:deleted event, for queries and operators: the outbox stores its parts.
CREATE FUNCTION lifecycle_event_id(p_task_id text, p_deleted_at timestamptz) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
RETURN 'task-deleted:' || p_task_id || ':'
       || to_char(p_deleted_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"');

CREATE TABLE lifecycle_outbox_heads (
    project_id     text        PRIMARY KEY CHECK (project_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$'),
    -- The last sequence assigned in this project.
    last_sequence  bigint      NOT NULL DEFAULT 0 CHECK (last_sequence >= 0),
    -- Every row at or below this sequence may have been pruned; a cursor below it must reconcile.
    pruned_through bigint      NOT NULL DEFAULT 0 CHECK (pruned_through >= 0 AND pruned_through <= last_sequence),
    sequenced_at   timestamptz,
    pruned_at      timestamptz
);

-- lifecycle_outbox_sequence assigns sequences to committed, unsequenced rows of the given
-- projects (all projects when p_projects is NULL), at most p_limit rows per project per call,
-- and returns the head of every requested project that has one.
--
-- Correctness rests on READ COMMITTED: each statement below takes a fresh snapshot, so the
-- UPDATE that assigns sequences sees every row and every earlier sequencing that committed
-- before this call took the heads row lock.
--
-- The UPDATE joins its batch back to the table by ctid; a nested loop of TID lookups is right at
-- any batch size, while a hash join would read every unsequenced row of the table per call.
CREATE FUNCTION lifecycle_outbox_sequence(p_projects text[], p_limit integer)
RETURNS TABLE (project_id text, last_sequence bigint, pruned_through bigint, assigned integer)
LANGUAGE plpgsql VOLATILE
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
#variable_conflict use_column
DECLARE
    v_project  text;
    v_last     bigint;
    v_count    integer;
    v_max      bigint;
    v_assigned jsonb := '{}';
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'lifecycle_outbox_sequence must run at READ COMMITTED, not %',
            current_setting('transaction_isolation') USING ERRCODE = '25000';
    END IF;
    IF p_limit IS NULL OR p_limit < 1 THEN
        RAISE EXCEPTION 'p_limit must be at least 1' USING ERRCODE = '22023';
    END IF;

    -- Projects in sorted order, so two sequencers covering several projects cannot deadlock.
    FOR v_project IN
        SELECT DISTINCT o.project_id
        FROM lifecycle_outbox o
        WHERE o.sequence IS NULL
          AND (p_projects IS NULL OR o.project_id = ANY (p_projects))
        ORDER BY o.project_id
    LOOP
        INSERT INTO lifecycle_outbox_heads AS h (project_id) VALUES (v_project)
        ON CONFLICT (project_id) DO NOTHING;

        -- Serialises sequencers of this project; writers never lock this row.
        SELECT h.last_sequence INTO v_last
        FROM lifecycle_outbox_heads h
        WHERE h.project_id = v_project
        FOR UPDATE;

        WITH pending AS (
            SELECT o.ctid AS row_id, row_number() OVER (ORDER BY o.occurred_at) AS rn
            FROM lifecycle_outbox o
            WHERE o.project_id = v_project AND o.sequence IS NULL
            ORDER BY o.occurred_at
            LIMIT p_limit
        ), numbered AS (
            UPDATE lifecycle_outbox o
            SET sequence = v_last + pending.rn
            FROM pending
            WHERE o.ctid = pending.row_id AND o.sequence IS NULL
            RETURNING o.sequence
        )
        SELECT count(*), coalesce(max(numbered.sequence), v_last) INTO v_count, v_max FROM numbered;

        -- Only a sequencer holding the heads lock numbers rows, so nothing can be skipped here;
        -- if it ever were, a gap would follow, and a gap must never commit.
        IF v_max - v_last <> v_count THEN
            RAISE EXCEPTION 'sequencer for project % would leave a gap (last %, max %, count %)',
                v_project, v_last, v_max, v_count USING ERRCODE = 'XX000';
        END IF;

        IF v_count > 0 THEN
            UPDATE lifecycle_outbox_heads h
            SET last_sequence = v_max, sequenced_at = now()
            WHERE h.project_id = v_project;
        END IF;
        v_assigned := v_assigned || jsonb_build_object(v_project, v_count);
    END LOOP;

    RETURN QUERY
        SELECT h.project_id, h.last_sequence, h.pruned_through,
               coalesce((v_assigned ->> h.project_id)::integer, 0)
        FROM lifecycle_outbox_heads h
        WHERE p_projects IS NULL OR h.project_id = ANY (p_projects);
END;
$$;

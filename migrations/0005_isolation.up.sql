-- Isolation: no role, row or project can hurt another.
--
-- Every role, row and client is treated as possibly hostile or broken, so the database itself
-- refuses what must never happen: functions pin their search_path and qualify the built-ins they
-- call; a consumer role moves only the cursors and deliveries of the consumer identities granted
-- to it in lifecycle_consumer_access; only a role that may write who asked for a replay may ask
-- for one; a sequence, once assigned, is fixed for every role but the owner; and every identifier
-- and timestamp the module writes is checked.
--
-- The checks are added NOT VALID: that needs only a brief lock and no scan, so deletes do not
-- wait for this migration to read the tables. Every new or updated row is checked at once;
-- migration 0005 then validates the existing rows without blocking writers.

-- lifecycle_event_id is recreated so that its body binds to pg_catalog, and pinned below.
CREATE OR REPLACE FUNCTION lifecycle_event_id(p_task_id text, p_deleted_at timestamptz) RETURNS text
LANGUAGE sql STABLE PARALLEL SAFE
RETURN 'task-deleted:' OPERATOR(pg_catalog.||) p_task_id OPERATOR(pg_catalog.||) ':'
       OPERATOR(pg_catalog.||) pg_catalog.to_char(p_deleted_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"');

-- The sequencer of 0001, with every built-in qualified: a plpgsql body is resolved when it runs,
-- and an overload such as public.jsonb_build_object(text, integer), created by any role that can
-- CREATE in a schema on the path, would be a closer match than the built-in and run as the
-- caller. The heads-row lock waits at most lock_timeout: a sequencer of another project in the
-- same call, or the next call, is not held up longer than that by a stuck holder.
CREATE OR REPLACE FUNCTION lifecycle_outbox_sequence(p_projects text[], p_limit integer)
RETURNS TABLE (project_id text, last_sequence bigint, pruned_through bigint, assigned integer)
LANGUAGE plpgsql VOLATILE
SET enable_hashjoin = off
SET enable_mergejoin = off
SET lock_timeout = '1s'
AS $$
#variable_conflict use_column
DECLARE
    v_project  text;
    v_last     bigint;
    v_count    integer;
    v_max      bigint;
    v_assigned jsonb := '{}';
BEGIN
    IF pg_catalog.current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'lifecycle_outbox_sequence must run at READ COMMITTED, not %',
            pg_catalog.current_setting('transaction_isolation') USING ERRCODE = '25000';
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
            SELECT o.ctid AS row_id, pg_catalog.row_number() OVER (ORDER BY o.occurred_at) AS rn
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
        SELECT pg_catalog.count(*), coalesce(pg_catalog.max(numbered.sequence), v_last) INTO v_count, v_max FROM numbered;

        -- Only a sequencer holding the heads lock numbers rows, so nothing can be skipped here;
        -- if it ever were, a gap would follow, and a gap must never commit.
        IF v_max - v_last <> v_count THEN
            RAISE EXCEPTION 'sequencer for project % would leave a gap (last %, max %, count %)',
                v_project, v_last, v_max, v_count USING ERRCODE = 'XX000';
        END IF;

        IF v_count > 0 THEN
            UPDATE lifecycle_outbox_heads h
            SET last_sequence = v_max, sequenced_at = pg_catalog.now()
            WHERE h.project_id = v_project;
        END IF;
        v_assigned := v_assigned || pg_catalog.jsonb_build_object(v_project, v_count);
    END LOOP;

    RETURN QUERY
        SELECT h.project_id, h.last_sequence, h.pruned_through,
               coalesce((v_assigned ->> h.project_id)::integer, 0)
        FROM lifecycle_outbox_heads h
        WHERE p_projects IS NULL OR h.project_id = ANY (p_projects);
END;
$$;

-- Pin the search path of both functions: pg_catalog first, then the schema the module was
-- installed in (public or a dedicated one), and pg_temp last so that a temporary table cannot
-- stand in for one of the module's tables.
DO $$
BEGIN
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_event_id(text, timestamptz) SET search_path = pg_catalog, %I, pg_temp',
                              pg_catalog.current_schema());
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_sequence(text[], integer) SET search_path = pg_catalog, %I, pg_temp',
                              pg_catalog.current_schema());
END;
$$;

-- Only consumer roles (GrantConsumerRole) run the sequencer.
REVOKE EXECUTE ON FUNCTION lifecycle_outbox_sequence(text[], integer) FROM PUBLIC;

-- The consumer identities a role may act as ('*': every one), like lifecycle_project_access for
-- projects. A role reads only its own rows; only the owner writes them. Every role may read the
-- table, since the policies below consult it as the role that runs the statement.
CREATE TABLE lifecycle_consumer_access (
    role_name   name NOT NULL,
    consumer_id text NOT NULL CHECK (consumer_id = '*' OR (consumer_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$' AND pg_catalog.octet_length(consumer_id) <= 128)),
    PRIMARY KEY (role_name, consumer_id)
);

ALTER TABLE lifecycle_consumer_access ENABLE ROW LEVEL SECURITY;
CREATE POLICY lifecycle_consumer_access_own ON lifecycle_consumer_access
    FOR SELECT USING (role_name = current_user);
GRANT SELECT ON lifecycle_consumer_access TO PUBLIC;

-- Roles granted before this migration keep acting for every consumer, as they did; an operator
-- narrows them with RevokeConsumerAccess once they hold per-component grants.
INSERT INTO lifecycle_consumer_access (role_name, consumer_id)
SELECT DISTINCT a.role_name, '*' FROM lifecycle_project_access a
UNION SELECT current_user, '*'
ON CONFLICT DO NOTHING;

-- Cursors and deliveries: any role of the project may read them (status and metrics report every
-- consumer of a project), but a row may be written only by a role granted its consumer. These
-- policies are RESTRICTIVE, so they apply on top of the project scope of 0003.
DO $$
DECLARE
    t     text;
    scope text := $s$(consumer_id IN (SELECT a.consumer_id FROM lifecycle_consumer_access a WHERE a.role_name = current_user)
        OR EXISTS (SELECT 1 FROM lifecycle_consumer_access a WHERE a.role_name = current_user AND a.consumer_id = '*'))$s$;
    -- Only a role that may write who asked for a replay may ask for one: a consumer can neither
    -- replay its own dead letters nor make an audit row name an operator who never asked.
    replay text := $r$(state <> 'replay_requested'
        OR pg_catalog.has_column_privilege('lifecycle_consumer_deliveries'::regclass, 'replay_requested_by', 'UPDATE'))$r$;
    extra text;
BEGIN
    FOREACH t IN ARRAY ARRAY['lifecycle_consumer_cursors', 'lifecycle_consumer_deliveries']
    LOOP
        extra := CASE WHEN t = 'lifecycle_consumer_deliveries' THEN ' AND ' || replay ELSE '' END;
        EXECUTE pg_catalog.format('CREATE POLICY %I ON %I AS RESTRICTIVE FOR INSERT WITH CHECK (%s%s)',
                                  t || '_consumer_insert', t, scope, extra);
        EXECUTE pg_catalog.format('CREATE POLICY %I ON %I AS RESTRICTIVE FOR UPDATE USING (%s) WITH CHECK (%s%s)',
                                  t || '_consumer_update', t, scope, scope, extra);
        EXECUTE pg_catalog.format('CREATE POLICY %I ON %I AS RESTRICTIVE FOR DELETE USING (%s)',
                                  t || '_consumer_delete', t, scope);
    END LOOP;
    -- Audit rows name the consumer they are about: a role writes them only for its consumers.
    EXECUTE pg_catalog.format('CREATE POLICY lifecycle_audit_consumer_insert ON lifecycle_audit AS RESTRICTIVE FOR INSERT WITH CHECK (consumer_id IS NOT NULL AND %s)', scope);
END;
$$;

-- A sequence, once assigned, is fixed: a consumer role may number rows that have none, and only
-- a role with table-level UPDATE (the owner) may change one. Renumbering would make readers of
-- the project skip or wedge.
CREATE POLICY lifecycle_outbox_sequence_once ON lifecycle_outbox AS RESTRICTIVE FOR UPDATE
    USING (sequence IS NULL OR pg_catalog.has_table_privilege('lifecycle_outbox'::regclass, 'UPDATE'))
    WITH CHECK (true);

-- What the module writes, checked by the database. The identifier patterns are the Go
-- validators' (ValidateProjectID, ParseConsumerID, Operator.Validate), with the length checked
-- apart: a bounded repetition such as {0,127} costs PostgreSQL's regular expressions several
-- microseconds per row, which every delete would pay. For task IDs, which the
-- host chooses, the database refuses control, format and space characters, a subset of what
-- the writer refuses. Timestamps are finite and within the years 1 to 9999, as the writer checks
-- deletedAt: 'infinity' cannot be decoded by a reader.
--
-- An outbox row is checked as a writer inserts it, without a sequence (a writer role cannot
-- insert one). Numbering it does not check it again: a row written before these checks existed
-- can still be numbered, and the reader then parks it as an undecodable dead letter instead of
-- the sequencer failing on it for ever.
ALTER TABLE lifecycle_outbox
    ADD CONSTRAINT lifecycle_outbox_project_id_format
        CHECK (sequence IS NOT NULL OR (project_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$' AND pg_catalog.octet_length(project_id) <= 128)) NOT VALID,
    ADD CONSTRAINT lifecycle_outbox_task_id_format
        CHECK (sequence IS NOT NULL OR (pg_catalog.octet_length(task_id) BETWEEN 1 AND 256
               AND task_id !~ '[\x01-\x20\x7f-\xa0\u1680\u2000-\u200f\u2028-\u202f\u205f-\u206f\u3000\ufeff]')) NOT VALID,
    ADD CONSTRAINT lifecycle_outbox_prior_column_format
        CHECK (sequence IS NOT NULL OR prior_column IS NULL OR (pg_catalog.octet_length(prior_column) BETWEEN 1 AND 128
               AND prior_column !~ '[\x01-\x1f\x7f-\x9f]')) NOT VALID,
    ADD CONSTRAINT lifecycle_outbox_writer_process_id_format
        CHECK (sequence IS NOT NULL OR (writer_process_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$' AND pg_catalog.octet_length(writer_process_id) <= 128)) NOT VALID,
    ADD CONSTRAINT lifecycle_outbox_times_finite
        CHECK (sequence IS NOT NULL OR (deleted_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00'
               AND occurred_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00')) NOT VALID;

ALTER TABLE lifecycle_outbox_heads
    ADD CONSTRAINT lifecycle_outbox_heads_times_finite
        CHECK (sequenced_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00'
               AND pruned_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00') NOT VALID;

ALTER TABLE lifecycle_consumer_cursors
    ADD CONSTRAINT lifecycle_consumer_cursors_lease_owner_format
        CHECK ((lease_owner ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*@[0-9a-f]{16}$' AND pg_catalog.octet_length(lease_owner) <= 145)) NOT VALID,
    ADD CONSTRAINT lifecycle_consumer_cursors_retired_by_format
        CHECK ((retired_by ~ '^[A-Za-z0-9][A-Za-z0-9._@:/-]*$' AND pg_catalog.octet_length(retired_by) <= 128)) NOT VALID,
    ADD CONSTRAINT lifecycle_consumer_cursors_retired_reason_format
        CHECK ((retired_reason ~ '^[A-Za-z0-9][A-Za-z0-9._:/#-]*$' AND pg_catalog.octet_length(retired_reason) <= 128)) NOT VALID,
    ADD CONSTRAINT lifecycle_consumer_cursors_times_finite
        CHECK (acked_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00'
               AND lease_expires_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00'
               AND heartbeat_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00'
               AND reconciled_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00'
               AND retired_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00'
               AND created_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00') NOT VALID;

-- An event the reader cannot decode is parked at once with its own class.
ALTER TABLE lifecycle_consumer_deliveries
    DROP CONSTRAINT lifecycle_consumer_deliveries_last_failure_class_check,
    ADD CONSTRAINT lifecycle_consumer_deliveries_last_failure_class_check
        CHECK (last_failure_class IN ('listener_error', 'listener_panic', 'listener_timeout', 'cache_error',
                                      'unsupported_event', 'undecodable_event')) NOT VALID,
    ADD CONSTRAINT lifecycle_consumer_deliveries_event_id_format
        CHECK (pg_catalog.octet_length(event_id) BETWEEN 1 AND 300
               AND event_id !~ '[\x01-\x20\x7f-\xa0\u1680\u2000-\u200f\u2028-\u202f\u205f-\u206f\u3000\ufeff]') NOT VALID,
    ADD CONSTRAINT lifecycle_consumer_deliveries_replay_requested_by_format
        CHECK ((replay_requested_by ~ '^[A-Za-z0-9][A-Za-z0-9._@:/-]*$' AND pg_catalog.octet_length(replay_requested_by) <= 128)) NOT VALID,
    ADD CONSTRAINT lifecycle_consumer_deliveries_replay_reason_format
        CHECK ((replay_reason ~ '^[A-Za-z0-9][A-Za-z0-9._:/#-]*$' AND pg_catalog.octet_length(replay_reason) <= 128)) NOT VALID,
    -- A replay request says who asked and why.
    ADD CONSTRAINT lifecycle_consumer_deliveries_replay_request_complete
        CHECK (state <> 'replay_requested'
               OR (replay_requested_at IS NOT NULL AND replay_requested_by IS NOT NULL AND replay_reason IS NOT NULL)) NOT VALID,
    -- The next attempt follows the last failure by at most a day, the longest retry delay the
    -- configuration allows: a consumer never waits on a time centuries ahead.
    ADD CONSTRAINT lifecycle_consumer_deliveries_next_attempt_bounded
        CHECK (next_attempt_at IS NULL
               OR (last_failed_at IS NOT NULL AND next_attempt_at BETWEEN last_failed_at AND last_failed_at + interval '1 day')) NOT VALID,
    ADD CONSTRAINT lifecycle_consumer_deliveries_times_finite
        CHECK (next_attempt_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00'
               AND first_failed_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00'
               AND last_failed_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00'
               AND parked_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00'
               AND replay_requested_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00'
               AND resolved_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00') NOT VALID;

ALTER TABLE lifecycle_audit
    ADD CONSTRAINT lifecycle_audit_project_id_format
        CHECK ((project_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$' AND pg_catalog.octet_length(project_id) <= 128)) NOT VALID,
    ADD CONSTRAINT lifecycle_audit_consumer_id_format
        CHECK ((consumer_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$' AND pg_catalog.octet_length(consumer_id) <= 128)) NOT VALID,
    ADD CONSTRAINT lifecycle_audit_event_id_format
        CHECK (pg_catalog.octet_length(event_id) BETWEEN 1 AND 300
               AND event_id !~ '[\x01-\x20\x7f-\xa0\u1680\u2000-\u200f\u2028-\u202f\u205f-\u206f\u3000\ufeff]') NOT VALID,
    ADD CONSTRAINT lifecycle_audit_actor_format
        CHECK ((actor ~ '^[A-Za-z0-9][A-Za-z0-9._@:/-]*$' AND pg_catalog.octet_length(actor) <= 128)) NOT VALID,
    ADD CONSTRAINT lifecycle_audit_reason_format
        CHECK ((reason ~ '^[A-Za-z0-9][A-Za-z0-9._:/#-]*$' AND pg_catalog.octet_length(reason) <= 128)) NOT VALID,
    ADD CONSTRAINT lifecycle_audit_times_finite
        CHECK (created_at BETWEEN '0001-01-01 00:00:00+00' AND '9999-12-31 23:59:59.999999+00') NOT VALID;

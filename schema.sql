-- The outbox module's whole schema as a freshly migrated database has it (schema version 24).
--
-- GENERATED: do not edit. `make schema` rewrites this file: it applies migrations/*.up.sql to an
-- empty throwaway database on PostgreSQL 15 and formats pg_dump's schema-only dump of it
-- (internal/schemadump). TestSchemaSQLIsCurrent there fails, under `make test`, when it differs.
--
-- This file is for reading. The module never applies it: the numbered migrations (Migrate,
-- outboxctl migrate) stay the only way to build or change a database.
--
-- Names are unqualified, as the migrations write them: the objects live in the schema the
-- migrations run in (here public, which the functions' pinned search_path names).
-- Privileges: only what PUBLIC may do appears. Grants to the writer, consumer and operator
-- roles (GrantWriterRole, GrantConsumerRole, GrantOperatorRole, and the migrations' own grants
-- to roles that already held the module's privileges when they ran) name roles a deployment
-- creates, so they are left out, as are owners.


----------------------------------------------------------------------------------------------------
-- Types and domains
----------------------------------------------------------------------------------------------------

CREATE DOMAIN lifecycle_actor AS text
	CONSTRAINT lifecycle_actor_check CHECK (((VALUE ~ '^[A-Za-z0-9][A-Za-z0-9._@:/-]*$'::text) AND (octet_length(VALUE) <= 128)));


CREATE DOMAIN lifecycle_count AS bigint
	CONSTRAINT lifecycle_count_check CHECK ((VALUE >= 0));


CREATE TYPE lifecycle_event_type AS ENUM (
    'task:deleted'
);


CREATE DOMAIN lifecycle_identifier AS text
	CONSTRAINT lifecycle_identifier_check CHECK (((VALUE ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$'::text) AND (octet_length(VALUE) <= 128)));


CREATE DOMAIN lifecycle_instance AS text
	CONSTRAINT lifecycle_instance_check CHECK (((VALUE ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*@[0-9a-f]{16}$'::text) AND (octet_length(VALUE) <= 128)));


CREATE DOMAIN lifecycle_instant AS timestamp with time zone
	CONSTRAINT lifecycle_instant_check CHECK (((VALUE >= '0001-01-01 00:00:00+00'::timestamp with time zone) AND (VALUE <= '9999-12-31 23:59:59.999999+00'::timestamp with time zone)));


CREATE DOMAIN lifecycle_label AS text
	CONSTRAINT lifecycle_label_check CHECK ((((octet_length(VALUE) >= 1) AND (octet_length(VALUE) <= 128)) AND (VALUE !~ '[\x01-\x1f\x7f-\x9f]'::text)));


CREATE DOMAIN lifecycle_payload_version AS smallint
	CONSTRAINT lifecycle_payload_version_check CHECK ((VALUE > 0));


CREATE DOMAIN lifecycle_reason AS text
	CONSTRAINT lifecycle_reason_check CHECK (((VALUE ~ '^[A-Za-z0-9][A-Za-z0-9._:/#-]*$'::text) AND (octet_length(VALUE) <= 128)));


CREATE DOMAIN lifecycle_reconcile_reason AS text
	CONSTRAINT lifecycle_reconcile_reason_check CHECK ((VALUE = ANY (ARRAY['missing_cursor'::text, 'cursor_ahead_of_head'::text, 'cursor_below_pruned_floor'::text, 'stream_hole'::text])));


CREATE DOMAIN lifecycle_task_id AS text
	CONSTRAINT lifecycle_task_id_check CHECK ((((octet_length(VALUE) >= 1) AND (octet_length(VALUE) <= 256)) AND (VALUE !~ '[\x01-\x20\x7f-\xa0\u1680\u2000-\u200f\u2028-\u202f\u205f-\u206f\u3000\ufeff]'::text)));


CREATE DOMAIN lifecycle_trace_context AS text
	CONSTRAINT lifecycle_trace_context_check CHECK (((length(VALUE) <= 600) AND (VALUE ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}( |$)'::text)));


----------------------------------------------------------------------------------------------------
-- Tables, each with its identity column, keys, checks added later, foreign keys and indexes
----------------------------------------------------------------------------------------------------

CREATE TABLE lifecycle_audit (
    id bigint NOT NULL,
    project_id text NOT NULL,
    action text NOT NULL,
    consumer_id text,
    event_id text,
    sequence bigint,
    attempts integer,
    actor text,
    reason text,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT lifecycle_audit_action_check CHECK ((action ~ '^lifecycle-observation:[a-z-]+$'::text)),
    CONSTRAINT lifecycle_audit_actor_check CHECK ((length(actor) <= 128)),
    CONSTRAINT lifecycle_audit_actor_format CHECK (((actor ~ '^[A-Za-z0-9][A-Za-z0-9._@:/-]*$'::text) AND (octet_length(actor) <= 128))),
    CONSTRAINT lifecycle_audit_consumer_id_format CHECK (((consumer_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$'::text) AND (octet_length(consumer_id) <= 128))),
    CONSTRAINT lifecycle_audit_event_id_format CHECK ((((octet_length(event_id) >= 1) AND (octet_length(event_id) <= 300)) AND (event_id !~ '[\x01-\x20\x7f-\xa0\u1680\u2000-\u200f\u2028-\u202f\u205f-\u206f\u3000\ufeff]'::text))),
    CONSTRAINT lifecycle_audit_project_id_format CHECK (((project_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$'::text) AND (octet_length(project_id) <= 128))),
    CONSTRAINT lifecycle_audit_reason_check CHECK ((length(reason) <= 128)),
    CONSTRAINT lifecycle_audit_reason_format CHECK (((reason ~ '^[A-Za-z0-9][A-Za-z0-9._:/#-]*$'::text) AND (octet_length(reason) <= 128))),
    CONSTRAINT lifecycle_audit_times_finite CHECK (((created_at >= '0001-01-01 00:00:00+00'::timestamp with time zone) AND (created_at <= '9999-12-31 23:59:59.999999+00'::timestamp with time zone)))
);

ALTER TABLE ONLY lifecycle_audit FORCE ROW LEVEL SECURITY;

ALTER TABLE lifecycle_audit ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME lifecycle_audit_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

ALTER TABLE ONLY lifecycle_audit
    ADD CONSTRAINT lifecycle_audit_pkey PRIMARY KEY (id);

CREATE INDEX lifecycle_audit_project ON lifecycle_audit USING btree (project_id, id);


CREATE TABLE lifecycle_consumer_access (
    role_name name NOT NULL,
    consumer_id text NOT NULL,
    CONSTRAINT lifecycle_consumer_access_consumer_id_check CHECK (((consumer_id = '*'::text) OR ((consumer_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$'::text) AND (octet_length(consumer_id) <= 128))))
);

ALTER TABLE ONLY lifecycle_consumer_access
    ADD CONSTRAINT lifecycle_consumer_access_pkey PRIMARY KEY (role_name, consumer_id);

GRANT SELECT ON TABLE lifecycle_consumer_access TO PUBLIC;


CREATE TABLE lifecycle_consumer_cursors (
    project_id text NOT NULL,
    consumer_id text NOT NULL,
    last_acked_sequence lifecycle_count,
    acked_at lifecycle_instant,
    lease_owner lifecycle_instance,
    lease_epoch lifecycle_count DEFAULT 0 NOT NULL,
    lease_expires_at lifecycle_instant,
    heartbeat_at lifecycle_instant,
    reconciled_at lifecycle_instant,
    reconcile_reason lifecycle_reconcile_reason,
    retired_at lifecycle_instant,
    retired_by lifecycle_actor,
    retired_reason lifecycle_reason,
    created_at lifecycle_instant DEFAULT now() NOT NULL,
    CONSTRAINT lifecycle_consumer_cursors_check CHECK (((retired_at IS NULL) = (retired_by IS NULL))),
    CONSTRAINT lifecycle_consumer_cursors_consumer_id_format CHECK (((consumer_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$'::text) AND (octet_length(consumer_id) <= 128))),
    CONSTRAINT lifecycle_consumer_cursors_project_id_format CHECK (((project_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$'::text) AND (octet_length(project_id) <= 128)))
);

ALTER TABLE ONLY lifecycle_consumer_cursors FORCE ROW LEVEL SECURITY;

ALTER TABLE ONLY lifecycle_consumer_cursors
    ADD CONSTRAINT lifecycle_consumer_cursors_pkey PRIMARY KEY (project_id, consumer_id);

CREATE INDEX lifecycle_consumer_cursors_consumer ON lifecycle_consumer_cursors USING btree (consumer_id, project_id);


CREATE TABLE lifecycle_consumer_deliveries (
    project_id text NOT NULL,
    consumer_id text NOT NULL,
    sequence bigint NOT NULL,
    event_id text NOT NULL,
    state text NOT NULL,
    attempts integer NOT NULL,
    next_attempt_at timestamp with time zone,
    last_failure_class text,
    first_failed_at timestamp with time zone,
    last_failed_at timestamp with time zone,
    parked_at timestamp with time zone,
    replay_requested_at timestamp with time zone,
    replay_requested_by text,
    replay_reason text,
    resolved_at timestamp with time zone,
    CONSTRAINT lifecycle_consumer_deliveries_attempts_check CHECK ((attempts >= 0)),
    CONSTRAINT lifecycle_consumer_deliveries_check CHECK (((state <> 'retrying'::text) OR (next_attempt_at IS NOT NULL))),
    CONSTRAINT lifecycle_consumer_deliveries_check1 CHECK (((state <> 'dead'::text) OR (parked_at IS NOT NULL))),
    CONSTRAINT lifecycle_consumer_deliveries_check2 CHECK (((state <> 'resolved'::text) OR (resolved_at IS NOT NULL))),
    CONSTRAINT lifecycle_consumer_deliveries_event_id_format CHECK ((((octet_length(event_id) >= 1) AND (octet_length(event_id) <= 300)) AND (event_id !~ '[\x01-\x20\x7f-\xa0\u1680\u2000-\u200f\u2028-\u202f\u205f-\u206f\u3000\ufeff]'::text))),
    CONSTRAINT lifecycle_consumer_deliveries_last_failure_class_check CHECK ((last_failure_class = ANY (ARRAY['listener_error'::text, 'listener_panic'::text, 'listener_timeout'::text, 'cache_error'::text, 'unsupported_event'::text, 'undecodable_event'::text]))),
    CONSTRAINT lifecycle_consumer_deliveries_next_attempt_bounded CHECK (((next_attempt_at IS NULL) OR ((last_failed_at IS NOT NULL) AND ((next_attempt_at >= last_failed_at) AND (next_attempt_at <= (last_failed_at + '1 day'::interval)))))),
    CONSTRAINT lifecycle_consumer_deliveries_replay_reason_check CHECK ((length(replay_reason) <= 128)),
    CONSTRAINT lifecycle_consumer_deliveries_replay_reason_format CHECK (((replay_reason ~ '^[A-Za-z0-9][A-Za-z0-9._:/#-]*$'::text) AND (octet_length(replay_reason) <= 128))),
    CONSTRAINT lifecycle_consumer_deliveries_replay_request_complete CHECK (((state <> 'replay_requested'::text) OR ((replay_requested_at IS NOT NULL) AND (replay_requested_by IS NOT NULL) AND (replay_reason IS NOT NULL)))),
    CONSTRAINT lifecycle_consumer_deliveries_replay_requested_by_check CHECK ((length(replay_requested_by) <= 128)),
    CONSTRAINT lifecycle_consumer_deliveries_replay_requested_by_format CHECK (((replay_requested_by ~ '^[A-Za-z0-9][A-Za-z0-9._@:/-]*$'::text) AND (octet_length(replay_requested_by) <= 128))),
    CONSTRAINT lifecycle_consumer_deliveries_sequence_check CHECK ((sequence > 0)),
    CONSTRAINT lifecycle_consumer_deliveries_state_check CHECK ((state = ANY (ARRAY['retrying'::text, 'dead'::text, 'replay_requested'::text, 'resolved'::text]))),
    CONSTRAINT lifecycle_consumer_deliveries_times_finite CHECK ((((next_attempt_at >= '0001-01-01 00:00:00+00'::timestamp with time zone) AND (next_attempt_at <= '9999-12-31 23:59:59.999999+00'::timestamp with time zone)) AND ((first_failed_at >= '0001-01-01 00:00:00+00'::timestamp with time zone) AND (first_failed_at <= '9999-12-31 23:59:59.999999+00'::timestamp with time zone)) AND ((last_failed_at >= '0001-01-01 00:00:00+00'::timestamp with time zone) AND (last_failed_at <= '9999-12-31 23:59:59.999999+00'::timestamp with time zone)) AND ((parked_at >= '0001-01-01 00:00:00+00'::timestamp with time zone) AND (parked_at <= '9999-12-31 23:59:59.999999+00'::timestamp with time zone)) AND ((replay_requested_at >= '0001-01-01 00:00:00+00'::timestamp with time zone) AND (replay_requested_at <= '9999-12-31 23:59:59.999999+00'::timestamp with time zone)) AND ((resolved_at >= '0001-01-01 00:00:00+00'::timestamp with time zone) AND (resolved_at <= '9999-12-31 23:59:59.999999+00'::timestamp with time zone))))
);

ALTER TABLE ONLY lifecycle_consumer_deliveries FORCE ROW LEVEL SECURITY;

ALTER TABLE ONLY lifecycle_consumer_deliveries
    ADD CONSTRAINT lifecycle_consumer_deliveries_pkey PRIMARY KEY (project_id, consumer_id, sequence);

ALTER TABLE ONLY lifecycle_consumer_deliveries
    ADD CONSTRAINT lifecycle_consumer_deliveries_project_id_consumer_id_fkey FOREIGN KEY (project_id, consumer_id) REFERENCES lifecycle_consumer_cursors(project_id, consumer_id);

CREATE INDEX lifecycle_consumer_deliveries_open ON lifecycle_consumer_deliveries USING btree (consumer_id, project_id, sequence) WHERE (state = ANY (ARRAY['retrying'::text, 'replay_requested'::text]));


CREATE TABLE lifecycle_event_log (
    project_id lifecycle_identifier NOT NULL,
    task_id lifecycle_task_id NOT NULL,
    deleted_at lifecycle_instant NOT NULL,
    event_type lifecycle_event_type NOT NULL,
    archived boolean NOT NULL,
    payload_version lifecycle_payload_version NOT NULL,
    occurred_at lifecycle_instant NOT NULL,
    writer_process_id lifecycle_identifier NOT NULL,
    prior_column lifecycle_label,
    trace_context lifecycle_trace_context,
    txid xid8 DEFAULT pg_current_xact_id() NOT NULL
);

ALTER TABLE ONLY lifecycle_event_log FORCE ROW LEVEL SECURITY;

ALTER TABLE ONLY lifecycle_event_log
    ADD CONSTRAINT lifecycle_event_log_pkey PRIMARY KEY (project_id, deleted_at, task_id);

CREATE INDEX lifecycle_event_log_batch ON lifecycle_event_log USING btree (txid, project_id);


CREATE TABLE lifecycle_outbox (
    project_id text NOT NULL,
    task_id text NOT NULL,
    deleted_at timestamp with time zone NOT NULL,
    sequence bigint,
    event_type lifecycle_event_type NOT NULL,
    archived boolean NOT NULL,
    payload_version smallint NOT NULL,
    occurred_at timestamp with time zone NOT NULL,
    writer_process_id text NOT NULL,
    prior_column text,
    trace_context text,
    CONSTRAINT lifecycle_outbox_payload_version_check CHECK ((payload_version > 0)),
    CONSTRAINT lifecycle_outbox_prior_column_format CHECK (((sequence IS NOT NULL) OR (prior_column IS NULL) OR (((octet_length(prior_column) >= 1) AND (octet_length(prior_column) <= 128)) AND (prior_column !~ '[\x01-\x1f\x7f-\x9f]'::text)))),
    CONSTRAINT lifecycle_outbox_project_id_format CHECK (((sequence IS NOT NULL) OR ((project_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$'::text) AND (octet_length(project_id) <= 128)))),
    CONSTRAINT lifecycle_outbox_sequence_check CHECK ((sequence > 0)),
    CONSTRAINT lifecycle_outbox_task_id_format CHECK (((sequence IS NOT NULL) OR (((octet_length(task_id) >= 1) AND (octet_length(task_id) <= 256)) AND (task_id !~ '[\x01-\x20\x7f-\xa0\u1680\u2000-\u200f\u2028-\u202f\u205f-\u206f\u3000\ufeff]'::text)))),
    CONSTRAINT lifecycle_outbox_times_finite CHECK (((sequence IS NOT NULL) OR (((deleted_at >= '0001-01-01 00:00:00+00'::timestamp with time zone) AND (deleted_at <= '9999-12-31 23:59:59.999999+00'::timestamp with time zone)) AND ((occurred_at >= '0001-01-01 00:00:00+00'::timestamp with time zone) AND (occurred_at <= '9999-12-31 23:59:59.999999+00'::timestamp with time zone))))),
    CONSTRAINT lifecycle_outbox_trace_context_check CHECK (((length(trace_context) <= 600) AND (trace_context ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}( |$)'::text))),
    CONSTRAINT lifecycle_outbox_writer_process_id_format CHECK (((sequence IS NOT NULL) OR ((writer_process_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$'::text) AND (octet_length(writer_process_id) <= 128))))
);

ALTER TABLE ONLY lifecycle_outbox FORCE ROW LEVEL SECURITY;

ALTER TABLE ONLY lifecycle_outbox
    ADD CONSTRAINT lifecycle_outbox_pkey PRIMARY KEY (project_id, deleted_at, task_id);

CREATE UNIQUE INDEX lifecycle_outbox_project_sequence ON lifecycle_outbox USING btree (project_id, sequence) WHERE (sequence IS NOT NULL);

CREATE INDEX lifecycle_outbox_unsequenced ON lifecycle_outbox USING btree (project_id, occurred_at) WHERE (sequence IS NULL);


CREATE TABLE lifecycle_outbox_heads (
    project_id text NOT NULL,
    last_sequence bigint DEFAULT 0 NOT NULL,
    pruned_through bigint DEFAULT 0 NOT NULL,
    sequenced_at timestamp with time zone,
    pruned_at timestamp with time zone,
    sequencer_owner text,
    sequencer_until timestamp with time zone,
    notified_at timestamp with time zone,
    CONSTRAINT lifecycle_outbox_heads_check CHECK (((pruned_through >= 0) AND (pruned_through <= last_sequence))),
    CONSTRAINT lifecycle_outbox_heads_last_sequence_check CHECK ((last_sequence >= 0)),
    CONSTRAINT lifecycle_outbox_heads_project_id_format CHECK (((project_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$'::text) AND (octet_length(project_id) <= 128))),
    CONSTRAINT lifecycle_outbox_heads_sequencer_owner_format CHECK (((sequencer_owner ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*@[0-9a-f]{16}$'::text) AND (octet_length(sequencer_owner) <= 145))),
    CONSTRAINT lifecycle_outbox_heads_sequencer_times_finite CHECK ((((sequencer_until >= '0001-01-01 00:00:00+00'::timestamp with time zone) AND (sequencer_until <= '9999-12-31 23:59:59.999999+00'::timestamp with time zone)) AND ((notified_at >= '0001-01-01 00:00:00+00'::timestamp with time zone) AND (notified_at <= '9999-12-31 23:59:59.999999+00'::timestamp with time zone)))),
    CONSTRAINT lifecycle_outbox_heads_times_finite CHECK ((((sequenced_at >= '0001-01-01 00:00:00+00'::timestamp with time zone) AND (sequenced_at <= '9999-12-31 23:59:59.999999+00'::timestamp with time zone)) AND ((pruned_at >= '0001-01-01 00:00:00+00'::timestamp with time zone) AND (pruned_at <= '9999-12-31 23:59:59.999999+00'::timestamp with time zone))))
);

ALTER TABLE ONLY lifecycle_outbox_heads FORCE ROW LEVEL SECURITY;

ALTER TABLE ONLY lifecycle_outbox_heads
    ADD CONSTRAINT lifecycle_outbox_heads_pkey PRIMARY KEY (project_id);


CREATE TABLE lifecycle_outbox_pending (
    project_id lifecycle_identifier NOT NULL,
    task_id lifecycle_task_id NOT NULL,
    deleted_at lifecycle_instant NOT NULL,
    event_type lifecycle_event_type NOT NULL,
    archived boolean NOT NULL,
    payload_version lifecycle_payload_version NOT NULL,
    occurred_at lifecycle_instant NOT NULL,
    writer_process_id lifecycle_identifier NOT NULL,
    prior_column lifecycle_label,
    trace_context lifecycle_trace_context
)
WITH (autovacuum_vacuum_scale_factor='0', autovacuum_vacuum_threshold='10000', autovacuum_vacuum_insert_scale_factor='0', autovacuum_vacuum_insert_threshold='100000');

ALTER TABLE ONLY lifecycle_outbox_pending FORCE ROW LEVEL SECURITY;

ALTER TABLE ONLY lifecycle_outbox_pending
    ADD CONSTRAINT lifecycle_outbox_pending_pkey PRIMARY KEY (project_id, deleted_at, task_id);


CREATE TABLE lifecycle_project_access (
    role_name name NOT NULL,
    project_id text NOT NULL,
    CONSTRAINT lifecycle_project_access_project_id_format CHECK (((project_id = '*'::text) OR ((project_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]*$'::text) AND (octet_length(project_id) <= 128))))
);

ALTER TABLE ONLY lifecycle_project_access
    ADD CONSTRAINT lifecycle_project_access_pkey PRIMARY KEY (role_name, project_id);


CREATE TABLE lifecycle_tick (
    tick_id bigint NOT NULL,
    snapshot pg_snapshot NOT NULL,
    ticked_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT lifecycle_tick_tick_id_check CHECK ((tick_id > 0))
);

ALTER TABLE ONLY lifecycle_tick
    ADD CONSTRAINT lifecycle_tick_pkey PRIMARY KEY (tick_id);


CREATE TABLE lifecycle_tick_project (
    tick_id bigint NOT NULL,
    project_id lifecycle_identifier NOT NULL,
    first_sequence bigint NOT NULL,
    events integer NOT NULL,
    CONSTRAINT lifecycle_tick_project_events_check CHECK ((events > 0)),
    CONSTRAINT lifecycle_tick_project_first_sequence_check CHECK ((first_sequence > 0))
);

ALTER TABLE ONLY lifecycle_tick_project FORCE ROW LEVEL SECURITY;

ALTER TABLE ONLY lifecycle_tick_project
    ADD CONSTRAINT lifecycle_tick_project_pkey PRIMARY KEY (tick_id, project_id);

ALTER TABLE ONLY lifecycle_tick_project
    ADD CONSTRAINT lifecycle_tick_project_sequence UNIQUE (project_id, first_sequence);


----------------------------------------------------------------------------------------------------
-- Functions, each with its settings (search_path, plan_cache_mode, ...) and what PUBLIC may do with it
----------------------------------------------------------------------------------------------------

CREATE FUNCTION lifecycle_event_id(p_task_id text, p_deleted_at timestamp with time zone) RETURNS text
    LANGUAGE sql STABLE PARALLEL SAFE
    SET search_path TO 'pg_catalog', 'public', 'pg_temp'
    RETURN ((('task-deleted:'::text || p_task_id) || ':'::text) || to_char((p_deleted_at AT TIME ZONE 'UTC'::text), 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'::text));


CREATE FUNCTION lifecycle_outbox_adopt_legacy(p_limit integer) RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER
    SET lock_timeout TO '1s'
    SET search_path TO 'pg_catalog', 'public', 'pg_temp'
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

REVOKE ALL ON FUNCTION lifecycle_outbox_adopt_legacy(p_limit integer) FROM PUBLIC;


CREATE FUNCTION lifecycle_outbox_prune(p_project text, p_limit integer, p_after bigint, p_offset interval, p_window interval) RETURNS TABLE(pruned bigint, max_sequence bigint)
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'public', 'pg_temp'
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

REVOKE ALL ON FUNCTION lifecycle_outbox_prune(p_project text, p_limit integer, p_after bigint, p_offset interval, p_window interval) FROM PUBLIC;


CREATE FUNCTION lifecycle_outbox_prune_dead_letters(p_limit integer, p_offset interval, p_retention interval) RETURNS bigint
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'public', 'pg_temp'
    AS $$
DECLARE
    v_roles   name[];
    v_every   boolean;
    v_allowed text[];
    v_pruned  bigint;
BEGIN
    IF p_limit IS NULL OR p_limit OPERATOR(pg_catalog.<) 1 OR p_limit OPERATOR(pg_catalog.>) 100000 THEN
        RAISE EXCEPTION 'p_limit must be between 1 and 100000' USING ERRCODE = '22023';
    END IF;
    IF p_offset IS NULL OR p_retention IS NULL OR p_retention OPERATOR(pg_catalog.<) '1 hour'::interval THEN
        RAISE EXCEPTION 'p_offset must be set and p_retention at least an hour' USING ERRCODE = '22023';
    END IF;
    v_roles := ARRAY(SELECT r.rolname FROM pg_catalog.pg_roles r WHERE pg_catalog.pg_has_role(SESSION_USER, r.oid, 'MEMBER'));
    v_every := EXISTS (SELECT 1 FROM lifecycle_project_access a
                       WHERE a.role_name OPERATOR(pg_catalog.=) ANY (v_roles) AND a.project_id OPERATOR(pg_catalog.=) '*');
    IF NOT v_every THEN
        v_allowed := ARRAY(SELECT a.project_id FROM lifecycle_project_access a WHERE a.role_name OPERATOR(pg_catalog.=) ANY (v_roles));
    END IF;

    WITH doomed AS (
        SELECT d.ctid AS row_id FROM lifecycle_consumer_deliveries d
        JOIN lifecycle_consumer_cursors c ON c.project_id OPERATOR(pg_catalog.=) d.project_id
                                         AND c.consumer_id OPERATOR(pg_catalog.=) d.consumer_id
        WHERE (v_every OR d.project_id OPERATOR(pg_catalog.=) ANY (v_allowed))
          AND ((d.state OPERATOR(pg_catalog.=) 'resolved'
                AND d.resolved_at OPERATOR(pg_catalog.<) ((pg_catalog.now() OPERATOR(pg_catalog.+) p_offset) OPERATOR(pg_catalog.-) p_retention))
               OR (d.state OPERATOR(pg_catalog.<>) 'resolved' AND c.retired_at IS NOT NULL))
        LIMIT p_limit
    ), gone AS (
        DELETE FROM lifecycle_consumer_deliveries d USING doomed WHERE d.ctid OPERATOR(pg_catalog.=) doomed.row_id
        RETURNING 1
    )
    SELECT pg_catalog.count(*) INTO v_pruned FROM gone;
    RETURN v_pruned;
END;
$$;

REVOKE ALL ON FUNCTION lifecycle_outbox_prune_dead_letters(p_limit integer, p_offset interval, p_retention interval) FROM PUBLIC;


CREATE FUNCTION lifecycle_outbox_read(p_project text, p_after bigint, p_limit integer, p_key_txid xid8, p_key_deleted_at timestamp with time zone, p_key_task_id text) RETURNS TABLE(project_id text, sequence bigint, event_type lifecycle_event_type, task_id text, deleted_at timestamp with time zone, prior_column text, archived boolean, writer_process_id text, occurred_at timestamp with time zone, payload_version smallint, trace_context text, txid xid8)
    LANGUAGE plpgsql STABLE
    SET search_path TO 'pg_catalog', 'public', 'pg_temp'
    SET plan_cache_mode TO 'force_generic_plan'
    SET max_parallel_workers_per_gather TO '0'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
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

REVOKE ALL ON FUNCTION lifecycle_outbox_read(p_project text, p_after bigint, p_limit integer, p_key_txid xid8, p_key_deleted_at timestamp with time zone, p_key_task_id text) FROM PUBLIC;


CREATE FUNCTION lifecycle_outbox_read_parts(p_projects text[], p_after bigint[], p_limit integer) RETURNS TABLE(project_id text, sequence bigint, event_type lifecycle_event_type, task_id text, deleted_at timestamp with time zone, prior_column text, archived boolean, writer_process_id text, occurred_at timestamp with time zone, payload_version smallint, trace_context text, txid xid8)
    LANGUAGE plpgsql STABLE
    SET search_path TO 'pg_catalog', 'public', 'pg_temp'
    SET plan_cache_mode TO 'force_generic_plan'
    SET max_parallel_workers_per_gather TO '0'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
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

REVOKE ALL ON FUNCTION lifecycle_outbox_read_parts(p_projects text[], p_after bigint[], p_limit integer) FROM PUBLIC;


CREATE FUNCTION lifecycle_outbox_read_ticks(p_projects text[], p_tick bigint, p_limit integer) RETURNS TABLE(project_id text, event_type lifecycle_event_type, task_id text, deleted_at timestamp with time zone, prior_column text, archived boolean, writer_process_id text, occurred_at timestamp with time zone, payload_version smallint, trace_context text, txid xid8, tick_id bigint, part_first_sequence bigint, part_events integer)
    LANGUAGE plpgsql STABLE
    SET search_path TO 'pg_catalog', 'public', 'pg_temp'
    SET plan_cache_mode TO 'force_generic_plan'
    SET max_parallel_workers_per_gather TO '0'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
    AS $$
BEGIN
    IF p_projects IS NULL OR pg_catalog.cardinality(p_projects) OPERATOR(pg_catalog.>) 10000
       OR p_tick IS NULL OR p_tick OPERATOR(pg_catalog.<) 0 OR p_tick OPERATOR(pg_catalog.>) 1000000000000000
       OR p_limit IS NULL OR p_limit OPERATOR(pg_catalog.<) 1 OR p_limit OPERATOR(pg_catalog.>) 100000 THEN
        RAISE EXCEPTION 'p_projects must be an array of at most 10000 projects, p_tick between 0 and 10^15 and p_limit between 1 and 100000'
            USING ERRCODE = '22023';
    END IF;

    RETURN QUERY
    WITH span AS (
        -- The projects' parts in the ticks after p_tick, in tick order: one walk of the tick
        -- key, at most p_limit ticks and p_limit parts.
        SELECT s.tick_id, s.project, s.first_sequence, s.events
        FROM (SELECT tp.tick_id, tp.project_id::text AS project, tp.first_sequence, tp.events
              FROM lifecycle_tick_project tp
              WHERE tp.tick_id OPERATOR(pg_catalog.>) p_tick
                AND tp.tick_id OPERATOR(pg_catalog.<=) (p_tick OPERATOR(pg_catalog.+) p_limit)
              OFFSET 0 -- keeps the project filter below out of the index conditions
             ) s
        WHERE s.project OPERATOR(pg_catalog.=) ANY (p_projects)
        ORDER BY s.tick_id
        LIMIT p_limit
    ), ticks AS (
        -- Each tick once, with both snapshots (each looked up by its key: a join could scan
        -- the whole tick table).
        SELECT g.tick_id,
               (SELECT c.snapshot FROM lifecycle_tick c WHERE c.tick_id OPERATOR(pg_catalog.=) g.tick_id) AS cur,
               (SELECT b.snapshot FROM lifecycle_tick b WHERE b.tick_id OPERATOR(pg_catalog.=) (g.tick_id OPERATOR(pg_catalog.-) 1)) AS prev
        FROM (SELECT DISTINCT s.tick_id FROM span s) g
    ), batch AS MATERIALIZED (
        -- A tick's batch for all its projects at once: one walk of the batch index per tick
        -- (materialized, so that the plan cannot walk it once per part instead). The projects
        -- are filtered after the walk, by the join below.
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
            OFFSET 0
        ) e
    )
    SELECT e.project_id::text, e.event_type, e.task_id::text, e.deleted_at::timestamptz, e.prior_column::text,
           e.archived, e.writer_process_id::text, e.occurred_at::timestamptz,
           e.payload_version::smallint, e.trace_context::text, e.txid,
           e.tick_id, p.first_sequence, p.events
    FROM batch e
    JOIN span p ON p.tick_id OPERATOR(pg_catalog.=) e.tick_id AND p.project OPERATOR(pg_catalog.=) e.project_id::text
    LIMIT p_limit;
END;
$$;

REVOKE ALL ON FUNCTION lifecycle_outbox_read_ticks(p_projects text[], p_tick bigint, p_limit integer) FROM PUBLIC;


CREATE FUNCTION lifecycle_outbox_tick(p_channel text) RETURNS TABLE(tick_id bigint, projects integer, events bigint, legacy boolean)
    LANGUAGE plpgsql SECURITY DEFINER
    SET lock_timeout TO '1s'
    SET search_path TO 'pg_catalog', 'public', 'pg_temp'
    SET plan_cache_mode TO 'force_generic_plan'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
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

REVOKE ALL ON FUNCTION lifecycle_outbox_tick(p_channel text) FROM PUBLIC;


CREATE FUNCTION lifecycle_outbox_unticked() RETURNS boolean
    LANGUAGE plpgsql STABLE SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'public', 'pg_temp'
    SET plan_cache_mode TO 'force_generic_plan'
    SET max_parallel_workers_per_gather TO '0'
    SET enable_seqscan TO 'off'
    SET enable_bitmapscan TO 'off'
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

REVOKE ALL ON FUNCTION lifecycle_outbox_unticked() FROM PUBLIC;


----------------------------------------------------------------------------------------------------
-- Row-level security: enabled per table (FORCE is in each CREATE TABLE's group above), then its policies
----------------------------------------------------------------------------------------------------

ALTER TABLE lifecycle_audit ENABLE ROW LEVEL SECURITY;

CREATE POLICY lifecycle_audit_action_insert ON lifecycle_audit AS RESTRICTIVE FOR INSERT WITH CHECK (((((action = 'lifecycle-observation:consumer-retired'::text) OR (action = 'lifecycle-observation:consumer-reinstated'::text)) AND (actor IS NOT NULL) AND has_column_privilege(('lifecycle_consumer_cursors'::regclass)::oid, 'retired_by'::text, 'UPDATE'::text)) OR ((action = 'lifecycle-observation:consumer-poisoned'::text) AND (actor IS NULL) AND (reason IS NULL) AND (EXISTS ( SELECT 1
   FROM lifecycle_consumer_deliveries d
  WHERE ((d.project_id = lifecycle_audit.project_id) AND (d.consumer_id = lifecycle_audit.consumer_id) AND (d.sequence = lifecycle_audit.sequence) AND (d.state = 'dead'::text))))) OR ((action = 'lifecycle-observation:consumer-replayed'::text) AND (EXISTS ( SELECT 1
   FROM lifecycle_consumer_deliveries d
  WHERE ((d.project_id = lifecycle_audit.project_id) AND (d.consumer_id = lifecycle_audit.consumer_id) AND (d.sequence = lifecycle_audit.sequence) AND ((d.state = 'replay_requested'::text) OR (d.state = 'resolved'::text)) AND (d.replay_requested_at IS NOT NULL) AND (d.replay_requested_by IS NOT NULL) AND ((lifecycle_audit.actor IS NULL) OR (lifecycle_audit.actor = d.replay_requested_by)) AND ((lifecycle_audit.reason IS NULL) OR (lifecycle_audit.reason = d.replay_reason))))))));

CREATE POLICY lifecycle_audit_consumer_insert ON lifecycle_audit AS RESTRICTIVE FOR INSERT WITH CHECK (((consumer_id IS NOT NULL) AND ((EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = lifecycle_audit.consumer_id)))))));

CREATE POLICY lifecycle_audit_project_scope ON lifecycle_audit USING (((EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = lifecycle_audit.project_id)))))) WITH CHECK (((EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = lifecycle_audit.project_id))))));


ALTER TABLE lifecycle_consumer_access ENABLE ROW LEVEL SECURITY;

CREATE POLICY lifecycle_consumer_access_own ON lifecycle_consumer_access FOR SELECT USING ((role_name = CURRENT_USER));


ALTER TABLE lifecycle_consumer_cursors ENABLE ROW LEVEL SECURITY;

CREATE POLICY lifecycle_consumer_cursors_consumer_delete ON lifecycle_consumer_cursors AS RESTRICTIVE FOR DELETE USING (((EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = lifecycle_consumer_cursors.consumer_id))))));

CREATE POLICY lifecycle_consumer_cursors_consumer_insert ON lifecycle_consumer_cursors AS RESTRICTIVE FOR INSERT WITH CHECK (((EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = lifecycle_consumer_cursors.consumer_id))))));

CREATE POLICY lifecycle_consumer_cursors_consumer_update ON lifecycle_consumer_cursors AS RESTRICTIVE FOR UPDATE USING (((EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = lifecycle_consumer_cursors.consumer_id)))))) WITH CHECK (((EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = lifecycle_consumer_cursors.consumer_id))))));

CREATE POLICY lifecycle_consumer_cursors_project_scope ON lifecycle_consumer_cursors USING (((EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = lifecycle_consumer_cursors.project_id)))))) WITH CHECK (((EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = lifecycle_consumer_cursors.project_id))))));


ALTER TABLE lifecycle_consumer_deliveries ENABLE ROW LEVEL SECURITY;

CREATE POLICY lifecycle_consumer_deliveries_consumer_delete ON lifecycle_consumer_deliveries AS RESTRICTIVE FOR DELETE USING (((EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = lifecycle_consumer_deliveries.consumer_id))))));

CREATE POLICY lifecycle_consumer_deliveries_consumer_insert ON lifecycle_consumer_deliveries AS RESTRICTIVE FOR INSERT WITH CHECK ((((EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = lifecycle_consumer_deliveries.consumer_id))))) AND ((state <> 'replay_requested'::text) OR has_column_privilege(('lifecycle_consumer_deliveries'::regclass)::oid, 'replay_requested_by'::text, 'UPDATE'::text))));

CREATE POLICY lifecycle_consumer_deliveries_consumer_update ON lifecycle_consumer_deliveries AS RESTRICTIVE FOR UPDATE USING (((EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = lifecycle_consumer_deliveries.consumer_id)))))) WITH CHECK ((((EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_consumer_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.consumer_id = lifecycle_consumer_deliveries.consumer_id))))) AND ((state <> 'replay_requested'::text) OR has_column_privilege(('lifecycle_consumer_deliveries'::regclass)::oid, 'replay_requested_by'::text, 'UPDATE'::text))));

CREATE POLICY lifecycle_consumer_deliveries_project_scope ON lifecycle_consumer_deliveries USING (((EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = lifecycle_consumer_deliveries.project_id)))))) WITH CHECK (((EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = lifecycle_consumer_deliveries.project_id))))));


ALTER TABLE lifecycle_event_log ENABLE ROW LEVEL SECURITY;

CREATE POLICY lifecycle_event_log_project_scope ON lifecycle_event_log USING (((EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = (lifecycle_event_log.project_id)::text)))))) WITH CHECK (((EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = (lifecycle_event_log.project_id)::text))))));


ALTER TABLE lifecycle_outbox ENABLE ROW LEVEL SECURITY;

CREATE POLICY lifecycle_outbox_project_scope ON lifecycle_outbox USING (((EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = lifecycle_outbox.project_id)))))) WITH CHECK (((EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = lifecycle_outbox.project_id))))));

CREATE POLICY lifecycle_outbox_sequence_once ON lifecycle_outbox AS RESTRICTIVE FOR UPDATE USING (((sequence IS NULL) OR has_table_privilege(('lifecycle_outbox'::regclass)::oid, 'UPDATE'::text))) WITH CHECK (true);


ALTER TABLE lifecycle_outbox_heads ENABLE ROW LEVEL SECURITY;

CREATE POLICY lifecycle_outbox_heads_project_scope ON lifecycle_outbox_heads USING (((EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = lifecycle_outbox_heads.project_id)))))) WITH CHECK (((EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = lifecycle_outbox_heads.project_id))))));


ALTER TABLE lifecycle_outbox_pending ENABLE ROW LEVEL SECURITY;

CREATE POLICY lifecycle_outbox_pending_project_scope ON lifecycle_outbox_pending USING (((EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = (lifecycle_outbox_pending.project_id)::text)))))) WITH CHECK (((EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = (lifecycle_outbox_pending.project_id)::text))))));


ALTER TABLE lifecycle_project_access ENABLE ROW LEVEL SECURITY;

CREATE POLICY lifecycle_project_access_own ON lifecycle_project_access FOR SELECT USING ((role_name = CURRENT_USER));


ALTER TABLE lifecycle_tick_project ENABLE ROW LEVEL SECURITY;

CREATE POLICY lifecycle_tick_project_project_scope ON lifecycle_tick_project USING (((EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = '*'::text)))) OR (EXISTS ( SELECT 1
   FROM lifecycle_project_access a
  WHERE ((a.role_name = CURRENT_USER) AND (a.project_id = (lifecycle_tick_project.project_id)::text))))));


----------------------------------------------------------------------------------------------------
-- Views
----------------------------------------------------------------------------------------------------

CREATE VIEW lifecycle_outbox_head WITH (security_invoker='true') AS
 SELECT h.project_id,
    GREATEST(h.last_sequence, COALESCE(t.last_sequence, (0)::bigint)) AS last_sequence,
    h.pruned_through
   FROM (lifecycle_outbox_heads h
     LEFT JOIN LATERAL ( SELECT ((tp.first_sequence + tp.events) - 1) AS last_sequence
           FROM lifecycle_tick_project tp
          WHERE ((tp.project_id)::text = h.project_id)
          ORDER BY tp.first_sequence DESC
         LIMIT 1) t ON (true));


----------------------------------------------------------------------------------------------------
-- Migration bookkeeping: the applier's table of applied versions and checksums
----------------------------------------------------------------------------------------------------

CREATE TABLE lifecycle_outbox_schema (
    version integer NOT NULL,
    name text NOT NULL,
    checksum text NOT NULL,
    applied_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT lifecycle_outbox_schema_version_check CHECK ((version > 0))
);

ALTER TABLE ONLY lifecycle_outbox_schema
    ADD CONSTRAINT lifecycle_outbox_schema_pkey PRIMARY KEY (version);

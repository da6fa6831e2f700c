-- Pruning runs as the owner, the floor follows only what pruning removed, a consumer writes only
-- the audit rows of what a consumer does, and a writer reads only what identifies its events.
--
-- The operator role held DELETE on lifecycle_outbox and lifecycle_consumer_deliveries, which
-- pruning needs, and UPDATE on lifecycle_outbox_heads.pruned_through. With DELETE it could
-- LOCK either table in ACCESS EXCLUSIVE mode and stall every project's consumers and readers;
-- with the floor it could raise pruned_through to the head while every event was still stored,
-- and a consumer below it then reconciled to the head and delivered none of the events between.
-- Now two functions prune, run as the owner (SECURITY DEFINER) for the projects granted to the
-- caller, and no role but the owner holds table-level UPDATE, DELETE or TRUNCATE on a module
-- table, nor UPDATE on the floor: the floor moves only in the transaction that deleted the rows
-- under it, to the highest sequence deleted.
--
-- The consumer role could insert any audit action under any actor for the identities granted
-- to it: "consumer-retired by alice@corp", a replay nobody asked for, an action the module does
-- not know. Now an audit row is one of the four actions the module writes, and each is bounded
-- by who writes it: retirement and reinstatement by a role that may retire (the operator), a
-- poisoned event only for a dead letter of that consumer and naming no one, a replay only for a
-- delivery an operator asked to replay, naming at most that operator and reason.

-- lifecycle_outbox_prune deletes up to p_limit events of p_project above p_after that every
-- live consumer acknowledged, that are older than p_window on the caller's clock (now shifted by
-- p_offset), and that no open delivery of a live consumer points at; then it raises the floor to
-- the highest sequence it deleted. It returns how many it deleted and that sequence (0 when
-- none). The caller's projects are those granted to the session's login role or a role it is a
-- member of, as for the sequencer.
CREATE FUNCTION lifecycle_outbox_prune(p_project text, p_limit integer, p_after bigint, p_offset interval, p_window interval)
RETURNS TABLE (pruned bigint, max_sequence bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
AS $$
#variable_conflict use_column
DECLARE
    v_roles   name[];
    v_through bigint;
    v_pruned  bigint;
    v_max     bigint;
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
    -- caller planned holds its rows back too. A cursor never positioned counts as zero.
    v_through := coalesce(
        (SELECT pg_catalog.min(coalesce(c.last_acked_sequence, 0)) FROM lifecycle_consumer_cursors c
         WHERE c.project_id OPERATOR(pg_catalog.=) p_project AND c.retired_at IS NULL),
        (SELECT h.last_sequence FROM lifecycle_outbox_heads h WHERE h.project_id OPERATOR(pg_catalog.=) p_project),
        0);
    IF v_through OPERATOR(pg_catalog.<=) 0 THEN
        RETURN QUERY SELECT 0::bigint, 0::bigint;
        RETURN;
    END IF;

    -- From above p_after: a batch that started from the bottom again would step over the index
    -- entries of every row the sweep deleted so far.
    WITH doomed AS (
        SELECT o.ctid AS row_id FROM lifecycle_outbox o
        WHERE o.project_id OPERATOR(pg_catalog.=) p_project AND o.sequence IS NOT NULL
          AND o.sequence OPERATOR(pg_catalog.<=) v_through AND o.sequence OPERATOR(pg_catalog.>) p_after
          AND o.occurred_at OPERATOR(pg_catalog.<) ((pg_catalog.now() OPERATOR(pg_catalog.+) p_offset) OPERATOR(pg_catalog.-) p_window)
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

    -- The heads row, which sequencers lock, last: a sequencer waits at most for this commit.
    IF v_pruned OPERATOR(pg_catalog.>) 0 THEN
        UPDATE lifecycle_outbox_heads h
        SET pruned_through = GREATEST(h.pruned_through, v_max), pruned_at = (pg_catalog.now() OPERATOR(pg_catalog.+) p_offset)
        WHERE h.project_id OPERATOR(pg_catalog.=) p_project;
    END IF;
    RETURN QUERY SELECT v_pruned, v_max;
END;
$$;

-- lifecycle_outbox_prune_dead_letters deletes up to p_limit deliveries of the caller's projects
-- that are resolved and older than p_retention on the caller's clock, or that belong to a
-- retired consumer, and returns how many.
CREATE FUNCTION lifecycle_outbox_prune_dead_letters(p_limit integer, p_offset interval, p_retention interval)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
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

DO $$
DECLARE
    r record;
BEGIN
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_prune(text, integer, bigint, interval, interval) '
                              'SET search_path = pg_catalog, %I, pg_temp', pg_catalog.current_schema());
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_prune_dead_letters(integer, interval, interval) '
                              'SET search_path = pg_catalog, %I, pg_temp', pg_catalog.current_schema());
    REVOKE EXECUTE ON FUNCTION lifecycle_outbox_prune(text, integer, bigint, interval, interval) FROM PUBLIC;
    REVOKE EXECUTE ON FUNCTION lifecycle_outbox_prune_dead_letters(integer, interval, interval) FROM PUBLIC;

    -- Whoever could prune (held DELETE on the outbox) prunes through the functions now.
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role_name
        FROM pg_catalog.pg_class c, pg_catalog.aclexplode(c.relacl) a
        WHERE c.oid = 'lifecycle_outbox'::regclass AND a.grantee OPERATOR(pg_catalog.<>) 0
          AND a.grantee OPERATOR(pg_catalog.<>) c.relowner AND a.privilege_type OPERATOR(pg_catalog.=) 'DELETE'
    LOOP
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION lifecycle_outbox_prune(text, integer, bigint, interval, interval) TO %s', r.role_name);
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION lifecycle_outbox_prune_dead_letters(integer, interval, interval) TO %s', r.role_name);
    END LOOP;

    -- A writer (a role that may read the outbox but neither number nor delete its rows) reads only
    -- the columns of its repeat: which deletion an event is, who wrote it, when, and its sequence.
    FOR r IN
        SELECT DISTINCT a.grantee::regrole::text AS role_name
        FROM pg_catalog.pg_class c, pg_catalog.aclexplode(c.relacl) a
        WHERE c.oid = 'lifecycle_outbox'::regclass AND a.grantee OPERATOR(pg_catalog.<>) 0
          AND a.grantee OPERATOR(pg_catalog.<>) c.relowner AND a.privilege_type OPERATOR(pg_catalog.=) 'SELECT'
          AND NOT pg_catalog.has_table_privilege(a.grantee, c.oid, 'DELETE')
          AND NOT pg_catalog.has_column_privilege(a.grantee, c.oid, 'sequence', 'UPDATE')
    LOOP
        EXECUTE pg_catalog.format('REVOKE SELECT ON lifecycle_outbox FROM %s', r.role_name);
        EXECUTE pg_catalog.format('GRANT SELECT (project_id, task_id, deleted_at, writer_process_id, occurred_at, sequence) '
                                  'ON lifecycle_outbox TO %s', r.role_name);
    END LOOP;

    -- No role but the owner holds a table-level privilege that lets it LOCK a module table in a
    -- mode that blocks other sessions.
    FOR r IN
        SELECT DISTINCT c.oid::regclass::text AS table_name, a.grantee::regrole::text AS role_name, a.privilege_type
        FROM pg_catalog.pg_class c, pg_catalog.aclexplode(c.relacl) a
        WHERE c.oid OPERATOR(pg_catalog.=) ANY (ARRAY['lifecycle_outbox'::regclass, 'lifecycle_outbox_pending'::regclass,
                'lifecycle_outbox_heads'::regclass, 'lifecycle_consumer_cursors'::regclass, 'lifecycle_consumer_deliveries'::regclass,
                'lifecycle_audit'::regclass, 'lifecycle_project_access'::regclass, 'lifecycle_consumer_access'::regclass])
          AND a.grantee OPERATOR(pg_catalog.<>) 0 AND a.grantee OPERATOR(pg_catalog.<>) c.relowner
          AND a.privilege_type OPERATOR(pg_catalog.=) ANY (ARRAY['UPDATE', 'DELETE', 'TRUNCATE'])
    LOOP
        EXECUTE pg_catalog.format('REVOKE %s ON %s FROM %s', r.privilege_type, r.table_name, r.role_name);
    END LOOP;

    -- Only the prune function moves the floor.
    FOR r IN
        SELECT DISTINCT t.attname::text AS column_name, a.grantee::regrole::text AS role_name
        FROM pg_catalog.pg_attribute t, pg_catalog.aclexplode(t.attacl) a
        WHERE t.attrelid OPERATOR(pg_catalog.=) 'lifecycle_outbox_heads'::regclass
          AND t.attname OPERATOR(pg_catalog.=) ANY (ARRAY['pruned_through', 'pruned_at']::name[])
          AND a.grantee OPERATOR(pg_catalog.<>) 0 AND a.privilege_type OPERATOR(pg_catalog.=) 'UPDATE'
    LOOP
        EXECUTE pg_catalog.format('REVOKE UPDATE (%I) ON lifecycle_outbox_heads FROM %s', r.column_name, r.role_name);
    END LOOP;
END;
$$;

-- An audit row is one of the module's four actions, each written only by the role that does it.
-- RESTRICTIVE, on top of the project and consumer scopes of 0003 and 0005.
CREATE POLICY lifecycle_audit_action_insert ON lifecycle_audit AS RESTRICTIVE FOR INSERT WITH CHECK (
    -- Retirement and reinstatement: by a role that may retire (may write retired_by), naming who.
    ((action OPERATOR(pg_catalog.=) 'lifecycle-observation:consumer-retired'
      OR action OPERATOR(pg_catalog.=) 'lifecycle-observation:consumer-reinstated')
     AND actor IS NOT NULL
     AND pg_catalog.has_column_privilege('lifecycle_consumer_cursors'::regclass, 'retired_by', 'UPDATE'))
    -- A poisoned event: the consumer's own dead letter at that sequence, naming no one.
    OR (action OPERATOR(pg_catalog.=) 'lifecycle-observation:consumer-poisoned'
        AND actor IS NULL AND reason IS NULL
        AND EXISTS (SELECT 1 FROM lifecycle_consumer_deliveries d
                    WHERE d.project_id OPERATOR(pg_catalog.=) lifecycle_audit.project_id
                      AND d.consumer_id OPERATOR(pg_catalog.=) lifecycle_audit.consumer_id
                      AND d.sequence OPERATOR(pg_catalog.=) lifecycle_audit.sequence
                      AND d.state OPERATOR(pg_catalog.=) 'dead'))
    -- A replay: of a delivery an operator asked to replay, naming at most that operator and reason.
    OR (action OPERATOR(pg_catalog.=) 'lifecycle-observation:consumer-replayed'
        AND EXISTS (SELECT 1 FROM lifecycle_consumer_deliveries d
                    WHERE d.project_id OPERATOR(pg_catalog.=) lifecycle_audit.project_id
                      AND d.consumer_id OPERATOR(pg_catalog.=) lifecycle_audit.consumer_id
                      AND d.sequence OPERATOR(pg_catalog.=) lifecycle_audit.sequence
                      AND (d.state OPERATOR(pg_catalog.=) 'replay_requested' OR d.state OPERATOR(pg_catalog.=) 'resolved')
                      AND d.replay_requested_at IS NOT NULL AND d.replay_requested_by IS NOT NULL
                      AND (lifecycle_audit.actor IS NULL OR lifecycle_audit.actor OPERATOR(pg_catalog.=) d.replay_requested_by)
                      AND (lifecycle_audit.reason IS NULL OR lifecycle_audit.reason OPERATOR(pg_catalog.=) d.replay_reason)))
);

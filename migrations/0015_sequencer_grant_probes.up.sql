-- The sequencer reads only the grants of the roles its caller acts as, and for a call that names
-- its projects only those projects' grants, so that a call costs the same however many grants
-- the database holds for other roles.
--
-- Each call of lifecycle_outbox_sequence (every scan of every consumer) and of
-- lifecycle_outbox_release_sequencer found the caller's grants by reading every row of
-- lifecycle_project_access, of every role, and asking for each whether the session's user is a
-- member of its role. Measured on the development machine (pgbench, two clients, the
-- two-argument form called for 16 projects with nothing to number, a database owned by a role
-- that is not a superuser, two runs each): with 18 grants in the database, 6,480 to 6,660 calls
-- a second for a role granted the 16 projects one by one and 6,910 to 7,090 for a role granted
-- '*'; with another role's 100,000 grants there too, 61 to 106 and 58 to 107. One tenant's
-- grants slowed every consumer of every other tenant. On this schema, the same runs: 5,740 to
-- 6,050 and 7,060 to 7,160 with 18 grants, 6,010 to 6,150 and 6,760 to 7,230 with 100,018.
--
-- Now the roles the session acts as are found first (one membership test per role of the
-- cluster, as before per grant), and their grants are read by the table's key: the '*' grant
-- first, one probe per role, which settles the call for a role granted every project whatever
-- the call's size; without it, for a call that names its projects, those projects' grants, a
-- probe each, and for a call of every project all of those roles' grants, which that call
-- needs. What a call may sequence, see and return is unchanged, including that a dropped
-- role's rows grant nothing.
--
-- Both functions are rewritten from their stored definitions, as 0013 did, and the rewrite
-- refuses a definition that does not hold each old text exactly once.
DO $$
DECLARE
    v_changes constant text[][] := ARRAY[
        ARRAY['lifecycle_outbox_sequence(text[], integer, text, interval, text, interval)',
              '
    v_look     boolean;
BEGIN',
              '
    v_look     boolean;
    v_roles    name[];  -- the roles the session acts as
BEGIN'],
        ARRAY['lifecycle_outbox_sequence(text[], integer, text, interval, text, interval)',
              '
    SELECT coalesce(pg_catalog.bool_or(a.project_id OPERATOR(pg_catalog.=) ''*''), false),
           coalesce(pg_catalog.jsonb_object_agg(a.project_id, true), ''{}'')
    INTO v_every, v_allowed
    FROM lifecycle_project_access a
    JOIN pg_catalog.pg_roles r ON r.rolname OPERATOR(pg_catalog.=) a.role_name -- a dropped role''s rows grant nothing
    WHERE pg_catalog.pg_has_role(SESSION_USER, r.oid, ''MEMBER'');',
              '
    -- The roles the session acts as (a dropped role''s rows grant nothing), then their grants
    -- by the key: ''*'' first, one probe per role; without it, every grant of those roles for
    -- a call of every project, else the grants of the call''s projects, a probe each.
    v_roles := ARRAY(SELECT r.rolname FROM pg_catalog.pg_roles r WHERE pg_catalog.pg_has_role(SESSION_USER, r.oid, ''MEMBER''));
    v_every := EXISTS (SELECT 1 FROM lifecycle_project_access a
                       WHERE a.role_name OPERATOR(pg_catalog.=) ANY (v_roles) AND a.project_id OPERATOR(pg_catalog.=) ''*'');
    v_allowed := ''{}'';
    IF v_every THEN
        NULL; -- every project: v_allowed is not consulted
    ELSIF p_projects IS NULL THEN
        SELECT coalesce(pg_catalog.jsonb_object_agg(a.project_id, true), ''{}'') INTO v_allowed
        FROM lifecycle_project_access a
        WHERE a.role_name OPERATOR(pg_catalog.=) ANY (v_roles);
    ELSE
        SELECT coalesce(pg_catalog.jsonb_object_agg(a.project_id, true), ''{}'') INTO v_allowed
        FROM lifecycle_project_access a
        WHERE a.role_name OPERATOR(pg_catalog.=) ANY (v_roles) AND a.project_id OPERATOR(pg_catalog.=) ANY (p_projects);
    END IF;'],
        ARRAY['lifecycle_outbox_release_sequencer(text)',
              '
    FROM lifecycle_project_access a
    JOIN pg_catalog.pg_roles r ON r.rolname OPERATOR(pg_catalog.=) a.role_name
    WHERE pg_catalog.pg_has_role(SESSION_USER, r.oid, ''MEMBER'');',
              '
    FROM lifecycle_project_access a
    WHERE a.role_name OPERATOR(pg_catalog.=) ANY (ARRAY(
        SELECT r.rolname FROM pg_catalog.pg_roles r WHERE pg_catalog.pg_has_role(SESSION_USER, r.oid, ''MEMBER'')));']];
    v_function text;
    v_def text;
    v_old text;
BEGIN
    FOR i IN 1 .. pg_catalog.array_length(v_changes, 1) LOOP
        IF v_function IS DISTINCT FROM v_changes[i][1] THEN
            IF v_def IS NOT NULL THEN
                EXECUTE v_def;
            END IF;
            v_function := v_changes[i][1];
            v_def := pg_catalog.pg_get_functiondef(v_function::pg_catalog.regprocedure);
        END IF;
        v_old := v_changes[i][2];
        IF (pg_catalog.length(v_def) OPERATOR(pg_catalog.-) pg_catalog.length(pg_catalog.replace(v_def, v_old, '')))
           OPERATOR(pg_catalog.<>) pg_catalog.length(v_old) THEN
            RAISE EXCEPTION '% is not the function of migrations 0008 to 0013: change % does not apply', v_function, i;
        END IF;
        v_def := pg_catalog.replace(v_def, v_old, v_changes[i][3]);
    END LOOP;
    EXECUTE v_def;
END;
$$;

-- Row-level security checks a row's grant by one index probe, so a statement's cost no longer
-- grows with how many projects (or consumers) its role is granted.
--
-- Each policy of 0003, 0005 and 0007 asked "project_id IN (SELECT the role's granted projects)".
-- That subquery does not depend on the row, so PostgreSQL builds a hash of every grant the role
-- holds once per statement and then looks each row up in it. For the writer hook's one-row
-- insert that build is the whole cost of the check, and it grows with the grants: on the
-- development machine (pgbench, 16 clients, the hook's own INSERT ... ON CONFLICT DO NOTHING
-- RETURNING as a writer role, asynchronous commit, two runs each) the insert ran at 19,500 to
-- 19,900 per second with 16 projects granted and at 810 to 850 with 10,016: every delete of a
-- host whose writer role is granted ten thousand projects one by one (as GrantWriterRole
-- does for a project-scoped role) paid for all ten thousand.
--
-- Now each policy asks two questions: is the role granted every project ('*'), which does not
-- depend on the row and is answered once per statement, and is the row's own project granted,
-- an index probe of (role_name, project_id). A statement over many rows may still have the
-- second answered by a hash of the grants, when the planner finds that cheaper for the rows it
-- expects; a one-row statement probes. Measured the same way: 18,800 to 20,400 inserts per
-- second with 16 projects granted, 18,600 to 20,300 with 10,016. The consumer policies of
-- 0005, which scope a cursor, delivery or audit row by its consumer, change the same way.
--
-- What each policy allows is unchanged: the same rows, the same grants. ALTER POLICY keeps each
-- policy's name, command, roles and permissive or restrictive kind.
DO $$
DECLARE
    t       text;
    project text;
    consumer text;
    -- Only a role that may write who asked for a replay may ask for one (0005).
    replay  constant text := $r$ AND (state OPERATOR(pg_catalog.<>) 'replay_requested'
        OR pg_catalog.has_column_privilege('lifecycle_consumer_deliveries'::regclass, 'replay_requested_by', 'UPDATE'))$r$;
BEGIN
    FOREACH t IN ARRAY ARRAY['lifecycle_outbox', 'lifecycle_outbox_heads', 'lifecycle_consumer_cursors',
                             'lifecycle_consumer_deliveries', 'lifecycle_audit', 'lifecycle_outbox_pending']
    LOOP
        project := pg_catalog.format($s$(EXISTS (SELECT 1 FROM lifecycle_project_access a
                        WHERE a.role_name OPERATOR(pg_catalog.=) CURRENT_USER AND a.project_id OPERATOR(pg_catalog.=) '*')
                OR EXISTS (SELECT 1 FROM lifecycle_project_access a
                        WHERE a.role_name OPERATOR(pg_catalog.=) CURRENT_USER AND a.project_id OPERATOR(pg_catalog.=) %I.project_id::text))$s$, t);
        EXECUTE pg_catalog.format('ALTER POLICY %I ON %I USING %s WITH CHECK %s', t || '_project_scope', t, project, project);
    END LOOP;

    FOREACH t IN ARRAY ARRAY['lifecycle_consumer_cursors', 'lifecycle_consumer_deliveries', 'lifecycle_audit']
    LOOP
        consumer := pg_catalog.format($s$(EXISTS (SELECT 1 FROM lifecycle_consumer_access a
                        WHERE a.role_name OPERATOR(pg_catalog.=) CURRENT_USER AND a.consumer_id OPERATOR(pg_catalog.=) '*')
                OR EXISTS (SELECT 1 FROM lifecycle_consumer_access a
                        WHERE a.role_name OPERATOR(pg_catalog.=) CURRENT_USER AND a.consumer_id OPERATOR(pg_catalog.=) %I.consumer_id::text))$s$, t);
        IF t OPERATOR(pg_catalog.=) 'lifecycle_audit' THEN
            -- Audit rows name the consumer they are about: a role writes them only for its consumers.
            EXECUTE pg_catalog.format('ALTER POLICY lifecycle_audit_consumer_insert ON lifecycle_audit WITH CHECK (consumer_id IS NOT NULL AND %s)', consumer);
            CONTINUE;
        END IF;
        EXECUTE pg_catalog.format('ALTER POLICY %I ON %I WITH CHECK (%s%s)', t || '_consumer_insert', t, consumer,
                                  CASE WHEN t OPERATOR(pg_catalog.=) 'lifecycle_consumer_deliveries' THEN replay ELSE '' END);
        EXECUTE pg_catalog.format('ALTER POLICY %I ON %I USING %s WITH CHECK (%s%s)', t || '_consumer_update', t, consumer, consumer,
                                  CASE WHEN t OPERATOR(pg_catalog.=) 'lifecycle_consumer_deliveries' THEN replay ELSE '' END);
        EXECUTE pg_catalog.format('ALTER POLICY %I ON %I USING %s', t || '_consumer_delete', t, consumer);
    END LOOP;
END;
$$;

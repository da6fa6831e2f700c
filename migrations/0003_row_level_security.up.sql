-- Row-level security scoped by project.
--
-- A role sees and writes the rows of the projects granted to it in lifecycle_project_access
-- ('*' grants every project). The grant is keyed on the role itself, not on a session setting
-- that the role could change, and it lets one process observe many projects in one statement.
-- FORCE makes the table owner obey the policies too; superusers and BYPASSRLS roles do not.

CREATE TABLE lifecycle_project_access (
    role_name  name NOT NULL,
    project_id text NOT NULL CHECK (project_id = '*' OR project_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$'),
    PRIMARY KEY (role_name, project_id)
);

ALTER TABLE lifecycle_project_access ENABLE ROW LEVEL SECURITY;
-- A role may read its own grants and nothing else; only the owner writes them.
CREATE POLICY lifecycle_project_access_own ON lifecycle_project_access
    FOR SELECT USING (role_name = current_user);

-- The role that migrates keeps access to every project.
INSERT INTO lifecycle_project_access (role_name, project_id) VALUES (current_user, '*');

DO $$
DECLARE
    t text;
BEGIN
    FOREACH t IN ARRAY ARRAY['lifecycle_outbox', 'lifecycle_outbox_heads', 'lifecycle_consumer_cursors',
                             'lifecycle_consumer_deliveries', 'lifecycle_audit']
    LOOP
        EXECUTE format('ALTER TABLE %I ENABLE ROW LEVEL SECURITY', t);
        EXECUTE format('ALTER TABLE %I FORCE ROW LEVEL SECURITY', t);
        EXECUTE format($p$
            CREATE POLICY %I ON %I
            USING (project_id IN (SELECT a.project_id FROM lifecycle_project_access a WHERE a.role_name = current_user)
                   OR EXISTS (SELECT 1 FROM lifecycle_project_access a WHERE a.role_name = current_user AND a.project_id = '*'))
            WITH CHECK (project_id IN (SELECT a.project_id FROM lifecycle_project_access a WHERE a.role_name = current_user)
                   OR EXISTS (SELECT 1 FROM lifecycle_project_access a WHERE a.role_name = current_user AND a.project_id = '*'))
        $p$, t || '_project_scope', t);
    END LOOP;
END;
$$;

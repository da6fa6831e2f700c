-- The reference host's own tables. They stand in for an existing task store: the outbox
-- module never creates or alters them.

CREATE TABLE tasks (
    project_id  text        NOT NULL,
    id          text        NOT NULL,
    title       text        NOT NULL DEFAULT '',
    "column"    text        NOT NULL DEFAULT 'todo',
    archived    boolean     NOT NULL DEFAULT false,
    archived_at timestamptz,
    deleted_at  timestamptz,
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (project_id, id)
);

-- Live tasks of a project: what a cache loads and what reconciliation reads.
CREATE INDEX tasks_live ON tasks (project_id, id) WHERE deleted_at IS NULL;

CREATE TABLE run_audit (
    id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    project_id text        NOT NULL,
    task_id    text,
    action     text        NOT NULL,
    actor      text        NOT NULL,
    metadata   jsonb       NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX run_audit_project ON run_audit (project_id, id);

-- Operator mailbox notices: best-effort prose written by the deleting process after commit.
CREATE TABLE mailbox_notices (
    id         bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    project_id text        NOT NULL,
    task_id    text        NOT NULL,
    kind       text        NOT NULL,
    body       text        NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- Persisted settings; outbox.consumer_id lives here in an observing process's deployment.
CREATE TABLE settings (
    scope      text        NOT NULL DEFAULT '',
    key        text        NOT NULL,
    value      text        NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (scope, key)
);

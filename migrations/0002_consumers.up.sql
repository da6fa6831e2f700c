-- Per-consumer durable state: cursors with fenced leases, delivery attempts and dead letters,
-- and the module's own audit table for hosts that bring no audit sink.

CREATE TABLE lifecycle_consumer_cursors (
    project_id          text        NOT NULL CHECK (project_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$'),
    consumer_id         text        NOT NULL CHECK (consumer_id ~ '^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$'),
    -- NULL: never positioned, the consumer reconciles before it reads.
    last_acked_sequence bigint      CHECK (last_acked_sequence >= 0),
    acked_at            timestamptz,
    -- The lease: the process instance holding it, a fencing epoch bumped on every acquisition,
    -- and an expiry judged by the database clock.
    lease_owner         text        CHECK (length(lease_owner) <= 128),
    lease_epoch         bigint      NOT NULL DEFAULT 0 CHECK (lease_epoch >= 0),
    lease_expires_at    timestamptz,
    heartbeat_at        timestamptz,
    reconciled_at       timestamptz,
    reconcile_reason    text        CHECK (reconcile_reason IN ('missing_cursor', 'cursor_ahead_of_head', 'cursor_below_pruned_floor')),
    -- Retirement is explicit and audited; a missed heartbeat never sets it.
    retired_at          timestamptz,
    retired_by          text        CHECK (length(retired_by) <= 128),
    retired_reason      text        CHECK (length(retired_reason) <= 128),
    created_at          timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (project_id, consumer_id),
    CHECK ((retired_at IS NULL) = (retired_by IS NULL))
);

CREATE INDEX lifecycle_consumer_cursors_consumer ON lifecycle_consumer_cursors (consumer_id, project_id);

CREATE TABLE lifecycle_consumer_deliveries (
    project_id          text        NOT NULL,
    consumer_id         text        NOT NULL,
    sequence            bigint      NOT NULL CHECK (sequence > 0),
    event_id            text        NOT NULL,
    state               text        NOT NULL CHECK (state IN ('retrying', 'dead', 'replay_requested', 'resolved')),
    attempts            integer     NOT NULL CHECK (attempts >= 0),
    next_attempt_at     timestamptz,
    last_failure_class  text        CHECK (last_failure_class IN ('listener_error', 'listener_panic', 'listener_timeout', 'cache_error', 'unsupported_event')),
    first_failed_at     timestamptz,
    last_failed_at      timestamptz,
    parked_at           timestamptz,
    replay_requested_at timestamptz,
    replay_requested_by text        CHECK (length(replay_requested_by) <= 128),
    replay_reason       text        CHECK (length(replay_reason) <= 128),
    resolved_at         timestamptz,
    PRIMARY KEY (project_id, consumer_id, sequence),
    FOREIGN KEY (project_id, consumer_id) REFERENCES lifecycle_consumer_cursors (project_id, consumer_id),
    CHECK (state <> 'retrying' OR next_attempt_at IS NOT NULL),
    CHECK (state <> 'dead' OR parked_at IS NOT NULL),
    CHECK (state <> 'resolved' OR resolved_at IS NOT NULL)
);

-- Work a consumer must look at on every poll: its head-of-line retry and replay requests.
CREATE INDEX lifecycle_consumer_deliveries_open
    ON lifecycle_consumer_deliveries (consumer_id, project_id, sequence)
    WHERE state IN ('retrying', 'replay_requested');

-- Used when the host brings no audit sink. Identifiers and counts only, never free text.
CREATE TABLE lifecycle_audit (
    id          bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    project_id  text        NOT NULL,
    action      text        NOT NULL CHECK (action ~ '^lifecycle-observation:[a-z-]+$'),
    consumer_id text,
    event_id    text,
    sequence    bigint,
    attempts    integer,
    actor       text        CHECK (length(actor) <= 128),
    reason      text        CHECK (length(reason) <= 128),
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE INDEX lifecycle_audit_project ON lifecycle_audit (project_id, id);

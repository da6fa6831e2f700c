-- The sequencer's cost grows with the projects of a call, not with their square, and its move
-- keeps one plan.
--
-- Two measurements on the function of 0009 (one session, this project's machine):
-- - A call for 5,000 projects with one pending row each took 8.4 to 8.8s. The function
--   matched projects by joining arrays (the locked projects with what the move numbered, the
--   moved rows with their project's base) and by "= ANY (array)" and "<> ALL (array)"
--   filters; with hash and merge joins off, each is a nested loop over both, 25 million steps
--   at 5,000 projects. The assigned-count join alone took 3.7s and the move 2.8s. Now: 0.40
--   to 0.47s.
-- - A call for one project with one pending row took 1.35 to 1.87ms, and the move was planned
--   again on every call (0.35ms of planning against 0.13ms of execution): with plan_cache_mode
--   auto, one project's custom plan always looks cheaper than the generic one. Now: 0.97 to
--   1.04ms.
--
-- Now a project's base, the projects grants allow, the locked projects and the projects to
-- announce are jsonb objects keyed by project, and each statement looks a project up in them
-- (a binary search) or reaches heads by index with "= ANY"; no statement joins two lists. The
-- move deletes its batch by row address (a TID scan, whatever the statistics say) and numbers
-- each row from its project's base in the jsonb object, so it has one plan shape, and keeps
-- one generic plan per session like the function's other statements. Bitmap scans are off
-- too: a generic plan built while the pending table looked empty could otherwise take a
-- project's batch by a bitmap scan and a sort of every pending row of the project, which
-- would make each call of a drain cost the whole remaining backlog.

CREATE OR REPLACE FUNCTION lifecycle_outbox_sequence(p_projects text[], p_limit integer, p_sequencer text,
                                          p_hold interval, p_channel text, p_gap interval)
RETURNS TABLE (project_id text, last_sequence bigint, pruned_through bigint, assigned integer, held_ms integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET enable_hashjoin = off
SET enable_mergejoin = off
SET lock_timeout = '1s'
-- Every statement reaches rows by index, in one plan shape whatever the statistics were when
-- its plan was made (see above).
SET enable_seqscan = off
SET enable_bitmapscan = off
-- With seq scans disabled, a plan that keeps one anyway costs 1e10 and would be compiled by JIT
-- on every execution (about a second each, measured on the heads read with generic plans).
SET jit = off
-- One generic plan per statement and session: with custom plans the server planned most
-- statements again on every call.
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_every    boolean;
    v_allowed  jsonb;   -- the projects granted, as keys
    v_projects text[];
    v_project  text;
    v_last     bigint;
    v_count    integer;
    v_max      bigint;
    v_assigned jsonb := '{}';
    v_skip     boolean;
    v_locked   text[];
    v_base     jsonb;   -- each locked project's last sequence, moved on as rows are numbered
    v_legacy   jsonb := '{}';
    v_legacy_projects text[];
    v_i        integer;
    v_moved_counts jsonb;
    v_moved_max    jsonb;
    v_announce text[];
    v_announce_set jsonb;
    v_return   text[];
    v_look     boolean;
BEGIN
    IF pg_catalog.current_setting('transaction_isolation') OPERATOR(pg_catalog.<>) 'read committed' THEN
        RAISE EXCEPTION 'lifecycle_outbox_sequence must run at READ COMMITTED, not %',
            pg_catalog.current_setting('transaction_isolation') USING ERRCODE = '25000';
    END IF;
    IF p_limit IS NULL OR p_limit OPERATOR(pg_catalog.=) 0 THEN
        RAISE EXCEPTION 'p_limit must not be 0' USING ERRCODE = '22023';
    END IF;
    IF p_sequencer IS NOT NULL AND NOT (p_sequencer OPERATOR(pg_catalog.~) '^[A-Za-z0-9][A-Za-z0-9._:-]*@[0-9a-f]{16}$'
                                        AND pg_catalog.octet_length(p_sequencer) OPERATOR(pg_catalog.<=) 145) THEN
        RAISE EXCEPTION 'p_sequencer must be a consumer instance, <consumer>@<16 hex digits>' USING ERRCODE = '22023';
    END IF;
    IF p_sequencer IS NOT NULL AND (p_hold IS NULL OR p_hold OPERATOR(pg_catalog.<=) '0'::interval
                                    OR p_hold OPERATOR(pg_catalog.>) '1 hour'::interval) THEN
        RAISE EXCEPTION 'p_hold must be above 0 and at most an hour' USING ERRCODE = '22023';
    END IF;
    IF p_channel IS NOT NULL AND (p_channel OPERATOR(pg_catalog.!~) '^[a-z_][a-z0-9_]{0,62}$'
                                  OR p_gap IS NULL OR p_gap OPERATOR(pg_catalog.<) '0'::interval) THEN
        RAISE EXCEPTION 'p_channel must be a lower-case identifier and p_gap at least 0' USING ERRCODE = '22023';
    END IF;
    v_skip := p_limit OPERATOR(pg_catalog.<) 0;
    p_limit := pg_catalog.abs(p_limit);

    SELECT coalesce(pg_catalog.bool_or(a.project_id OPERATOR(pg_catalog.=) '*'), false),
           coalesce(pg_catalog.jsonb_object_agg(a.project_id, true), '{}')
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
        WHERE v_every OR v_allowed OPERATOR(pg_catalog.?) x.p;
    ELSE
        SELECT pg_catalog.array_agg(DISTINCT x.p ORDER BY x.p) INTO v_projects
        FROM pg_catalog.unnest(p_projects) AS x(p)
        WHERE (v_every OR v_allowed OPERATOR(pg_catalog.?) x.p)
          AND (EXISTS (SELECT 1 FROM lifecycle_outbox_pending q WHERE q.project_id::text OPERATOR(pg_catalog.=) x.p)
               OR EXISTS (SELECT 1 FROM lifecycle_outbox o WHERE o.project_id OPERATOR(pg_catalog.=) x.p AND o.sequence IS NULL));
    END IF;

    -- Projects another live sequencer holds are left to it (-2): it numbers them and wakes us.
    IF p_sequencer IS NOT NULL THEN
        SELECT coalesce(pg_catalog.jsonb_object_agg(h.project_id, -2), '{}') INTO v_assigned
        FROM lifecycle_outbox_heads h
        WHERE h.project_id OPERATOR(pg_catalog.=) ANY (v_projects)
          AND h.sequencer_owner OPERATOR(pg_catalog.<>) p_sequencer AND h.sequencer_until OPERATOR(pg_catalog.>) pg_catalog.now();
        SELECT pg_catalog.array_agg(x.p ORDER BY x.p) INTO v_projects
        FROM pg_catalog.unnest(v_projects) AS x(p) WHERE NOT v_assigned OPERATOR(pg_catalog.?) x.p;
    END IF;

    -- Nothing to number (the common case of a consumer caught up): only the heads are read.
    IF pg_catalog.cardinality(v_projects) OPERATOR(pg_catalog.>) 0 THEN
        -- The heads rows of projects numbered for the first time. Only those: an insert that
        -- meets an existing row another sequencer is updating would wait for it.
        INSERT INTO lifecycle_outbox_heads AS h (project_id)
        SELECT x.p FROM pg_catalog.unnest(v_projects) AS x(p)
        WHERE NOT EXISTS (SELECT 1 FROM lifecycle_outbox_heads h WHERE h.project_id OPERATOR(pg_catalog.=) x.p)
        ON CONFLICT (project_id) DO NOTHING;

        -- Lock the heads rows in project order, so that two sequencers cannot deadlock; with v_skip
        -- the rows another sequencer holds are left out and those projects reported busy. A hold
        -- another instance took since the check above is seen here, on the locked row's latest
        -- version, and its project is left out too.
        IF v_skip THEN
            SELECT pg_catalog.array_agg(l.project_id ORDER BY l.project_id), pg_catalog.jsonb_object_agg(l.project_id, l.last_sequence)
            INTO v_locked, v_base
            FROM (SELECT h.project_id, h.last_sequence FROM lifecycle_outbox_heads h
                  WHERE h.project_id OPERATOR(pg_catalog.=) ANY (v_projects)
                    AND (p_sequencer IS NULL OR h.sequencer_owner IS NULL OR h.sequencer_owner OPERATOR(pg_catalog.=) p_sequencer
                         OR h.sequencer_until IS NULL OR h.sequencer_until OPERATOR(pg_catalog.<=) pg_catalog.now())
                  ORDER BY h.project_id FOR UPDATE SKIP LOCKED) AS l;
        ELSE
            SELECT pg_catalog.array_agg(l.project_id ORDER BY l.project_id), pg_catalog.jsonb_object_agg(l.project_id, l.last_sequence)
            INTO v_locked, v_base
            FROM (SELECT h.project_id, h.last_sequence FROM lifecycle_outbox_heads h
                  WHERE h.project_id OPERATOR(pg_catalog.=) ANY (v_projects)
                    AND (p_sequencer IS NULL OR h.sequencer_owner IS NULL OR h.sequencer_owner OPERATOR(pg_catalog.=) p_sequencer
                         OR h.sequencer_until IS NULL OR h.sequencer_until OPERATOR(pg_catalog.<=) pg_catalog.now())
                  ORDER BY h.project_id FOR UPDATE) AS l;
        END IF;
        v_locked := coalesce(v_locked, '{}');
        v_base := coalesce(v_base, '{}');
        -- Busy (-1): wanted, and locked by another sequencer.
        SELECT v_assigned OPERATOR(pg_catalog.||) coalesce(pg_catalog.jsonb_object_agg(x.p, -1), '{}') INTO v_assigned
        FROM pg_catalog.unnest(v_projects) AS x(p) WHERE NOT v_base OPERATOR(pg_catalog.?) x.p;

        -- Legacy rows first (rare: a writer of schema 6 during a rolling deploy), one project at a
        -- time, moving that project's base; what they take is left out of its move's room. The
        -- projects that have any are found in one statement: each statement run from here costs
        -- its executor's set-up, about as much as a probe of the legacy index.
        SELECT pg_catalog.array_agg(x.p ORDER BY x.p) INTO v_legacy_projects
        FROM pg_catalog.unnest(v_locked) AS x(p)
        WHERE EXISTS (SELECT 1 FROM lifecycle_outbox o WHERE o.project_id OPERATOR(pg_catalog.=) x.p AND o.sequence IS NULL);
        FOR v_i IN 1 .. coalesce(pg_catalog.cardinality(v_legacy_projects), 0) LOOP
            v_project := v_legacy_projects[v_i];
            v_last := (v_base OPERATOR(pg_catalog.->>) v_project)::bigint;
            WITH legacy AS (
                SELECT o.ctid AS row_id, pg_catalog.row_number() OVER (ORDER BY o.occurred_at) AS rn
                FROM lifecycle_outbox o
                WHERE o.project_id OPERATOR(pg_catalog.=) v_project AND o.sequence IS NULL
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
                    v_project, v_last, v_max, v_count USING ERRCODE = 'XX000';
            END IF;
            v_base := v_base OPERATOR(pg_catalog.||) pg_catalog.jsonb_build_object(v_project, v_max);
            v_legacy := v_legacy OPERATOR(pg_catalog.||) pg_catalog.jsonb_build_object(v_project, v_count);
        END LOOP;

        -- Every locked project's pending batch in one statement: taken in key order (a task's
        -- deletions in their order), numbered from the project's base by occurred_at within the
        -- batch, moved into the stream. The stream's key refuses a pending row whose identity it
        -- holds already; then the batch moves again (v_look), dropping such rows. The first try
        -- does not look for them: that look-up costs as much as the key's own check.
        v_look := false;
        LOOP
            BEGIN
                WITH batch AS (
                    SELECT b.row_id
                    FROM pg_catalog.unnest(v_locked) AS l(project_id)
                    CROSS JOIN LATERAL (
                        SELECT q.ctid AS row_id
                        FROM lifecycle_outbox_pending q
                        WHERE q.project_id::text OPERATOR(pg_catalog.=) l.project_id
                        ORDER BY q.project_id, q.task_id, q.deleted_at
                        LIMIT p_limit OPERATOR(pg_catalog.-) coalesce((v_legacy OPERATOR(pg_catalog.->>) l.project_id)::integer, 0)) AS b
                ), moved AS (
                    DELETE FROM lifecycle_outbox_pending q
                    WHERE q.ctid OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT batch.row_id FROM batch))
                    RETURNING q.*
                ), fresh AS (
                    SELECT m.*, pg_catalog.row_number() OVER (PARTITION BY m.project_id ORDER BY m.occurred_at, m.task_id, m.deleted_at) AS rn
                    FROM moved m
                    WHERE NOT v_look OR NOT EXISTS (
                        SELECT 1 FROM lifecycle_outbox o
                        WHERE o.project_id OPERATOR(pg_catalog.=) m.project_id::text AND o.task_id OPERATOR(pg_catalog.=) m.task_id::text
                          AND o.deleted_at OPERATOR(pg_catalog.=) m.deleted_at::timestamptz)
                ), numbered AS (
                    INSERT INTO lifecycle_outbox
                        (project_id, task_id, deleted_at, sequence, event_type, archived, payload_version, occurred_at,
                         writer_process_id, prior_column, trace_context)
                    SELECT f.project_id, f.task_id, f.deleted_at,
                           (v_base OPERATOR(pg_catalog.->>) f.project_id::text)::bigint OPERATOR(pg_catalog.+) f.rn,
                           f.event_type, f.archived, f.payload_version, f.occurred_at, f.writer_process_id, f.prior_column, f.trace_context
                    FROM fresh f
                    RETURNING lifecycle_outbox.project_id, lifecycle_outbox.sequence
                )
                SELECT pg_catalog.jsonb_object_agg(r.project_id, r.n), pg_catalog.jsonb_object_agg(r.project_id, r.top)
                INTO v_moved_counts, v_moved_max
                FROM (SELECT numbered.project_id, pg_catalog.count(*)::integer AS n, pg_catalog.max(numbered.sequence) AS top
                      FROM numbered GROUP BY numbered.project_id) AS r;
                EXIT;
            EXCEPTION WHEN unique_violation THEN
                -- Some pending row's identity is in the stream already (an event written
                -- twice). A second refusal is not that, and goes to the caller.
                IF v_look THEN
                    RAISE;
                END IF;
                v_look := true;
            END;
        END LOOP;
        v_moved_counts := coalesce(v_moved_counts, '{}');
        v_moved_max := coalesce(v_moved_max, '{}');

        -- Only a sequencer holding the heads lock numbers rows, so nothing can be skipped here;
        -- if it ever were, a gap would follow, and a gap must never commit.
        SELECT c.key INTO v_project
        FROM pg_catalog.jsonb_each_text(v_moved_counts) AS c(key, value)
        WHERE (v_moved_max OPERATOR(pg_catalog.->>) c.key)::bigint OPERATOR(pg_catalog.-) (v_base OPERATOR(pg_catalog.->>) c.key)::bigint
              OPERATOR(pg_catalog.<>) c.value::bigint
        LIMIT 1;
        IF FOUND THEN
            RAISE EXCEPTION 'sequencer for project % would leave a gap (last %, max %, count %)',
                v_project, v_base OPERATOR(pg_catalog.->>) v_project, v_moved_max OPERATOR(pg_catalog.->>) v_project,
                v_moved_counts OPERATOR(pg_catalog.->>) v_project USING ERRCODE = 'XX000';
        END IF;
        v_base := v_base OPERATOR(pg_catalog.||) v_moved_max;

        -- What each locked project was assigned: nothing, what the move numbered, and what the
        -- legacy numbering took.
        SELECT v_assigned OPERATOR(pg_catalog.||) coalesce(pg_catalog.jsonb_object_agg(l.p, 0), '{}') OPERATOR(pg_catalog.||) v_moved_counts
        INTO v_assigned
        FROM pg_catalog.unnest(v_locked) AS l(p);
        IF v_legacy OPERATOR(pg_catalog.<>) '{}' THEN
            SELECT v_assigned OPERATOR(pg_catalog.||) pg_catalog.jsonb_object_agg(g.key,
                       g.value::integer OPERATOR(pg_catalog.+) coalesce((v_moved_counts OPERATOR(pg_catalog.->>) g.key)::integer, 0))
            INTO v_assigned
            FROM pg_catalog.jsonb_each_text(v_legacy) AS g(key, value);
        END IF;

        -- The projects to announce: numbered now, and not announced within p_gap.
        IF p_channel IS NOT NULL THEN
            SELECT pg_catalog.array_agg(h.project_id ORDER BY h.project_id), pg_catalog.jsonb_object_agg(h.project_id, true)
            INTO v_announce, v_announce_set
            FROM lifecycle_outbox_heads h
            WHERE h.project_id OPERATOR(pg_catalog.=) ANY (v_locked)
              AND coalesce((v_assigned OPERATOR(pg_catalog.->>) h.project_id)::integer, 0) OPERATOR(pg_catalog.>) 0
              AND (h.notified_at IS NULL OR h.notified_at OPERATOR(pg_catalog.<=) (pg_catalog.now() OPERATOR(pg_catalog.-) p_gap));
        END IF;
        v_announce_set := coalesce(v_announce_set, '{}');

        -- Move the heads of the projects that got numbers; the caller takes or renews its hold on
        -- each (only by numbering: a call that found nothing left to move takes no hold), and notes
        -- the announcements.
        UPDATE lifecycle_outbox_heads h
        SET last_sequence = (v_base OPERATOR(pg_catalog.->>) h.project_id)::bigint, sequenced_at = pg_catalog.now(),
            sequencer_owner = coalesce(p_sequencer, h.sequencer_owner),
            sequencer_until = CASE WHEN p_sequencer IS NULL THEN h.sequencer_until ELSE pg_catalog.now() OPERATOR(pg_catalog.+) p_hold END,
            notified_at = CASE WHEN v_announce_set OPERATOR(pg_catalog.?) h.project_id THEN pg_catalog.now() ELSE h.notified_at END
        WHERE h.project_id OPERATOR(pg_catalog.=) ANY (v_locked)
          AND h.last_sequence OPERATOR(pg_catalog.<>) (v_base OPERATOR(pg_catalog.->>) h.project_id)::bigint;
        PERFORM pg_catalog.pg_notify(p_channel, x.p) FROM pg_catalog.unnest(v_announce) AS x(p);
    END IF;

    -- The heads to return: the requested projects', every project's for NULL. An array rather
    -- than "p_projects IS NULL OR ...", so that a generic plan of it reads by index.
    IF p_projects IS NULL THEN
        SELECT pg_catalog.array_agg(h.project_id) INTO v_return FROM lifecycle_outbox_heads h;
    ELSE
        v_return := p_projects;
    END IF;
    RETURN QUERY
        SELECT h.project_id, h.last_sequence, h.pruned_through,
               coalesce((v_assigned OPERATOR(pg_catalog.->>) h.project_id)::integer, 0),
               CASE WHEN p_sequencer IS NOT NULL AND h.sequencer_owner OPERATOR(pg_catalog.<>) p_sequencer
                         AND h.sequencer_until OPERATOR(pg_catalog.>) pg_catalog.now()
                    THEN LEAST(3600000::double precision, pg_catalog.ceil(pg_catalog.date_part('epoch', h.sequencer_until OPERATOR(pg_catalog.-) pg_catalog.now())
                                                                   OPERATOR(pg_catalog.*) 1000))::integer
                    ELSE 0 END
        FROM lifecycle_outbox_heads h
        WHERE h.project_id OPERATOR(pg_catalog.=) ANY (v_return)
          AND (v_every OR v_allowed OPERATOR(pg_catalog.?) h.project_id);
END;
$$;

-- CREATE OR REPLACE keeps the owner and the grants but not the settings set apart from the
-- definition: the search path goes back on, as 0008 set it.
DO $$
BEGIN
    EXECUTE pg_catalog.format('ALTER FUNCTION lifecycle_outbox_sequence(text[], integer, text, interval, text, interval) '
                              'SET search_path = pg_catalog, %I, pg_temp', pg_catalog.current_schema());
END;
$$;

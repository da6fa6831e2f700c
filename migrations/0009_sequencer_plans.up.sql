-- The sequencer spends less per call and per moved row.
--
-- Two measurements on the function of 0008 (pg_stat_statements with track_planning, one
-- session calling it for 14 new rows at a time, 200 calls): the server planned eight of its
-- small statements again on every call, 1.3ms of planning in a call of 2.5ms, because their
-- custom plans always looked cheaper than a generic one. And in a move of 10,000 rows
-- (EXPLAIN ANALYZE), the anti-join that drops rows already in the stream probed the stream's
-- key once per row, 38ms of 250ms, only for the insert to probe the same key again.
--
-- Now the small statements keep one generic plan per session, the move alone is planned per
-- call, and the move inserts without the anti-join first: a row already in the stream (which
-- only a writer that wrote an event twice can cause) makes the key refuse the batch, and the
-- batch moves again with the anti-join, inside the same call.

CREATE OR REPLACE FUNCTION lifecycle_outbox_sequence(p_projects text[], p_limit integer, p_sequencer text,
                                          p_hold interval, p_channel text, p_gap interval)
RETURNS TABLE (project_id text, last_sequence bigint, pruned_through bigint, assigned integer, held_ms integer)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET enable_hashjoin = off
SET enable_mergejoin = off
SET lock_timeout = '1s'
-- Every statement reaches rows by index. A plan chosen while a table was small (a seq scan and
-- sort of the pending table for each batch, say) could otherwise be kept by the plan cache as
-- the table grows, and turn the move of a backlog quadratic.
SET enable_seqscan = off
-- With seq scans disabled, a plan that keeps one anyway costs 1e10 and would be compiled by JIT
-- on every execution (about a second each, measured on the heads read with generic plans).
SET jit = off
-- The small statements keep one generic plan per session: each reaches the heads or the
-- pending key by index whatever its arguments, and with custom plans the server planned most of
-- them again on every call. The move alone is planned for its arguments (plan_cache_mode auto
-- around it): a generic move built before the first ANALYZE of a fresh backlog moved 10,000
-- rows in 8s a call instead of 0.15s.
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    v_every    boolean;
    v_allowed  text[];
    v_projects text[];
    v_project  text;
    v_last     bigint;
    v_count    integer;
    v_max      bigint;
    v_assigned jsonb := '{}';
    v_skip     boolean;
    v_locked   text[];
    v_base     bigint[];
    v_room     integer[];
    v_legacy   jsonb := '{}';
    v_i        integer;
    v_moved_projects text[];
    v_moved_counts   integer[];
    v_moved_max      bigint[];
    v_announce text[];
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

    SELECT coalesce(pg_catalog.bool_or(a.project_id OPERATOR(pg_catalog.=) '*'), false), pg_catalog.array_agg(a.project_id)
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
        WHERE v_every OR x.p OPERATOR(pg_catalog.=) ANY (v_allowed);
    ELSE
        SELECT pg_catalog.array_agg(DISTINCT x.p ORDER BY x.p) INTO v_projects
        FROM pg_catalog.unnest(p_projects) AS x(p)
        WHERE (v_every OR x.p OPERATOR(pg_catalog.=) ANY (v_allowed))
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
            SELECT pg_catalog.array_agg(l.project_id ORDER BY l.project_id), pg_catalog.array_agg(l.last_sequence ORDER BY l.project_id)
            INTO v_locked, v_base
            FROM (SELECT h.project_id, h.last_sequence FROM lifecycle_outbox_heads h
                  WHERE h.project_id OPERATOR(pg_catalog.=) ANY (v_projects)
                    AND (p_sequencer IS NULL OR h.sequencer_owner IS NULL OR h.sequencer_owner OPERATOR(pg_catalog.=) p_sequencer
                         OR h.sequencer_until IS NULL OR h.sequencer_until OPERATOR(pg_catalog.<=) pg_catalog.now())
                  ORDER BY h.project_id FOR UPDATE SKIP LOCKED) AS l;
        ELSE
            SELECT pg_catalog.array_agg(l.project_id ORDER BY l.project_id), pg_catalog.array_agg(l.last_sequence ORDER BY l.project_id)
            INTO v_locked, v_base
            FROM (SELECT h.project_id, h.last_sequence FROM lifecycle_outbox_heads h
                  WHERE h.project_id OPERATOR(pg_catalog.=) ANY (v_projects)
                    AND (p_sequencer IS NULL OR h.sequencer_owner IS NULL OR h.sequencer_owner OPERATOR(pg_catalog.=) p_sequencer
                         OR h.sequencer_until IS NULL OR h.sequencer_until OPERATOR(pg_catalog.<=) pg_catalog.now())
                  ORDER BY h.project_id FOR UPDATE) AS l;
        END IF;
        v_locked := coalesce(v_locked, '{}');
        v_base := coalesce(v_base, '{}');
        SELECT v_assigned OPERATOR(pg_catalog.||) coalesce(pg_catalog.jsonb_object_agg(x.p, -1), '{}') INTO v_assigned
        FROM pg_catalog.unnest(v_projects) AS x(p) WHERE x.p OPERATOR(pg_catalog.<>) ALL (v_locked);
        v_room := pg_catalog.array_fill(p_limit, ARRAY[pg_catalog.cardinality(v_locked)]);

        -- Legacy rows first (rare: a writer of schema 6 during a rolling deploy), one project at a
        -- time, moving that project's base and room.
        FOR v_i IN 1 .. pg_catalog.cardinality(v_locked) LOOP
            CONTINUE WHEN NOT EXISTS (SELECT 1 FROM lifecycle_outbox o WHERE o.project_id OPERATOR(pg_catalog.=) v_locked[v_i] AND o.sequence IS NULL);
            v_last := v_base[v_i];
            WITH legacy AS (
                SELECT o.ctid AS row_id, pg_catalog.row_number() OVER (ORDER BY o.occurred_at) AS rn
                FROM lifecycle_outbox o
                WHERE o.project_id OPERATOR(pg_catalog.=) v_locked[v_i] AND o.sequence IS NULL
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
                    v_locked[v_i], v_last, v_max, v_count USING ERRCODE = 'XX000';
            END IF;
            v_base[v_i] := v_max;
            v_room[v_i] := p_limit OPERATOR(pg_catalog.-) v_count;
            v_legacy := v_legacy OPERATOR(pg_catalog.||) pg_catalog.jsonb_build_object(v_locked[v_i], v_count);
        END LOOP;

        -- Every locked project's pending batch in one statement: taken in key order (a task's
        -- deletions in their order), numbered from the project's base by occurred_at within the
        -- batch, moved into the stream. The stream's key refuses a pending row whose identity it
        -- holds already; then the batch moves again (v_look), dropping such rows. The first try
        -- does not look for them: that look-up costs as much as the key's own check.
        PERFORM pg_catalog.set_config('plan_cache_mode', 'auto', true);
        v_look := false;
        LOOP
            BEGIN
                WITH locked AS (
                    SELECT l.project_id, l.base, l.room
                    FROM ROWS FROM (pg_catalog.unnest(v_locked), pg_catalog.unnest(v_base), pg_catalog.unnest(v_room)) AS l(project_id, base, room)
                    WHERE l.room OPERATOR(pg_catalog.>) 0
                ), batch AS (
                    SELECT b.row_id
                    FROM locked l
                    CROSS JOIN LATERAL (
                        SELECT q.ctid AS row_id
                        FROM lifecycle_outbox_pending q
                        WHERE q.project_id::text OPERATOR(pg_catalog.=) l.project_id
                        ORDER BY q.project_id, q.task_id, q.deleted_at
                        LIMIT l.room) AS b
                ), moved AS (
                    DELETE FROM lifecycle_outbox_pending q
                    USING batch
                    WHERE q.ctid OPERATOR(pg_catalog.=) batch.row_id
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
                    SELECT f.project_id, f.task_id, f.deleted_at, l.base OPERATOR(pg_catalog.+) f.rn, f.event_type, f.archived,
                           f.payload_version, f.occurred_at, f.writer_process_id, f.prior_column, f.trace_context
                    FROM fresh f JOIN locked l ON l.project_id OPERATOR(pg_catalog.=) f.project_id::text
                    RETURNING lifecycle_outbox.project_id, lifecycle_outbox.sequence
                )
                SELECT pg_catalog.array_agg(r.project_id), pg_catalog.array_agg(r.n), pg_catalog.array_agg(r.top)
                INTO v_moved_projects, v_moved_counts, v_moved_max
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
        PERFORM pg_catalog.set_config('plan_cache_mode', 'force_generic_plan', true);

        -- Only a sequencer holding the heads lock numbers rows, so nothing can be skipped here;
        -- if it ever were, a gap would follow, and a gap must never commit.
        FOR v_i IN 1 .. coalesce(pg_catalog.cardinality(v_moved_projects), 0) LOOP
            v_project := v_moved_projects[v_i];
            v_last := v_base[pg_catalog.array_position(v_locked, v_project)];
            IF v_moved_max[v_i] OPERATOR(pg_catalog.-) v_last OPERATOR(pg_catalog.<>) v_moved_counts[v_i] THEN
                RAISE EXCEPTION 'sequencer for project % would leave a gap (last %, max %, count %)',
                    v_project, v_last, v_moved_max[v_i], v_moved_counts[v_i] USING ERRCODE = 'XX000';
            END IF;
            v_base[pg_catalog.array_position(v_locked, v_project)] := v_moved_max[v_i];
        END LOOP;

        -- What each locked project was assigned.
        SELECT v_assigned OPERATOR(pg_catalog.||) coalesce(pg_catalog.jsonb_object_agg(l.p,
                   coalesce((v_legacy OPERATOR(pg_catalog.->>) l.p)::integer, 0)
                   OPERATOR(pg_catalog.+) coalesce(m.n, 0)), '{}')
        INTO v_assigned
        FROM pg_catalog.unnest(v_locked) AS l(p)
        LEFT JOIN ROWS FROM (pg_catalog.unnest(v_moved_projects), pg_catalog.unnest(v_moved_counts)) AS m(p, n) ON m.p OPERATOR(pg_catalog.=) l.p;

        -- The projects to announce: numbered now, and not announced within p_gap.
        IF p_channel IS NOT NULL THEN
            SELECT pg_catalog.array_agg(h.project_id ORDER BY h.project_id) INTO v_announce
            FROM lifecycle_outbox_heads h
            WHERE h.project_id OPERATOR(pg_catalog.=) ANY (v_locked)
              AND coalesce((v_assigned OPERATOR(pg_catalog.->>) h.project_id)::integer, 0) OPERATOR(pg_catalog.>) 0
              AND (h.notified_at IS NULL OR h.notified_at OPERATOR(pg_catalog.<=) (pg_catalog.now() OPERATOR(pg_catalog.-) p_gap));
        END IF;

        -- Move the heads of the projects that got numbers; the caller takes or renews its hold on
        -- each (only by numbering: a call that found nothing left to move takes no hold), and notes
        -- the announcements.
        UPDATE lifecycle_outbox_heads h
        SET last_sequence = l.base, sequenced_at = pg_catalog.now(),
            sequencer_owner = coalesce(p_sequencer, h.sequencer_owner),
            sequencer_until = CASE WHEN p_sequencer IS NULL THEN h.sequencer_until ELSE pg_catalog.now() OPERATOR(pg_catalog.+) p_hold END,
            notified_at = CASE WHEN h.project_id OPERATOR(pg_catalog.=) ANY (v_announce) THEN pg_catalog.now() ELSE h.notified_at END
        FROM ROWS FROM (pg_catalog.unnest(v_locked), pg_catalog.unnest(v_base)) AS l(project_id, base)
        WHERE h.project_id OPERATOR(pg_catalog.=) l.project_id AND h.last_sequence OPERATOR(pg_catalog.<>) l.base;
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
          AND (v_every OR h.project_id OPERATOR(pg_catalog.=) ANY (v_allowed));
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

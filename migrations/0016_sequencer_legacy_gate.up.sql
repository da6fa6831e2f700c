-- The sequencer looks for rows of older writers (schema 6, numbered in the stream itself) by
-- the partial index that holds only those, whatever the stream's statistics say.
--
-- Each call of lifecycle_outbox_sequence asked, for every project it had locked, whether the
-- stream held an unnumbered row of that project. Its generic plan is made once per session.
-- Made on the statistics of an empty stream (the state a deployment analyzes at install, and
-- the one a first consumer meets before a large backlog), it was a walk of the stream's key
-- from end to end with the filter "sequence IS NULL": every call of a drain read the whole
-- stream so far, and the drain's cost grew with the square of the backlog. Measured on the
-- development machine (outbox-bench sequence -events 1000000 -prewrite-per-tx 50): that
-- statement took 6.6 s of the 16 s the sequencer needed, 66 ms a call by the end, while the
-- same backlog copied into a table laid out as the stream took 6.4 s.
--
-- Now one look for any unnumbered row in the stream comes first. It has no condition on the
-- project, so the stream's key cannot serve it and the planner answers it from the partial
-- index of unnumbered rows, which is empty unless an older writer ran. Only then is each
-- project asked, as before. What a call numbers and in which order is unchanged.
--
-- The function is rewritten from its stored definition, as 0013 and 0015 did, and the
-- rewrite refuses a definition that does not hold the old text exactly once.
DO $$
DECLARE
    v_function constant text := 'lifecycle_outbox_sequence(text[], integer, text, interval, text, interval)';
    v_old constant text := '
        SELECT pg_catalog.array_agg(x.p ORDER BY x.p) INTO v_legacy_projects
        FROM pg_catalog.unnest(v_locked) AS x(p)
        WHERE EXISTS (SELECT 1 FROM lifecycle_outbox o WHERE o.project_id OPERATOR(pg_catalog.=) x.p AND o.sequence IS NULL);';
    v_new constant text := '
        -- Any such row at all first: with no condition on the project, only the partial index
        -- of unnumbered rows can answer it, whatever the statistics the plan was made on.
        IF EXISTS (SELECT 1 FROM lifecycle_outbox o WHERE o.sequence IS NULL) THEN
            SELECT pg_catalog.array_agg(x.p ORDER BY x.p) INTO v_legacy_projects
            FROM pg_catalog.unnest(v_locked) AS x(p)
            WHERE EXISTS (SELECT 1 FROM lifecycle_outbox o WHERE o.project_id OPERATOR(pg_catalog.=) x.p AND o.sequence IS NULL);
        ELSE
            v_legacy_projects := NULL;
        END IF;';
    v_def text;
BEGIN
    v_def := pg_catalog.pg_get_functiondef(v_function::pg_catalog.regprocedure);
    IF (pg_catalog.length(v_def) OPERATOR(pg_catalog.-) pg_catalog.length(pg_catalog.replace(v_def, v_old, '')))
       OPERATOR(pg_catalog.<>) pg_catalog.length(v_old) THEN
        RAISE EXCEPTION '% is not the function of migration 0015: the change does not apply', v_function;
    END IF;
    EXECUTE pg_catalog.replace(v_def, v_old, v_new);
END;
$$;

-- An idle poll of many projects stops probing each of them for rows to number.
--
-- A consumer's poll calls the sequencer with every project it holds. The call first keeps the
-- projects that have pending or unnumbered rows, by two index probes per project: at 10,000
-- projects that was 3.9ms of a 6.9ms call on the development machine, every poll, while there
-- was nothing at all to number. Now a call for more than 64 projects first asks whether the
-- pending table and the stream's unnumbered rows are empty (one probe each), and when both are
-- it keeps no project, as the per-project probes would have. A row committed after the look is
-- numbered by the next call, as before. 64 is about where the per-project probes start costing
-- more than the two statements of the look; below it the call is as before.
--
-- The function of migrations 0011 and 0013 is rewritten from its stored definition with this
-- one change; the rewrite refuses a definition that does not hold the changed text exactly once.
DO $$
DECLARE
    v_old constant text := '
    ELSE
        SELECT pg_catalog.array_agg(DISTINCT x.p ORDER BY x.p) INTO v_projects
        FROM pg_catalog.unnest(p_projects) AS x(p)';
    v_new constant text := '
    ELSIF pg_catalog.cardinality(p_projects) OPERATOR(pg_catalog.>) 64
          AND NOT EXISTS (SELECT 1 FROM lifecycle_outbox_pending q)
          AND NOT EXISTS (SELECT 1 FROM lifecycle_outbox o WHERE o.sequence IS NULL) THEN
        v_projects := NULL; -- nothing anywhere to number: what the probes below would find
    ELSE
        SELECT pg_catalog.array_agg(DISTINCT x.p ORDER BY x.p) INTO v_projects
        FROM pg_catalog.unnest(p_projects) AS x(p)';
    v_def text := pg_catalog.pg_get_functiondef(
        'lifecycle_outbox_sequence(text[], integer, text, interval, text, interval)'::pg_catalog.regprocedure);
BEGIN
    IF (pg_catalog.length(v_def) OPERATOR(pg_catalog.-) pg_catalog.length(pg_catalog.replace(v_def, v_old, '')))
       OPERATOR(pg_catalog.<>) pg_catalog.length(v_old) THEN
        RAISE EXCEPTION 'lifecycle_outbox_sequence is not the function of migration 0013: its project filter was not found once';
    END IF;
    EXECUTE pg_catalog.replace(v_def, v_old, v_new);
END;
$$;

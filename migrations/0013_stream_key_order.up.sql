-- The outbox's keys in the order rows arrive: (project_id, deleted_at, task_id); the sequencer
-- numbers the oldest pending rows first, and an idle call for many projects probes none of them.
--
-- Both keys were (project_id, task_id, deleted_at), and the sequencer took each batch in that
-- order: the pending rows with the smallest task IDs, whenever they were written. A task ID is
-- the host's and often random (a UUID), so on a backlog larger than a batch an event waited
-- for as many batches as there were smaller IDs pending, and the rows a move added to the
-- stream went to random leaves of its key, which a large move spent much of its time descending
-- to and splitting. Now a batch is the project's oldest pending rows, and a move adds to the
-- same few leaves at the end of each project's range. The columns and their meaning do not
-- change: each key still refuses an identity stored twice, an ON CONFLICT that names the three
-- columns still finds it, and no reader walks either key by task (the stream is read by
-- sequence). Measured on the development machine, one session (the closing note of the stop
-- that added this migration has the runs).
--
-- Each key is built beside the old one under a SHARE lock (readable, not writable), then
-- swapped under an ACCESS EXCLUSIVE lock held until the migration commits. The stream goes
-- first: its build is the long one (about 1.5s for a million rows there), and writers do not
-- wait for it, because they insert into the pending table, which is small and goes second.

CREATE UNIQUE INDEX lifecycle_outbox_key_in_arrival_order ON lifecycle_outbox (project_id, deleted_at, task_id);
ALTER TABLE lifecycle_outbox DROP CONSTRAINT lifecycle_outbox_pkey;
ALTER TABLE lifecycle_outbox ADD CONSTRAINT lifecycle_outbox_pkey PRIMARY KEY USING INDEX lifecycle_outbox_key_in_arrival_order;

CREATE UNIQUE INDEX lifecycle_outbox_pending_key_in_arrival_order ON lifecycle_outbox_pending (project_id, deleted_at, task_id);
ALTER TABLE lifecycle_outbox_pending DROP CONSTRAINT lifecycle_outbox_pending_pkey;
ALTER TABLE lifecycle_outbox_pending ADD CONSTRAINT lifecycle_outbox_pending_pkey PRIMARY KEY USING INDEX lifecycle_outbox_pending_key_in_arrival_order;

-- The sequencer of 0011 with two changes. The function is rewritten from its stored definition
-- rather than restated here whole, and the rewrite refuses a definition that does not hold each
-- old text exactly once.
--
-- 1. A batch is taken in the pending key's new order, so that it is still read by index (as
--    TestSequencerMoveKeepsOnePlanWhateverTheBacklog requires) and is the oldest rows.
-- 2. An idle poll of many projects stops probing each of them. A consumer's poll calls the
--    sequencer with every project it holds, and the call kept those with pending or unnumbered
--    rows by two index probes per project: at 10,000 projects that was 3.9ms of a 6.9ms call on
--    the development machine, every poll, with nothing to number. A call for more than 64
--    projects now first asks whether the pending table and the stream's unnumbered rows are
--    empty (one probe each), and when both are it keeps no project, as the probes would have. A
--    row committed after the look is numbered by the next call, as before. 64 is about where the
--    per-project probes start costing more than the two statements of the look.
DO $$
DECLARE
    v_changes constant text[][] := ARRAY[
        ARRAY['ORDER BY q.project_id, q.task_id, q.deleted_at',
              'ORDER BY q.project_id, q.deleted_at, q.task_id'],
        ARRAY['
    ELSE
        SELECT pg_catalog.array_agg(DISTINCT x.p ORDER BY x.p) INTO v_projects
        FROM pg_catalog.unnest(p_projects) AS x(p)',
              '
    ELSIF pg_catalog.cardinality(p_projects) OPERATOR(pg_catalog.>) 64
          AND NOT EXISTS (SELECT 1 FROM lifecycle_outbox_pending q)
          AND NOT EXISTS (SELECT 1 FROM lifecycle_outbox o WHERE o.sequence IS NULL) THEN
        v_projects := NULL; -- nothing anywhere to number: what the probes below would find
    ELSE
        SELECT pg_catalog.array_agg(DISTINCT x.p ORDER BY x.p) INTO v_projects
        FROM pg_catalog.unnest(p_projects) AS x(p)']];
    v_def text := pg_catalog.pg_get_functiondef(
        'lifecycle_outbox_sequence(text[], integer, text, interval, text, interval)'::pg_catalog.regprocedure);
    v_old text;
BEGIN
    FOR i IN 1 .. pg_catalog.array_length(v_changes, 1) LOOP
        v_old := v_changes[i][1];
        IF (pg_catalog.length(v_def) OPERATOR(pg_catalog.-) pg_catalog.length(pg_catalog.replace(v_def, v_old, '')))
           OPERATOR(pg_catalog.<>) pg_catalog.length(v_old) THEN
            RAISE EXCEPTION 'lifecycle_outbox_sequence is not the function of migration 0011: change % does not apply', i;
        END IF;
        v_def := pg_catalog.replace(v_def, v_old, v_changes[i][2]);
    END LOOP;
    EXECUTE v_def;
END;
$$;

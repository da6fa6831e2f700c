-- The outbox's keys in the order rows arrive: (project_id, deleted_at, task_id), and the
-- sequencer numbers the oldest pending rows first.
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

-- The sequencer of 0011 with one change: a batch is taken in the pending key's new order, so
-- that it is read by index, as TestSequencerMoveKeepsOnePlanWhateverTheBacklog requires. The
-- function is rewritten from its stored definition rather than restated here whole; the
-- rewrite refuses to run on a definition that does not hold the old order exactly once.
DO $$
DECLARE
    v_old constant text := 'ORDER BY q.project_id, q.task_id, q.deleted_at';
    v_new constant text := 'ORDER BY q.project_id, q.deleted_at, q.task_id';
    v_def text := pg_catalog.pg_get_functiondef(
        'lifecycle_outbox_sequence(text[], integer, text, interval, text, interval)'::pg_catalog.regprocedure);
BEGIN
    IF (pg_catalog.length(v_def) OPERATOR(pg_catalog.-) pg_catalog.length(pg_catalog.replace(v_def, v_old, '')))
       OPERATOR(pg_catalog.<>) pg_catalog.length(v_old) THEN
        RAISE EXCEPTION 'lifecycle_outbox_sequence is not the function of migration 0011: its batch order was not found once';
    END IF;
    EXECUTE pg_catalog.replace(v_def, v_old, v_new);
END;
$$;

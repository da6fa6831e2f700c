-- The identifier checks of 0001 to 0003, in the form 0005 gave the outbox's own.
--
-- The heads, the cursors and the project grants still checked identifiers with a bounded
-- repetition, '^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$'. PostgreSQL's regular expressions expand
-- {0,127} into 127 states: on this project's machine such a test took 8us a value against
-- 0.6us for the same class with '*' and the length checked apart (100,000 values, one
-- session), and a check runs on every UPDATE of its row, whichever columns change. A
-- consumer's acknowledgement of 16 projects took 1.5ms, of which 0.5ms were these two checks
-- on the cursor rows; the sequencer's heads update and every lease heartbeat paid them too.
-- The patterns accept the same values: the class is ASCII, so characters are bytes.

ALTER TABLE lifecycle_outbox_heads
    DROP CONSTRAINT lifecycle_outbox_heads_project_id_check,
    ADD CONSTRAINT lifecycle_outbox_heads_project_id_format
        CHECK (project_id OPERATOR(pg_catalog.~) '^[A-Za-z0-9][A-Za-z0-9._:-]*$'
               AND pg_catalog.octet_length(project_id) OPERATOR(pg_catalog.<=) 128);

ALTER TABLE lifecycle_consumer_cursors
    DROP CONSTRAINT lifecycle_consumer_cursors_project_id_check,
    DROP CONSTRAINT lifecycle_consumer_cursors_consumer_id_check,
    ADD CONSTRAINT lifecycle_consumer_cursors_project_id_format
        CHECK (project_id OPERATOR(pg_catalog.~) '^[A-Za-z0-9][A-Za-z0-9._:-]*$'
               AND pg_catalog.octet_length(project_id) OPERATOR(pg_catalog.<=) 128),
    ADD CONSTRAINT lifecycle_consumer_cursors_consumer_id_format
        CHECK (consumer_id OPERATOR(pg_catalog.~) '^[A-Za-z0-9][A-Za-z0-9._:-]*$'
               AND pg_catalog.octet_length(consumer_id) OPERATOR(pg_catalog.<=) 128);

ALTER TABLE lifecycle_project_access
    DROP CONSTRAINT lifecycle_project_access_project_id_check,
    ADD CONSTRAINT lifecycle_project_access_project_id_format
        CHECK (project_id OPERATOR(pg_catalog.=) '*'
               OR (project_id OPERATOR(pg_catalog.~) '^[A-Za-z0-9][A-Za-z0-9._:-]*$'
                   AND pg_catalog.octet_length(project_id) OPERATOR(pg_catalog.<=) 128));

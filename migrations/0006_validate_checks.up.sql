-- Validate the checks 0005 added, in a transaction of its own: VALIDATE CONSTRAINT scans the
-- table under a SHARE UPDATE EXCLUSIVE lock, which writers, consumers and retention do not wait
-- for.
--
-- A check that rows written before 0005 violate is left NOT VALID rather than failing the
-- upgrade: new rows are checked all the same, readers park such an old row as an undecodable
-- dead letter or leave it out of status, and VerifySchema keeps passing. A WARNING names the
-- check; `outboxctl verify` lists it and the runbook says how to find and mend the rows and then
-- validate it (docs/operations.md, "Rows the checks refuse").
DO $$
DECLARE
    c record;
BEGIN
    FOR c IN
        SELECT k.conrelid::regclass AS rel, k.conname
        FROM pg_catalog.pg_constraint k
        WHERE NOT k.convalidated AND k.contype = 'c'
          AND k.conrelid IN ('lifecycle_outbox'::regclass, 'lifecycle_outbox_heads'::regclass,
                             'lifecycle_consumer_cursors'::regclass, 'lifecycle_consumer_deliveries'::regclass,
                             'lifecycle_audit'::regclass)
        ORDER BY k.conrelid::regclass::text, k.conname
    LOOP
        BEGIN
            EXECUTE pg_catalog.format('ALTER TABLE %s VALIDATE CONSTRAINT %I', c.rel, c.conname);
        EXCEPTION WHEN check_violation THEN
            RAISE WARNING 'outbox: rows written before this upgrade violate check % on %; it stays NOT VALID until they are mended',
                c.conname, c.rel;
        END;
    END LOOP;
END;
$$;

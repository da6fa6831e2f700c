-- A cursor's checks move from the table into its columns' types.
--
-- PostgreSQL tests every check of a table on every row an UPDATE writes, whichever columns it
-- sets, and rebuilds each check's expression from its stored text once per statement. The
-- cursor table carried thirteen, and every acknowledgement, lease heartbeat and lease change
-- paid for all of them. A domain's check runs only where a value is assigned to the column,
-- and the server keeps it compiled with the type. Measured on the development machine (one
-- session, 3,000 acknowledgements of 16 cursors each, mean statement time, three runs each):
-- 0.25 to 0.32ms with the table checks, 0.13 to 0.18ms with these columns as domains.
--
-- A column changes type only if its checks hold for every row already there: a check that
-- 0006 left NOT VALID (rows written before it that it refuses) stays as it is, on a column of
-- its old type, listed by UnvalidatedChecks, and goes on checking new rows. The identifiers
-- (project_id, consumer_id) keep their table checks: row-level security policies name those
-- columns, and a column a policy names cannot change type. So does the check that ties
-- retired_at to retired_by, which spans two columns.

CREATE DOMAIN lifecycle_count AS bigint CHECK (VALUE OPERATOR(pg_catalog.>=) 0);
CREATE DOMAIN lifecycle_instance AS text
    CHECK (VALUE OPERATOR(pg_catalog.~) '^[A-Za-z0-9][A-Za-z0-9._:-]*@[0-9a-f]{16}$' AND pg_catalog.octet_length(VALUE) OPERATOR(pg_catalog.<=) 128);
CREATE DOMAIN lifecycle_reconcile_reason AS text
    CHECK (VALUE OPERATOR(pg_catalog.=) ANY (ARRAY['missing_cursor', 'cursor_ahead_of_head', 'cursor_below_pruned_floor']));
CREATE DOMAIN lifecycle_actor AS text
    CHECK (VALUE OPERATOR(pg_catalog.~) '^[A-Za-z0-9][A-Za-z0-9._@:/-]*$' AND pg_catalog.octet_length(VALUE) OPERATOR(pg_catalog.<=) 128);
CREATE DOMAIN lifecycle_reason AS text
    CHECK (VALUE OPERATOR(pg_catalog.~) '^[A-Za-z0-9][A-Za-z0-9._:/#-]*$' AND pg_catalog.octet_length(VALUE) OPERATOR(pg_catalog.<=) 128);

DO $$
DECLARE
    c record;
BEGIN
    FOR c IN
        SELECT * FROM (VALUES
            (ARRAY['lifecycle_consumer_cursors_last_acked_sequence_check'], ARRAY['last_acked_sequence'], 'lifecycle_count'),
            (ARRAY['lifecycle_consumer_cursors_lease_epoch_check'], ARRAY['lease_epoch'], 'lifecycle_count'),
            (ARRAY['lifecycle_consumer_cursors_lease_owner_check', 'lifecycle_consumer_cursors_lease_owner_format'],
             ARRAY['lease_owner'], 'lifecycle_instance'),
            (ARRAY['lifecycle_consumer_cursors_reconcile_reason_check'], ARRAY['reconcile_reason'], 'lifecycle_reconcile_reason'),
            (ARRAY['lifecycle_consumer_cursors_retired_by_check', 'lifecycle_consumer_cursors_retired_by_format'],
             ARRAY['retired_by'], 'lifecycle_actor'),
            (ARRAY['lifecycle_consumer_cursors_retired_reason_check', 'lifecycle_consumer_cursors_retired_reason_format'],
             ARRAY['retired_reason'], 'lifecycle_reason'),
            (ARRAY['lifecycle_consumer_cursors_times_finite'],
             ARRAY['acked_at', 'lease_expires_at', 'heartbeat_at', 'reconciled_at', 'retired_at', 'created_at'], 'lifecycle_instant')
        ) AS g(checks, columns, domain)
    LOOP
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM pg_catalog.pg_constraint k
            WHERE k.conrelid OPERATOR(pg_catalog.=) 'lifecycle_consumer_cursors'::regclass
              AND k.conname OPERATOR(pg_catalog.=) ANY (c.checks) AND NOT k.convalidated);
        -- The type's check tests every row again; one that a check dropped by hand let in
        -- makes this group keep its old type and no checks, as it had.
        BEGIN
            EXECUTE 'ALTER TABLE lifecycle_consumer_cursors '
                || (SELECT pg_catalog.string_agg(pg_catalog.format('DROP CONSTRAINT IF EXISTS %I', x), ', ') FROM pg_catalog.unnest(c.checks) AS x)
                || ', '
                || (SELECT pg_catalog.string_agg(pg_catalog.format('ALTER COLUMN %I TYPE %I', x, c.domain), ', ') FROM pg_catalog.unnest(c.columns) AS x);
        EXCEPTION WHEN check_violation THEN
            RAISE NOTICE 'lifecycle_consumer_cursors: % keep their type: a row refuses %', c.columns, c.domain;
        END;
    END LOOP;
END;
$$;

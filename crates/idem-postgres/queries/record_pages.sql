-- The records table's size in pages: grouped statements keep their plans
-- from a size on where autovacuum is off (Plans in lib.rs). NULL
-- when the table is not on the search path.
SELECT pg_relation_size(to_regclass('idem_records')) / current_setting('block_size')::bigint

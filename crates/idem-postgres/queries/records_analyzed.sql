-- Whether idem_records has statistics (reltuples is -1 until it is first
-- analyzed or vacuumed). NULL when the table is not on the search path.
SELECT reltuples >= 0 FROM pg_class WHERE oid = to_regclass('idem_records')

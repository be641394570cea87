-- Whether autovacuum analyzes idem_records: on for the server, and not
-- turned off for the table (autovacuum_enabled = false). A table not
-- there yet (migrations off) counts as the server says.
SELECT current_setting('autovacuum')::boolean
   AND coalesce((SELECT option_value::boolean
                 FROM pg_class AS c, pg_options_to_table(c.reloptions)
                 WHERE c.oid = to_regclass('idem_records')
                   AND option_name = 'autovacuum_enabled'), true)

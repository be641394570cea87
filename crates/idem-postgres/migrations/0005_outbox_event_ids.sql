-- Version 5: every outbox row gets a random event id at enqueue, the
-- broker's de-duplication id and the consumers' inbox key. A row number
-- is not enough: a database restored from a backup, recreated, or promoted
-- from a lagging replica hands out row numbers that were already published,
-- and the broker would drop those new events as copies.
--
-- Rows written before this version keep no event id (NULL): the relay
-- goes on publishing them under their old id (`<source>:<row id>`), so a
-- row published just before the upgrade and not yet marked is still
-- recognised as a copy.
ALTER TABLE idem_outbox ADD COLUMN event_id text;
ALTER TABLE idem_outbox ALTER COLUMN event_id SET DEFAULT gen_random_uuid()::text;

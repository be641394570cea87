-- Delete dead rows for good.
--
-- $1 row ids. Returns the ids that were dead.
DELETE FROM idem_outbox
WHERE id = ANY($1) AND state = 'dead'
RETURNING id

-- Put dead rows back in line: pending, attempts reset, available now.
--
-- $1 row ids. Returns the ids that were dead.
UPDATE idem_outbox SET state = 'pending', attempts = 0, available_at = clock_timestamp()
WHERE id = ANY($1) AND state = 'dead'
RETURNING id

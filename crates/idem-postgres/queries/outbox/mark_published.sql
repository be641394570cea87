-- Mark rows the broker acknowledged as published (the acknowledged
-- attempt counts); rows no longer pending are left alone.
--
-- $1 row ids.
UPDATE idem_outbox SET state = 'published', published_at = clock_timestamp(),
       attempts = attempts + 1, last_error = NULL
WHERE id = ANY($1) AND state = 'pending'

-- Count a failed publish: the row is retried after a delay, or becomes
-- dead after its last attempt. A row no longer pending is left alone.
--
-- $1 row id, $2 the error, $3 retry delay in milliseconds, $4 dead.
UPDATE idem_outbox SET attempts = attempts + 1, last_error = $2,
       available_at = clock_timestamp() + $3::bigint * interval '1 millisecond',
       state = CASE WHEN $4 THEN 'dead' ELSE state END
WHERE id = $1 AND state = 'pending'

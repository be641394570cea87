-- Extend a processing record's lease to now + duration; only its owner.
--
-- $1 tenant, $2 operation, $3 key, $4 owner, $5 attempt, $6 duration (ms).
WITH clock AS (
    SELECT date_trunc('milliseconds', clock_timestamp()) AS now
)
UPDATE idem_records AS r
SET locked_until = clock.now + $6::bigint * interval '1 millisecond',
    updated_at = clock.now
FROM clock
WHERE r.tenant = $1 AND r.operation = $2 AND r.key = $3
  AND r.owner = $4 AND r.attempt = $5 AND r.state = 'processing'
RETURNING (extract(epoch FROM r.locked_until) * 1000)::bigint AS locked_until_ms

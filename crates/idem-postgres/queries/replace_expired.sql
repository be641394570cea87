-- Replace a final record past its retention by a fresh attempt 1, possibly
-- for another request. Conditional on the version read and on it still
-- being expired, so two racers cannot both replace it.
--
-- $1 tenant, $2 operation, $3 key, $4 fingerprint, $5 new owner,
-- $6 lease (ms), $7 retention (ms), $8 owner read, $9 attempt read.
WITH clock AS (
    SELECT date_trunc('milliseconds', clock_timestamp()) AS now
)
UPDATE idem_records AS r
SET fingerprint = $4,
    state = 'processing',
    created_at = clock.now,
    updated_at = clock.now,
    expires_at = clock.now + $7::bigint * interval '1 millisecond',
    locked_until = clock.now + $6::bigint * interval '1 millisecond',
    owner = $5,
    attempt = 1,
    response_status = NULL,
    response_headers = NULL,
    response_body = NULL,
    resource_id = NULL,
    error_code = NULL
FROM clock
WHERE r.tenant = $1 AND r.operation = $2 AND r.key = $3
  AND r.owner = $8 AND r.attempt = $9
  AND r.state <> 'processing' AND r.expires_at <= clock.now
RETURNING (extract(epoch FROM r.locked_until) * 1000)::bigint AS locked_until_ms

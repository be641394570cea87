-- Record the final answer. Fenced by owner and attempt; no state check, so
-- the same owner resolving again (a retry after an ambiguous failure)
-- succeeds.
--
-- $1 tenant, $2 operation, $3 key, $4 owner, $5 attempt, $6 state,
-- $7 retention (ms), $8 status, $9 headers, $10 body, $11 resource id,
-- $12 error code.
WITH clock AS (
    SELECT date_trunc('milliseconds', clock_timestamp()) AS now
)
UPDATE idem_records AS r
SET state = $6,
    updated_at = clock.now,
    expires_at = clock.now + $7::bigint * interval '1 millisecond',
    response_status = $8,
    response_headers = $9,
    response_body = $10,
    resource_id = $11,
    error_code = $12
FROM clock
WHERE r.tenant = $1 AND r.operation = $2 AND r.key = $3
  AND r.owner = $4 AND r.attempt = $5

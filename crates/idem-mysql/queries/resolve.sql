-- Record the final answer. Fenced by owner and attempt; no state check, so
-- the same owner resolving again (a retry after an ambiguous failure)
-- succeeds: the driver counts matched rows (CLIENT_FOUND_ROWS), not
-- changed ones.
--
-- 1 state, 2 retention (ms), 3 status, 4 headers, 5 body, 6 resource id,
-- 7 error code, 8 tenant, 9 operation, 10 key, 11 owner, 12 attempt.
UPDATE idem_records
SET state = ?,
    updated_at = UTC_TIMESTAMP(3),
    expires_at = TIMESTAMPADD(MICROSECOND, ? * 1000, UTC_TIMESTAMP(3)),
    response_status = ?,
    response_headers = ?,
    response_body = ?,
    resource_id = ?,
    error_code = ?
WHERE tenant = ? AND operation = ? AND idem_key = ?
  AND owner = ? AND attempt = ?

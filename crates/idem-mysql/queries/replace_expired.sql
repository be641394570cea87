-- Replace a final record past its retention by a fresh attempt 1, possibly
-- for another request. Conditional on the version read and on it still
-- being expired, so two racers cannot both replace it.
--
-- 1 fingerprint, 2 retention (ms), 3 lease (ms), 4 new owner,
-- 5 tenant, 6 operation, 7 key, 8 owner read, 9 attempt read.
UPDATE idem_records
SET fingerprint = ?,
    state = 'processing',
    created_at = UTC_TIMESTAMP(3),
    updated_at = UTC_TIMESTAMP(3),
    expires_at = TIMESTAMPADD(MICROSECOND, ? * 1000, UTC_TIMESTAMP(3)),
    locked_until = TIMESTAMPADD(MICROSECOND, ? * 1000, UTC_TIMESTAMP(3)),
    owner = ?,
    attempt = 1,
    response_status = NULL,
    response_headers = NULL,
    response_body = NULL,
    resource_id = NULL,
    error_code = NULL
WHERE tenant = ? AND operation = ? AND idem_key = ?
  AND owner = ? AND attempt = ?
  AND state <> 'processing' AND expires_at <= UTC_TIMESTAMP(3)

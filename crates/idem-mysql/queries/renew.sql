-- Extend a processing record's lease to now + duration; only its owner.
-- The new expiry is read back with read_lease.sql.
--
-- 1 duration (ms), 2 tenant, 3 operation, 4 key, 5 owner, 6 attempt.
UPDATE idem_records
SET locked_until = TIMESTAMPADD(MICROSECOND, ? * 1000, UTC_TIMESTAMP(3)),
    updated_at = UTC_TIMESTAMP(3)
WHERE tenant = ? AND operation = ? AND idem_key = ?
  AND owner = ? AND attempt = ? AND state = 'processing'

-- Mark a processing record outcome_unknown; only its owner. It stays
-- processing and is never purged.
--
-- 1 tenant, 2 operation, 3 key, 4 owner, 5 attempt.
UPDATE idem_records
SET error_code = 'outcome_unknown',
    updated_at = UTC_TIMESTAMP(3)
WHERE tenant = ? AND operation = ? AND idem_key = ?
  AND owner = ? AND attempt = ? AND state = 'processing'

-- Mark a processing record outcome_unknown; only its owner. It stays
-- processing and is never purged.
--
-- $1 tenant, $2 operation, $3 key, $4 owner, $5 attempt.
UPDATE idem_records
SET error_code = 'outcome_unknown',
    updated_at = date_trunc('milliseconds', clock_timestamp())
WHERE tenant = $1 AND operation = $2 AND key = $3
  AND owner = $4 AND attempt = $5 AND state = 'processing'

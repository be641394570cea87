-- Delete a processing record so its key is free again; only its owner.
--
-- 1 tenant, 2 operation, 3 key, 4 owner, 5 attempt.
DELETE FROM idem_records
WHERE tenant = ? AND operation = ? AND idem_key = ?
  AND owner = ? AND attempt = ? AND state = 'processing'

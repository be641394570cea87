-- Delete a processing record so its key is free again; only its owner.
--
-- $1 tenant, $2 operation, $3 key, $4 owner, $5 attempt.
DELETE FROM idem_records
WHERE tenant = $1 AND operation = $2 AND key = $3
  AND owner = $4 AND attempt = $5 AND state = 'processing'

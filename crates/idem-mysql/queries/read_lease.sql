-- The lease a statement just wrote (MySQL has no portable RETURNING): the
-- attempt and lease expiry of a processing record held by this owner.
-- No row: the lease is not (or no longer) this owner's.
--
-- 1 tenant, 2 operation, 3 key, 4 owner, 5 attempt.
SELECT attempt,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', locked_until) DIV 1000 AS locked_until_ms
FROM idem_records
WHERE tenant = ? AND operation = ? AND idem_key = ?
  AND owner = ? AND attempt = ? AND state = 'processing'

-- Take over a lapsed lease as attempt + 1. Conditional on the exact
-- version that was read (owner and attempt) and on the lease still being
-- lapsed by the server's clock, so of two racers only one can win: the
-- other's UPDATE re-checks the row after the winner commits and matches
-- nothing.
--
-- 1 new owner, 2 lease (ms), 3 tenant, 4 operation, 5 key,
-- 6 owner read, 7 attempt read.
UPDATE idem_records
SET owner = ?,
    attempt = attempt + 1,
    locked_until = TIMESTAMPADD(MICROSECOND, ? * 1000, UTC_TIMESTAMP(3)),
    updated_at = UTC_TIMESTAMP(3)
WHERE tenant = ? AND operation = ? AND idem_key = ?
  AND owner = ? AND attempt = ?
  AND state = 'processing' AND locked_until <= UTC_TIMESTAMP(3)

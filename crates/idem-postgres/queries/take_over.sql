-- Take over a lapsed lease as attempt + 1. Conditional on the exact
-- version that was read (owner and attempt) and on the lease still being
-- lapsed, so of two racers only one can win: the other's UPDATE re-checks
-- the row after the winner commits and matches nothing.
--
-- $1 tenant, $2 operation, $3 key, $4 new owner, $5 lease (ms),
-- $6 owner read, $7 attempt read.
WITH clock AS (
    SELECT date_trunc('milliseconds', clock_timestamp()) AS now
)
UPDATE idem_records AS r
SET owner = $4,
    attempt = r.attempt + 1,
    locked_until = clock.now + $5::bigint * interval '1 millisecond',
    updated_at = clock.now
FROM clock
WHERE r.tenant = $1 AND r.operation = $2 AND r.key = $3
  AND r.owner = $6 AND r.attempt = $7
  AND r.state = 'processing' AND r.locked_until <= clock.now
RETURNING r.attempt, (extract(epoch FROM r.locked_until) * 1000)::bigint AS locked_until_ms

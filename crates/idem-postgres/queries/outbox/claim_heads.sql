-- A relay's next round: per aggregate of the partitions it holds, its
-- pending rows from the head on, heads of every aggregate first.
--
-- The aggregates with pending rows are walked on the pending-rows index
-- (one probe each, at most $4 of them, starting after the aggregate
-- ($8, $9) where the last walk stopped), and each one's first rows are
-- read by index: the read costs what it returns, not the backlog. Every
-- aggregate walked comes back, with NULL row columns when none of its
-- rows qualifies (not in a held partition, blocked by a dead row, or all
-- in flight).
--
-- $1 partitions, $2 partitions held (int[]), $3 rows per aggregate,
-- $4 aggregates walked (and rows returned) at most; $5, $6, $7: per
-- aggregate (type[], id[], sequence[]), the sequence to read after (rows
-- acknowledged or in flight); $8, $9 the aggregate to walk on after
-- (('', '') from the start: aggregate types are never empty); $10 leave
-- out aggregates that have a dead row.
--
-- Returns aggregate_type, aggregate_id, n (walk position), and the row:
-- id, event_id, sequence, message_type, payload, headers (as text),
-- attempts, later (not due yet: backing off after a failure).
WITH RECURSIVE aggs(aggregate_type, aggregate_id, n) AS (
  (SELECT aggregate_type, aggregate_id, 1 FROM idem_outbox
   WHERE state = 'pending'
     AND (aggregate_type, aggregate_id) > ($8::text, $9::text)
   ORDER BY aggregate_type, aggregate_id LIMIT 1)
  UNION ALL
  SELECT nxt.aggregate_type, nxt.aggregate_id, a.n + 1 FROM aggs a CROSS JOIN LATERAL (
    SELECT o.aggregate_type, o.aggregate_id FROM idem_outbox o
    WHERE o.state = 'pending'
      AND (o.aggregate_type, o.aggregate_id) > (a.aggregate_type, a.aggregate_id)
    ORDER BY o.aggregate_type, o.aggregate_id LIMIT 1) nxt
  WHERE a.n < $4
)
SELECT a.aggregate_type, a.aggregate_id, a.n, r.id, r.event_id, r.sequence, r.message_type,
       r.payload, r.headers, r.attempts, r.later
FROM aggs a
LEFT JOIN unnest($5::text[], $6::text[], $7::bigint[]) AS f(t, id, s)
  ON f.t = a.aggregate_type AND f.id = a.aggregate_id
LEFT JOIN LATERAL (
  SELECT o.id, o.event_id, o.sequence, o.message_type, o.payload::text AS payload,
         o.headers::text AS headers, o.attempts, o.available_at > clock_timestamp() AS later,
         row_number() OVER (ORDER BY o.sequence) AS rn
  FROM idem_outbox o
  WHERE o.state = 'pending'
    AND o.aggregate_type = a.aggregate_type AND o.aggregate_id = a.aggregate_id
    AND o.sequence > COALESCE(f.s, 0)
    AND ((hashtext(a.aggregate_type || '/' || a.aggregate_id) & 2147483647) % $1) = ANY($2)
    AND NOT ($10 AND EXISTS (SELECT 1 FROM idem_outbox d WHERE d.state = 'dead'
         AND d.aggregate_type = a.aggregate_type AND d.aggregate_id = a.aggregate_id))
  ORDER BY o.sequence LIMIT $3) r ON true
ORDER BY COALESCE(r.rn, 1), a.n
LIMIT $4

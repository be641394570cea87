-- Delete at most $2 rows published more than $1 milliseconds ago.
DELETE FROM idem_outbox WHERE id IN (
  SELECT id FROM idem_outbox
  WHERE state = 'published'
    AND published_at < clock_timestamp() - $1::bigint * interval '1 millisecond'
  LIMIT $2)

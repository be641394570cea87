-- Delete at most $2 inbox rows processed more than $1 milliseconds ago,
-- oldest first; of consumer $3 only, or of every consumer when it is NULL.
DELETE FROM idem_inbox WHERE ctid IN (
  SELECT ctid FROM idem_inbox
  WHERE processed_at < clock_timestamp() - $1::bigint * interval '1 millisecond'
    AND ($3::text IS NULL OR consumer = $3)
  ORDER BY processed_at LIMIT $2)

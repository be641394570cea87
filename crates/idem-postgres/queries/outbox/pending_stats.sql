-- The backlog: pending rows, and the age of the oldest one in seconds.
SELECT count(*) AS pending,
       COALESCE(EXTRACT(EPOCH FROM clock_timestamp() - min(created_at)), 0)::float8 AS lag
FROM idem_outbox
WHERE state = 'pending'

-- Give a partition back.
--
-- $1 the outbox's lock class, $2 the partition.
SELECT pg_advisory_unlock($1, $2)

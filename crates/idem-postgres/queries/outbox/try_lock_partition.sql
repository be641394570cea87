-- Take a partition, if no other session holds it (session advisory lock,
-- released when the session ends).
--
-- $1 the outbox's lock class, $2 the partition.
SELECT pg_try_advisory_lock($1, $2)

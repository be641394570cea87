-- The last version applied, read with a locking read: the latest
-- committed value, whatever the caller's transaction read before.
--
-- 1 consumer, 2 aggregate_type, 3 aggregate_id.
SELECT version FROM idem_aggregate_versions
WHERE consumer = ? AND aggregate_type = ? AND aggregate_id = ?
FOR UPDATE

-- Record the version being applied (the row is locked by this
-- transaction since seen.sql).
--
-- 1 version, 2 consumer, 3 aggregate_type, 4 aggregate_id.
UPDATE idem_aggregate_versions
SET version = ?, updated_at = UTC_TIMESTAMP(3)
WHERE consumer = ? AND aggregate_type = ? AND aggregate_id = ?

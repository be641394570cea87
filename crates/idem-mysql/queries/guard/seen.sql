-- The ordering guard, first step: make sure the aggregate has a row (at
-- 0 when it is new) and lock it, so that concurrent deliveries for one
-- aggregate serialise and two first deliveries of a new aggregate cannot
-- both see "nothing yet". The update on a duplicate changes nothing; it
-- is there for the lock.
--
-- 1 consumer, 2 aggregate_type, 3 aggregate_id.
INSERT INTO idem_aggregate_versions (consumer, aggregate_type, aggregate_id, version, updated_at)
VALUES (?, ?, ?, 0, UTC_TIMESTAMP(3))
ON DUPLICATE KEY UPDATE version = version

-- Record a message id for a consumer. A duplicate-key error (1062) means
-- the id was recorded before: a duplicate, and nothing is written.
--
-- 1 consumer, 2 message_id, 3 aggregate_id.
INSERT INTO idem_inbox (consumer, message_id, aggregate_id, processed_at)
VALUES (?, ?, ?, UTC_TIMESTAMP(3))

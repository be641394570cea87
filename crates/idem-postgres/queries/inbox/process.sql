-- Record a message id for a consumer; nothing is written for an id
-- already recorded (a duplicate: 0 rows affected).
--
-- $1 consumer, $2 message_id, $3 aggregate_id.
INSERT INTO idem_inbox (consumer, message_id, aggregate_id)
VALUES ($1, $2, $3)
ON CONFLICT (consumer, message_id) DO NOTHING

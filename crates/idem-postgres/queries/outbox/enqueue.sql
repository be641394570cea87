-- Write one event as the next of its aggregate's sequence. Taking number
-- n locks the aggregate's counter row until the transaction ends, so n + 1
-- is taken only after n committed (or rolled back, freeing n again).
--
-- $1 aggregate_type, $2 aggregate_id, $3 message_type, $4 payload (JSON
-- text), $5 headers (JSON object text). Returns id, sequence.
WITH next AS (
  INSERT INTO idem_outbox_sequences (aggregate_type, aggregate_id, last_sequence)
  VALUES ($1, $2, 1)
  ON CONFLICT (aggregate_type, aggregate_id)
  DO UPDATE SET last_sequence = idem_outbox_sequences.last_sequence + 1
  RETURNING last_sequence)
INSERT INTO idem_outbox (aggregate_type, aggregate_id, sequence, message_type, payload, headers)
SELECT $1, $2, next.last_sequence, $3, $4::jsonb, $5::jsonb FROM next
RETURNING id, sequence

-- Rows as operators see them, oldest first.
--
-- $1 state (NULL: every state), $2 limit.
SELECT id, aggregate_type, aggregate_id, sequence, message_type, state, attempts, last_error,
       to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.MS"Z"') AS created_at
FROM idem_outbox
WHERE ($1::text IS NULL OR state = $1)
ORDER BY id
LIMIT $2

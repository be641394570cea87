-- Reserve, second step: the existing record, with the server's now, for
-- the store to decide on (idem's decide_existing rules). A locking read:
-- it sees the latest committed version even inside a caller's
-- REPEATABLE READ transaction, and waits for a transaction that holds the
-- row uncommitted. No row: deleted since the insert failed; the store
-- inserts again.
--
-- 1 tenant, 2 operation, 3 key.
SELECT tenant, operation, idem_key, fingerprint, state,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', created_at) DIV 1000 AS created_at_ms,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', updated_at) DIV 1000 AS updated_at_ms,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', expires_at) DIV 1000 AS expires_at_ms,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', locked_until) DIV 1000 AS locked_until_ms,
       owner, attempt, response_status, response_headers, response_body,
       resource_id, error_code,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(3)) DIV 1000 AS now_ms
FROM idem_records
WHERE tenant = ? AND operation = ? AND idem_key = ?
FOR UPDATE

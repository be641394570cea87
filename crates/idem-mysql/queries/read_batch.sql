-- Group commit: the records of a batch of reservations, with the server's
-- now, read in the batch's transaction after its inserts. This is the
-- head of the query: the store appends one "(tenant = ? AND operation = ?
-- AND idem_key = ?)" per reservation, joined by OR (schema::READ_BATCH_*),
-- each a primary-key lookup.
--
-- A plain read, not a locking one: the batch holds every one of these
-- rows already (an exclusive lock on those it inserted, the shared lock a
-- duplicate-key error leaves on the others), and its snapshot begins
-- here, after the inserts.
SELECT tenant, operation, idem_key, fingerprint, state,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', created_at) DIV 1000 AS created_at_ms,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', updated_at) DIV 1000 AS updated_at_ms,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', expires_at) DIV 1000 AS expires_at_ms,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', locked_until) DIV 1000 AS locked_until_ms,
       owner, attempt, response_status, response_headers, response_body,
       resource_id, error_code,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(3)) DIV 1000 AS now_ms
FROM idem_records
WHERE

-- List records oldest first, in (created_at, tenant, operation, key)
-- order. Expired final records are left out.
--
-- This is the head of the query: the store appends only the filters a
-- listing asks for (schema::LIST_* fragments, each with its bind), then
-- schema::LIST_TAIL, so that each combination of filters is planned on
-- its own and can use the index that fits it.
SELECT tenant, operation, idem_key, fingerprint, state,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', created_at) DIV 1000 AS created_at_ms,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', updated_at) DIV 1000 AS updated_at_ms,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', expires_at) DIV 1000 AS expires_at_ms,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', locked_until) DIV 1000 AS locked_until_ms,
       owner, attempt, response_status, response_headers, response_body,
       resource_id, error_code
FROM idem_records
WHERE (state = 'processing' OR expires_at > UTC_TIMESTAMP(3))

-- Read one record; a final record past its retention reads as absent.
--
-- 1 tenant, 2 operation, 3 key.
SELECT tenant, operation, idem_key, fingerprint, state,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', created_at) DIV 1000 AS created_at_ms,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', updated_at) DIV 1000 AS updated_at_ms,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', expires_at) DIV 1000 AS expires_at_ms,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', locked_until) DIV 1000 AS locked_until_ms,
       owner, attempt, response_status, response_headers, response_body,
       resource_id, error_code
FROM idem_records
WHERE tenant = ? AND operation = ? AND idem_key = ?
  AND (state = 'processing' OR expires_at > UTC_TIMESTAMP(3))

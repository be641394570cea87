-- Read one record; a final record past its retention reads as absent.
--
-- $1 tenant, $2 operation, $3 key.
SELECT tenant, operation, key, fingerprint, state,
       (extract(epoch FROM created_at) * 1000)::bigint AS created_at_ms,
       (extract(epoch FROM updated_at) * 1000)::bigint AS updated_at_ms,
       (extract(epoch FROM expires_at) * 1000)::bigint AS expires_at_ms,
       (extract(epoch FROM locked_until) * 1000)::bigint AS locked_until_ms,
       owner, attempt, response_status, response_headers, response_body,
       resource_id, error_code
FROM idem_records
WHERE tenant = $1 AND operation = $2 AND key = $3
  AND (state = 'processing' OR expires_at > clock_timestamp())

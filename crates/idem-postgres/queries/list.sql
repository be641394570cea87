-- List records oldest first, in (created_at, tenant, operation, key)
-- order, after a cursor. Expired final records are left out.
--
-- $1 state or NULL, $2 minimum age (ms) or NULL, $3 tenant or NULL,
-- $4 cursor created_at (ms since the epoch) or NULL, $5 cursor tenant,
-- $6 cursor operation, $7 cursor key, $8 limit.
WITH clock AS (
    SELECT clock_timestamp() AS now
)
SELECT tenant, operation, key, fingerprint, state,
       (extract(epoch FROM created_at) * 1000)::bigint AS created_at_ms,
       (extract(epoch FROM updated_at) * 1000)::bigint AS updated_at_ms,
       (extract(epoch FROM expires_at) * 1000)::bigint AS expires_at_ms,
       (extract(epoch FROM locked_until) * 1000)::bigint AS locked_until_ms,
       owner, attempt, response_status, response_headers, response_body,
       resource_id, error_code
FROM idem_records, clock
WHERE ($1::text IS NULL OR state = $1::text)
  AND ($2::bigint IS NULL OR created_at <= clock.now - $2::bigint * interval '1 millisecond')
  AND ($3::text IS NULL OR tenant = $3::text)
  AND (state = 'processing' OR expires_at > clock.now)
  AND ($4::bigint IS NULL
       OR (created_at, tenant, operation, key)
          > (timestamptz 'epoch' + $4::bigint * interval '1 millisecond',
             $5::text, $6::text, $7::text))
ORDER BY created_at, tenant, operation, key
LIMIT $8

-- List records oldest first, in (created_at, tenant, operation, key)
-- order. Expired final records are left out.
--
-- This is the head of the query: the store appends only the filters a
-- listing asks for (schema::LIST_* fragments, each with its bind), then
-- schema::LIST_TAIL. So every combination of filters is planned on its own
-- and uses the index that fits it (idem_records_tenant_created when a
-- tenant is given, idem_records_created otherwise), instead of one
-- generic plan full of "$n IS NULL OR …".
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
WHERE (state = 'processing' OR expires_at > clock.now)

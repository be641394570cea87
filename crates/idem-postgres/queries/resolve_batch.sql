-- Record many final answers at once (group commit): resolve.sql for every
-- element of the arrays, in one statement and one commit.
--
-- $1 tenants, $2 operations, $3 keys, $4 owners, $5 attempts, $6 states,
-- $7 retentions (ms), $8 statuses, $9 headers, $10 bodies,
-- $11 resource ids, $12 error codes: arrays of one length, no
-- (tenant, operation, key) twice, sorted by it.
--
-- Returns "n", the 1-based position, of every element that matched its
-- owner and attempt; an element missing from the answer was fenced.
WITH clock AS (
    SELECT date_trunc('milliseconds', clock_timestamp()) AS now
),
input AS (
    SELECT tenant COLLATE "C" AS tenant, operation COLLATE "C" AS operation,
           key COLLATE "C" AS key, owner, attempt, state, retention_ms, status,
           headers, body, resource_id, error_code, n
    FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::integer[],
                $6::text[], $7::bigint[], $8::integer[], $9::bytea[], $10::bytea[],
                $11::text[], $12::text[])
         WITH ORDINALITY AS i(tenant, operation, key, owner, attempt, state,
                              retention_ms, status, headers, body, resource_id,
                              error_code, n)
)
UPDATE idem_records AS r
SET state = i.state,
    updated_at = clock.now,
    expires_at = clock.now + i.retention_ms * interval '1 millisecond',
    response_status = i.status,
    response_headers = i.headers,
    response_body = i.body,
    resource_id = i.resource_id,
    error_code = i.error_code
FROM input AS i, clock
WHERE r.tenant = i.tenant AND r.operation = i.operation AND r.key = i.key
  AND r.owner = i.owner AND r.attempt = i.attempt
RETURNING i.n

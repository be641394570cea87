-- Reserve many keys at once (group commit): reserve.sql for every element
-- of the arrays, in one statement and one commit.
--
-- $1 tenants, $2 operations, $3 keys, $4 fingerprints, $5 owners,
-- $6 leases (ms), $7 retentions (ms): arrays of one length, one element
-- per reservation, no (tenant, operation, key) twice, sorted by it so
-- that two batches wait on each other's keys in one order, never in a
-- cycle.
--
-- A row comes back per element, "n" its 1-based position, "inserted" as in
-- reserve.sql; an element without a row is asked again on its own.
WITH clock AS (
    SELECT date_trunc('milliseconds', clock_timestamp()) AS now
),
input AS (
    SELECT tenant COLLATE "C" AS tenant, operation COLLATE "C" AS operation,
           key COLLATE "C" AS key, fingerprint, owner, lease_ms, retention_ms, n
    FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::bytea[],
                $6::bigint[], $7::bigint[])
         WITH ORDINALITY AS i(tenant, operation, key, fingerprint, owner,
                              lease_ms, retention_ms, n)
),
inserted AS (
    INSERT INTO idem_records (tenant, operation, key, fingerprint, state, created_at,
                              updated_at, expires_at, locked_until, owner, attempt)
    SELECT i.tenant, i.operation, i.key, i.fingerprint, 'processing', clock.now, clock.now,
           clock.now + i.retention_ms * interval '1 millisecond',
           clock.now + i.lease_ms * interval '1 millisecond',
           i.owner, 1
    FROM input AS i, clock
    ORDER BY i.n
    ON CONFLICT (tenant, operation, key) DO NOTHING
    RETURNING *
),
found AS (
    SELECT i.n, true AS inserted, r.*
    FROM inserted AS r
    JOIN input AS i ON i.tenant = r.tenant AND i.operation = r.operation AND i.key = r.key
    UNION ALL
    SELECT i.n, false AS inserted, r.*
    FROM input AS i
    JOIN idem_records AS r ON r.tenant = i.tenant AND r.operation = i.operation AND r.key = i.key
    WHERE NOT EXISTS (
        SELECT FROM inserted AS x
        WHERE x.tenant = i.tenant AND x.operation = i.operation AND x.key = i.key
    )
)
SELECT n, inserted, tenant, operation, key, fingerprint, state,
       (extract(epoch FROM created_at) * 1000)::bigint AS created_at_ms,
       (extract(epoch FROM updated_at) * 1000)::bigint AS updated_at_ms,
       (extract(epoch FROM expires_at) * 1000)::bigint AS expires_at_ms,
       (extract(epoch FROM locked_until) * 1000)::bigint AS locked_until_ms,
       owner, attempt, response_status, response_headers, response_body,
       resource_id, error_code,
       (SELECT (extract(epoch FROM now) * 1000)::bigint FROM clock) AS now_ms
FROM found

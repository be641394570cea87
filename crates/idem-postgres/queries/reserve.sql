-- Reserve: create the record if absent; otherwise return the existing row
-- with the database's now, for the caller to decide on (idem's
-- decide_existing rules). One statement, one round trip.
--
-- $1 tenant, $2 operation, $3 key, $4 fingerprint, $5 owner,
-- $6 lease (ms), $7 retention (ms).
--
-- Exactly one row comes back, with "inserted" saying which case it is; no
-- row means the conflicting row is not visible to this statement's
-- snapshot (inserted by a transaction that committed meanwhile, or deleted
-- since): the caller asks again.
WITH clock AS (
    SELECT date_trunc('milliseconds', clock_timestamp()) AS now
),
inserted AS (
    INSERT INTO idem_records (tenant, operation, key, fingerprint, state, created_at,
                              updated_at, expires_at, locked_until, owner, attempt)
    SELECT $1, $2, $3, $4, 'processing', clock.now, clock.now,
           clock.now + $7::bigint * interval '1 millisecond',
           clock.now + $6::bigint * interval '1 millisecond',
           $5, 1
    FROM clock
    ON CONFLICT (tenant, operation, key) DO NOTHING
    RETURNING *
)
SELECT true AS inserted, tenant, operation, key, fingerprint, state,
       (extract(epoch FROM created_at) * 1000)::bigint AS created_at_ms,
       (extract(epoch FROM updated_at) * 1000)::bigint AS updated_at_ms,
       (extract(epoch FROM expires_at) * 1000)::bigint AS expires_at_ms,
       (extract(epoch FROM locked_until) * 1000)::bigint AS locked_until_ms,
       owner, attempt, response_status, response_headers, response_body,
       resource_id, error_code,
       (SELECT (extract(epoch FROM now) * 1000)::bigint FROM clock) AS now_ms
FROM inserted
UNION ALL
SELECT false AS inserted, tenant, operation, key, fingerprint, state,
       (extract(epoch FROM created_at) * 1000)::bigint AS created_at_ms,
       (extract(epoch FROM updated_at) * 1000)::bigint AS updated_at_ms,
       (extract(epoch FROM expires_at) * 1000)::bigint AS expires_at_ms,
       (extract(epoch FROM locked_until) * 1000)::bigint AS locked_until_ms,
       owner, attempt, response_status, response_headers, response_body,
       resource_id, error_code,
       (SELECT (extract(epoch FROM now) * 1000)::bigint FROM clock) AS now_ms
FROM idem_records
WHERE tenant = $1 AND operation = $2 AND key = $3
  AND NOT EXISTS (SELECT FROM inserted)

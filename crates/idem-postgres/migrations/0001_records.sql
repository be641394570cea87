-- Version 1: the records table.
--
-- One row per (tenant, operation, key). Every time is a timestamptz taken
-- from the database clock (clock_timestamp(), truncated to whole
-- milliseconds, the unit of idem::Timestamp), never from a client.
-- Text columns use the "C" collation so that ordering is byte order: the
-- same order idem::store::Cursor uses, whatever the database's locale.
CREATE TABLE idem_records (
    tenant           text COLLATE "C" NOT NULL,
    operation        text COLLATE "C" NOT NULL,
    key              text COLLATE "C" NOT NULL,
    fingerprint      bytea       NOT NULL CHECK (octet_length(fingerprint) = 32),
    state            text        NOT NULL CHECK (state IN ('processing', 'completed', 'failed')),
    created_at       timestamptz NOT NULL,
    updated_at       timestamptz NOT NULL,
    expires_at       timestamptz NOT NULL,
    locked_until     timestamptz NOT NULL,
    owner            bytea       NOT NULL CHECK (octet_length(owner) = 16),
    attempt          integer     NOT NULL CHECK (attempt >= 1),
    response_status  integer,
    response_headers bytea,
    response_body    bytea,
    resource_id      text,
    error_code       text,
    PRIMARY KEY (tenant, operation, key)
);

-- Cleanup scans only final records, by expiry.
CREATE INDEX idem_records_expiry ON idem_records (expires_at)
    WHERE state <> 'processing';

-- The stuck-record monitor looks at processing records by last change.
CREATE INDEX idem_records_processing ON idem_records (updated_at)
    WHERE state = 'processing';

-- Operator listings page in (created_at, tenant, operation, key) order,
-- across tenants or within one.
CREATE INDEX idem_records_created ON idem_records (created_at, tenant, operation, key);
CREATE INDEX idem_records_tenant_created ON idem_records (tenant, created_at, operation, key);

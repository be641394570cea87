-- Version 1: the records table.
--
-- One row per (tenant, operation, key). Every time is a DATETIME(3) in UTC
-- taken from the server's clock (UTC_TIMESTAMP(3): whole milliseconds,
-- the unit of idem::Timestamp), never from a client, and never in the
-- session's time zone.
--
-- Tenants, operations and keys are VARBINARY: compared and ordered byte
-- by byte, as idem::store::Cursor orders them, with no collation that
-- would fold case ("Key" and "key" are two keys) or ignore trailing
-- spaces. Fingerprints and owners are fixed-length binary; answers are
-- LONGBLOBs (the server's max_allowed_packet bounds what one statement
-- carries). The table is created only if absent, so a migration cut off
-- half-way (MySQL commits each DDL statement on its own) runs again
-- cleanly.
CREATE TABLE IF NOT EXISTS idem_records (
    tenant           VARBINARY(255) NOT NULL,
    operation        VARBINARY(255) NOT NULL,
    idem_key         VARBINARY(255) NOT NULL,
    fingerprint      BINARY(32)     NOT NULL,
    state            VARCHAR(10) CHARACTER SET ascii NOT NULL,
    created_at       DATETIME(3)    NOT NULL,
    updated_at       DATETIME(3)    NOT NULL,
    expires_at       DATETIME(3)    NOT NULL,
    locked_until     DATETIME(3)    NOT NULL,
    owner            BINARY(16)     NOT NULL,
    attempt          INT            NOT NULL,
    response_status  INT,
    response_headers LONGBLOB,
    response_body    LONGBLOB,
    resource_id      TEXT CHARACTER SET utf8mb4,
    error_code       TEXT CHARACTER SET utf8mb4,
    PRIMARY KEY (tenant, operation, idem_key),
    -- Cleanup scans final records by expiry (MySQL has no partial
    -- indexes: the state leads instead).
    KEY idem_records_expiry (state, expires_at),
    -- The stuck-record monitor looks at processing records by last change.
    KEY idem_records_processing (state, updated_at),
    -- Operator listings page in (created_at, tenant, operation, key)
    -- order, across tenants or within one.
    KEY idem_records_created (created_at, tenant, operation, idem_key),
    KEY idem_records_tenant_created (tenant, created_at, operation, idem_key),
    CONSTRAINT idem_records_state CHECK (state IN ('processing', 'completed', 'failed')),
    CONSTRAINT idem_records_attempt CHECK (attempt >= 1)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

-- Version 1: the records table.
--
-- Times are milliseconds since the Unix epoch from the process clock.
-- The fingerprint is the raw 32-byte SHA-256; the owner the 16-byte token.
-- A rowid table (not WITHOUT ROWID) because stored bodies may be large.
CREATE TABLE idem_records (
    tenant           TEXT    NOT NULL,
    operation        TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    fingerprint      BLOB    NOT NULL,
    state            TEXT    NOT NULL CHECK (state IN ('processing', 'completed', 'failed')),
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    expires_at       INTEGER NOT NULL,
    locked_until     INTEGER NOT NULL,
    owner            BLOB    NOT NULL,
    attempt          INTEGER NOT NULL,
    response_status  INTEGER,
    response_headers BLOB,
    response_body    BLOB,
    resource_id      TEXT,
    error_code       TEXT,
    UNIQUE (tenant, operation, key)
);

-- Cleanup scans only final records by expiry.
CREATE INDEX idem_records_expiry ON idem_records (expires_at) WHERE state <> 'processing';

-- Operator listings page in creation order.
CREATE INDEX idem_records_created ON idem_records (created_at, tenant, operation, key);

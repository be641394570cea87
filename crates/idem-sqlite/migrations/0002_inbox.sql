-- Version 2: the transactional inbox for consumers whose business data
-- lives in this SQLite file. processed_at is milliseconds since the epoch.
CREATE TABLE idem_inbox (
    consumer     TEXT NOT NULL,
    message_id   TEXT NOT NULL,
    aggregate_id TEXT,
    processed_at INTEGER NOT NULL,
    PRIMARY KEY (consumer, message_id)
) WITHOUT ROWID;

CREATE INDEX idem_inbox_processed ON idem_inbox (processed_at);

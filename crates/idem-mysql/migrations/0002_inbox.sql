-- Version 2: the transactional inbox.
--
-- One row per message a consumer has processed, written in the same
-- transaction as the consumer's business change: a redelivery finds its
-- row and is a duplicate. Names and ids are VARBINARY, so they compare
-- byte by byte, case and trailing spaces included.
CREATE TABLE IF NOT EXISTS idem_inbox (
    consumer     VARBINARY(255) NOT NULL,
    message_id   VARBINARY(255) NOT NULL,
    aggregate_id TEXT CHARACTER SET utf8mb4,
    processed_at DATETIME(3)    NOT NULL,
    PRIMARY KEY (consumer, message_id),
    -- Retention deletes the oldest rows first.
    KEY idem_inbox_processed (processed_at)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

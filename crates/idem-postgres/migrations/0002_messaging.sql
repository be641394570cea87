-- Version 2: the transactional inbox, the outbox and the ordering guard.

-- One row per message a consumer has processed, written in the same
-- transaction as the consumer's business change: a redelivery finds its
-- row and is a duplicate.
CREATE TABLE idem_inbox (
    consumer     text COLLATE "C" NOT NULL,
    message_id   text COLLATE "C" NOT NULL,
    aggregate_id text,
    processed_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (consumer, message_id)
);

-- Retention deletes the oldest rows first.
CREATE INDEX idem_inbox_processed ON idem_inbox (processed_at);

-- Outgoing events, written in the same transaction as the change they
-- announce; the relay publishes them.
CREATE TABLE idem_outbox (
    id             bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    -- 1, 2, 3… per (aggregate_type, aggregate_id), in commit order: the
    -- enqueue that takes number n holds the aggregate's counter row until
    -- it commits, so n + 1 is taken only after n is visible.
    sequence       bigint NOT NULL,
    message_type   text NOT NULL,
    payload        jsonb NOT NULL,
    headers        jsonb NOT NULL DEFAULT '{}'::jsonb,
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    available_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    published_at   timestamptz,
    attempts       integer NOT NULL DEFAULT 0,
    last_error     text,
    state          text NOT NULL DEFAULT 'pending'
                   CHECK (state IN ('pending', 'published', 'dead')),
    UNIQUE (aggregate_type, aggregate_id, sequence)
);

-- The relay looks only at unpublished rows, by aggregate and order.
CREATE INDEX idem_outbox_pending ON idem_outbox (aggregate_type, aggregate_id, sequence)
    WHERE state = 'pending';

-- Retention deletes published rows by age.
CREATE INDEX idem_outbox_published ON idem_outbox (published_at)
    WHERE state = 'published';

-- The last sequence number given out per aggregate.
CREATE TABLE idem_outbox_sequences (
    aggregate_type text NOT NULL,
    aggregate_id   text NOT NULL,
    last_sequence  bigint NOT NULL,
    PRIMARY KEY (aggregate_type, aggregate_id)
);

-- The last version of each aggregate a consumer applied.
CREATE TABLE idem_aggregate_versions (
    consumer     text COLLATE "C" NOT NULL,
    aggregate_id text COLLATE "C" NOT NULL,
    version      bigint NOT NULL CHECK (version >= 0),
    updated_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (consumer, aggregate_id)
);

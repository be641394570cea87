-- Version 4: wake-ups for idle relays without a notification per commit,
-- and an index of dead outbox rows.
--
-- A relay that finds nothing to publish registers here before it waits,
-- with a deadline a little past its fallback poll. While any registration
-- is live, a statement that inserts outbox rows sends one notification on
-- channel 'idem_outbox' (payload: the outbox's schema) when its transaction
-- commits. While every relay is busy there are no registrations and no
-- notifications, so business commits never queue on PostgreSQL's
-- notification lock (a NOTIFY per row or per commit would make every
-- committing transaction take it).
CREATE TABLE idem_outbox_listeners (
    relay text PRIMARY KEY,
    until timestamptz NOT NULL
);

CREATE FUNCTION idem_outbox_wake() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    listening boolean;
BEGIN
    EXECUTE format(
        'SELECT EXISTS (SELECT 1 FROM %I.idem_outbox_listeners WHERE until > clock_timestamp())',
        TG_TABLE_SCHEMA)
    INTO listening;
    IF listening THEN
        PERFORM pg_notify('idem_outbox', TG_TABLE_SCHEMA);
    END IF;
    RETURN NULL;
END
$$;

-- Once per INSERT statement, not per row.
CREATE TRIGGER idem_outbox_wake AFTER INSERT ON idem_outbox
    FOR EACH STATEMENT EXECUTE FUNCTION idem_outbox_wake();

-- The relay skips an aggregate with a dead row (under its "block" rule)
-- without scanning the aggregate's history.
CREATE INDEX idem_outbox_dead ON idem_outbox (aggregate_type, aggregate_id)
    WHERE state = 'dead';

-- An idle relay asks inserting statements to notify until a deadline
-- (migration 4's trigger); registering again moves the deadline.
--
-- $1 the relay's id, $2 how long the registration lasts, in milliseconds.
INSERT INTO idem_outbox_listeners (relay, until)
VALUES ($1, clock_timestamp() + $2::bigint * interval '1 millisecond')
ON CONFLICT (relay) DO UPDATE SET until = EXCLUDED.until

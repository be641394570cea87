-- The relays of one outbox connected now, counted by the application name
-- of their lock sessions.
--
-- $1 application_name.
SELECT count(*) FROM pg_stat_activity
WHERE application_name = $1 AND datname = current_database()

-- Delete at most ? inbox rows processed more than ? milliseconds ago,
-- oldest first, of every consumer.
--
-- 1 retention (ms), 2 batch size.
DELETE FROM idem_inbox
WHERE processed_at < TIMESTAMPADD(MICROSECOND, -(? * 1000), UTC_TIMESTAMP(3))
ORDER BY processed_at
LIMIT ?

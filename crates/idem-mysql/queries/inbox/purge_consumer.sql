-- Delete at most ? inbox rows of one consumer processed more than ?
-- milliseconds ago, oldest first.
--
-- 1 consumer, 2 retention (ms), 3 batch size.
DELETE FROM idem_inbox
WHERE consumer = ?
  AND processed_at < TIMESTAMPADD(MICROSECOND, -(? * 1000), UTC_TIMESTAMP(3))
ORDER BY processed_at
LIMIT ?

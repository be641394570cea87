-- Delete at most ? final records past their retention; never a
-- processing one (outcome-unknown records above all).
--
-- 1 batch size.
DELETE FROM idem_records
WHERE state IN ('completed', 'failed') AND expires_at <= UTC_TIMESTAMP(3)
LIMIT ?

-- An operator deletes one record, whatever its state.
--
-- 1 tenant, 2 operation, 3 key.
DELETE FROM idem_records
WHERE tenant = ? AND operation = ? AND idem_key = ?

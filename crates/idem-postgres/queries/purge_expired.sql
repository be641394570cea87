-- Delete at most $1 final records past their retention; never a
-- processing one (outcome-unknown records above all). Rows another
-- cleaner is deleting right now are skipped, not waited for.
DELETE FROM idem_records AS r
USING (
    SELECT tenant, operation, key
    FROM idem_records
    WHERE state <> 'processing' AND expires_at <= clock_timestamp()
    LIMIT $1
    FOR UPDATE SKIP LOCKED
) AS doomed
WHERE r.tenant = doomed.tenant AND r.operation = doomed.operation AND r.key = doomed.key
  AND r.state <> 'processing' AND r.expires_at <= clock_timestamp()

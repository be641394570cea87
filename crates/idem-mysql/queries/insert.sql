-- Reserve, first step: create the record if absent. A duplicate-key
-- error (1062) means the record exists; the store then reads it
-- (read_existing.sql). The primary key makes this the one atomic
-- create-if-absent: of two racers, exactly one inserts.
--
-- 1 tenant, 2 operation, 3 key, 4 fingerprint, 5 retention (ms),
-- 6 lease (ms), 7 owner.
INSERT INTO idem_records (tenant, operation, idem_key, fingerprint, state, created_at,
                          updated_at, expires_at, locked_until, owner, attempt)
VALUES (?, ?, ?, ?, 'processing', UTC_TIMESTAMP(3), UTC_TIMESTAMP(3),
        TIMESTAMPADD(MICROSECOND, ? * 1000, UTC_TIMESTAMP(3)),
        TIMESTAMPADD(MICROSECOND, ? * 1000, UTC_TIMESTAMP(3)),
        ?, 1)

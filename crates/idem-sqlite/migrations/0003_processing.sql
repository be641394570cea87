-- Version 3: processing records by listing order.
--
-- The stuck-record monitor lists the processing records every 30 s (and
-- operators list them by hand); with only idem_records_created to use, that
-- listing read every record stored. Processing records are the few in
-- flight, so this index stays small.
CREATE INDEX idem_records_processing ON idem_records (created_at, tenant, operation, key)
    WHERE state = 'processing';

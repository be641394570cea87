-- Version 3: aggregate versions are kept per aggregate type as well, as
-- outbox sequences are: "order 42" and "payment 42" are two aggregates.
ALTER TABLE idem_aggregate_versions
    ADD COLUMN aggregate_type text COLLATE "C" NOT NULL DEFAULT '';
ALTER TABLE idem_aggregate_versions DROP CONSTRAINT idem_aggregate_versions_pkey;
ALTER TABLE idem_aggregate_versions ADD PRIMARY KEY (consumer, aggregate_type, aggregate_id);
ALTER TABLE idem_aggregate_versions ALTER COLUMN aggregate_type DROP DEFAULT;

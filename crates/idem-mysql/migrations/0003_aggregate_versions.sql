-- Version 3: the ordering guard's table.
--
-- The last version of each aggregate (per aggregate type) a consumer
-- applied. An aggregate first met through a later version is recorded at
-- 0: its first version has not come yet.
CREATE TABLE IF NOT EXISTS idem_aggregate_versions (
    consumer       VARBINARY(255) NOT NULL,
    aggregate_type VARBINARY(255) NOT NULL,
    aggregate_id   VARBINARY(255) NOT NULL,
    version        BIGINT         NOT NULL,
    updated_at     DATETIME(3)    NOT NULL,
    PRIMARY KEY (consumer, aggregate_type, aggregate_id),
    CONSTRAINT idem_aggregate_versions_version CHECK (version >= 0)
) ENGINE = InnoDB DEFAULT CHARSET = utf8mb4;

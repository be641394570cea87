//! Schema migrations, named queries and row mapping.
//!
//! Migrations are our own small runner rather than `sqlx::migrate!`: the
//! version lives in a table of its own, `idem_schema_migrations`, so that an
//! application that runs its own sqlx migrations in the same database
//! (sqlx's `_sqlx_migrations`) never sees foreign versions, and no
//! compile-time macro crate is needed.

use idem::store::Migrated;
use idem::{
    Fingerprint, IdempotencyKey, Lease, OwnerToken, Record, RecordState, Scope, StoredResponse,
    Timestamp,
};
use sqlx::pool::PoolConnection;
use sqlx::postgres::PgRow;
use sqlx::{Connection, Executor, Postgres, Row};

use crate::PgError;

/// Migrations in order; migration `i` brings the schema to version `i + 1`.
const MIGRATIONS: &[(&str, &str)] = &[
    (
        "records table",
        include_str!("../migrations/0001_records.sql"),
    ),
    (
        "inbox, outbox and aggregate versions",
        include_str!("../migrations/0002_messaging.sql"),
    ),
    (
        "aggregate versions per aggregate type",
        include_str!("../migrations/0003_versions_by_type.sql"),
    ),
    (
        "outbox wake-ups for idle relays, index of dead rows",
        include_str!("../migrations/0004_outbox_wakeups.sql"),
    ),
    (
        "random event ids for outbox rows",
        include_str!("../migrations/0005_outbox_event_ids.sql"),
    ),
];

/// The schema version this build writes.
pub(crate) const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// The advisory lock every migrating process takes, so that gateways
/// starting together migrate one after the other ("idem" in ASCII).
const MIGRATION_LOCK: i64 = 0x6964_656d;

const CREATE_VERSION_TABLE: &str = "CREATE TABLE IF NOT EXISTS idem_schema_migrations (\
     version integer PRIMARY KEY, \
     description text NOT NULL, \
     applied_at timestamptz NOT NULL DEFAULT now())";

/// Brings the schema to [`SCHEMA_VERSION`] in one transaction: concurrent
/// migrators serialise on an advisory lock, and a failed migration leaves
/// nothing half-done.
pub(crate) async fn migrate(
    mut conn: PoolConnection<Postgres>,
    schema: Option<String>,
) -> Result<Migrated, PgError> {
    let mut tx = conn.begin().await?;
    // `IF NOT EXISTS` on what exists is a NOTICE ("already exists,
    // skipping"), which the driver logs: not news on a second run.
    sqlx::query("SET LOCAL client_min_messages = warning")
        .execute(&mut *tx)
        .await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(MIGRATION_LOCK)
        .execute(&mut *tx)
        .await?;
    if let Some(schema) = schema {
        let create = format!("CREATE SCHEMA IF NOT EXISTS {}", quote_ident(&schema));
        (&mut *tx).execute(create.as_str()).await?;
    }
    sqlx::query(CREATE_VERSION_TABLE).execute(&mut *tx).await?;
    let found: i64 =
        sqlx::query_scalar("SELECT COALESCE(max(version), 0)::bigint FROM idem_schema_migrations")
            .fetch_one(&mut *tx)
            .await?;
    if found > SCHEMA_VERSION {
        return Err(PgError::SchemaTooNew {
            found,
            supported: SCHEMA_VERSION,
        });
    }
    for (i, (description, sql)) in MIGRATIONS
        .iter()
        .enumerate()
        .skip(usize::try_from(found).unwrap_or(0))
    {
        let version = i as i64 + 1;
        let failed = |source| PgError::Migrate { version, source };
        // Without bind parameters the simple-query protocol runs every
        // statement of the file.
        (&mut *tx).execute(*sql).await.map_err(failed)?;
        sqlx::query("INSERT INTO idem_schema_migrations (version, description) VALUES ($1, $2)")
            .bind(version as i32)
            .bind(*description)
            .execute(&mut *tx)
            .await
            .map_err(failed)?;
    }
    tx.commit().await?;
    Ok(Migrated {
        from: found,
        to: SCHEMA_VERSION,
    })
}

/// A schema name as a quoted SQL identifier.
pub(crate) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

pub(crate) const RESERVE: &str = include_str!("../queries/reserve.sql");
pub(crate) const TAKE_OVER: &str = include_str!("../queries/take_over.sql");
pub(crate) const REPLACE_EXPIRED: &str = include_str!("../queries/replace_expired.sql");
pub(crate) const RESOLVE: &str = include_str!("../queries/resolve.sql");
pub(crate) const RESERVE_BATCH: &str = include_str!("../queries/reserve_batch.sql");
pub(crate) const RESOLVE_BATCH: &str = include_str!("../queries/resolve_batch.sql");
pub(crate) const RELEASE: &str = include_str!("../queries/release.sql");
pub(crate) const MARK_UNKNOWN: &str = include_str!("../queries/mark_unknown.sql");
pub(crate) const RENEW: &str = include_str!("../queries/renew.sql");
pub(crate) const GET: &str = include_str!("../queries/get.sql");
pub(crate) const AUTOVACUUM_ON: &str = include_str!("../queries/autovacuum_on.sql");
pub(crate) const RECORD_PAGES: &str = include_str!("../queries/record_pages.sql");
pub(crate) const ANALYZE_RECORDS: &str = "ANALYZE idem_records";
pub(crate) const RECORDS_ANALYZED: &str = include_str!("../queries/records_analyzed.sql");
pub(crate) const LIST: &str = include_str!("../queries/list.sql");
/// `LIST` filters: each is followed by its bind, then by its `_END` (if any);
/// `LIST_STATE` by the state as a quoted literal instead (see `list`).
pub(crate) const LIST_STATE: &str = " AND state = ";
pub(crate) const LIST_OLDER_THAN: &str = " AND created_at <= clock.now - ";
pub(crate) const LIST_OLDER_THAN_END: &str = "::bigint * interval '1 millisecond'";
pub(crate) const LIST_TENANT: &str = " AND tenant = ";
/// The cursor: binds created_at (ms), tenant, operation, key in between.
pub(crate) const LIST_AFTER: [&str; 5] = [
    " AND (created_at, tenant, operation, key) > (timestamptz 'epoch' + ",
    "::bigint * interval '1 millisecond', ",
    "::text, ",
    "::text, ",
    "::text)",
];
/// Then the limit's bind.
pub(crate) const LIST_TAIL: &str = " ORDER BY created_at, tenant, operation, key LIMIT ";
pub(crate) const PURGE_EXPIRED: &str = include_str!("../queries/purge_expired.sql");
pub(crate) const DELETE: &str = include_str!("../queries/delete.sql");

fn corrupt(what: impl std::fmt::Display) -> PgError {
    PgError::Corrupt(what.to_string())
}

/// Maps one row carrying the record columns (as the queries name them).
pub(crate) fn record_from_row(row: &PgRow) -> Result<Record, PgError> {
    let tenant: String = row.try_get("tenant")?;
    let operation: String = row.try_get("operation")?;
    let scope = Scope::new(&tenant, &operation).map_err(corrupt)?;
    let key: String = row.try_get("key")?;
    let key: IdempotencyKey = key.parse().map_err(corrupt)?;
    let fingerprint: Vec<u8> = row.try_get("fingerprint")?;
    let fingerprint: [u8; 32] = fingerprint
        .try_into()
        .map_err(|_| corrupt("fingerprint is not 32 bytes"))?;
    let state: String = row.try_get("state")?;
    let state: RecordState = state.parse().map_err(corrupt)?;
    let owner: Vec<u8> = row.try_get("owner")?;
    let owner: [u8; 16] = owner
        .try_into()
        .map_err(|_| corrupt("owner is not 16 bytes"))?;
    let attempt: i32 = row.try_get("attempt")?;
    let attempt =
        u32::try_from(attempt).map_err(|_| corrupt(format!("attempt {attempt} is negative")))?;
    let status: Option<i32> = row.try_get("response_status")?;
    let response = match status {
        None => None,
        Some(status) => {
            let status = u16::try_from(status)
                .map_err(|_| corrupt(format!("response status {status} out of range")))?;
            let headers: Option<Vec<u8>> = row.try_get("response_headers")?;
            let headers = StoredResponse::decode_headers(headers.as_deref().unwrap_or_default())
                .map_err(corrupt)?;
            let body: Option<Vec<u8>> = row.try_get("response_body")?;
            Some(StoredResponse {
                status,
                headers,
                body: body.unwrap_or_default().into(),
            })
        }
    };
    let ms = |column: &str| -> Result<Timestamp, PgError> {
        Ok(Timestamp::from_millis(row.try_get::<i64, _>(column)?))
    };
    Ok(Record {
        scope,
        key,
        fingerprint: Fingerprint::from_digest(fingerprint),
        state,
        created_at: ms("created_at_ms")?,
        updated_at: ms("updated_at_ms")?,
        expires_at: ms("expires_at_ms")?,
        lease: Lease {
            owner: OwnerToken::from_bytes(owner),
            attempt,
            locked_until: ms("locked_until_ms")?,
        },
        response,
        resource_id: row.try_get("resource_id")?,
        error_code: row.try_get("error_code")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted() {
        assert_eq!(quote_ident("idem"), "\"idem\"");
        assert_eq!(quote_ident("a\"b"), "\"a\"\"b\"");
    }
}

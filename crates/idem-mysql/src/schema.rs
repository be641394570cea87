//! Schema migrations, named queries and row mapping.
//!
//! Migrations are our own small runner rather than `sqlx::migrate!`: the
//! version lives in a table of its own, `idem_schema_migrations`, so that
//! an application that runs its own sqlx migrations in the same database
//! never sees foreign versions, and no compile-time macro crate is needed.
//! MySQL commits every DDL statement on its own, so a migration is not
//! one transaction: each is written to be re-run safely (`CREATE TABLE IF
//! NOT EXISTS`), and its version is recorded once it completed.

use idem::store::Migrated;
use idem::{
    Fingerprint, IdempotencyKey, Lease, OwnerToken, Record, RecordState, Scope, StoredResponse,
    Timestamp,
};
use sqlx::mysql::MySqlRow;
use sqlx::pool::PoolConnection;
use sqlx::{Executor, MySql, Row};

use crate::MySqlError;

/// Migrations in order; migration `i` brings the schema to version `i + 1`.
const MIGRATIONS: &[(&str, &str)] = &[
    (
        "records table",
        include_str!("../migrations/0001_records.sql"),
    ),
    ("inbox", include_str!("../migrations/0002_inbox.sql")),
    (
        "aggregate versions for the ordering guard",
        include_str!("../migrations/0003_aggregate_versions.sql"),
    ),
];

/// The schema version this build writes.
pub(crate) const SCHEMA_VERSION: i64 = MIGRATIONS.len() as i64;

/// How long a migrator waits for another one to finish, in seconds.
const MIGRATION_LOCK_WAIT_S: i64 = 60;

/// The named lock every migrating process takes, so that gateways
/// starting together migrate one after the other. Lock names are
/// server-wide, so the name is per database, and MySQL refuses names
/// over 64 characters, so the database's name enters it hashed.
const TAKE_MIGRATION_LOCK: &str = "SELECT GET_LOCK(CONCAT('idem_migrate:', SHA1(DATABASE())), ?)";
const RELEASE_MIGRATION_LOCK: &str =
    "SELECT RELEASE_LOCK(CONCAT('idem_migrate:', SHA1(DATABASE())))";

const CREATE_VERSION_TABLE: &str = "CREATE TABLE IF NOT EXISTS idem_schema_migrations (\
     version INT PRIMARY KEY, \
     description VARCHAR(255) NOT NULL, \
     applied_at DATETIME(6) NOT NULL) ENGINE = InnoDB";
const CURRENT_VERSION: &str =
    "SELECT CAST(COALESCE(MAX(version), 0) AS SIGNED) FROM idem_schema_migrations";
const RECORD_VERSION: &str = "INSERT INTO idem_schema_migrations (version, description, applied_at) \
     VALUES (?, ?, UTC_TIMESTAMP(6))";

/// Brings the schema to [`SCHEMA_VERSION`]: concurrent migrators take
/// turns on a named lock, held by this connection's session and released
/// whatever happens (or the connection is closed, which releases it too).
pub(crate) async fn migrate(mut conn: PoolConnection<MySql>) -> Result<Migrated, MySqlError> {
    let got: Option<i64> = sqlx::query_scalar(TAKE_MIGRATION_LOCK)
        .bind(MIGRATION_LOCK_WAIT_S)
        .fetch_one(&mut *conn)
        .await?;
    if got != Some(1) {
        return Err(MySqlError::Sqlx(sqlx::Error::Protocol(format!(
            "another process held the idem migration lock for {MIGRATION_LOCK_WAIT_S} s"
        ))));
    }
    let migrated = migrate_locked(&mut conn).await;
    let released = sqlx::query_scalar::<_, Option<i64>>(RELEASE_MIGRATION_LOCK)
        .fetch_one(&mut *conn)
        .await;
    if released.is_err() {
        // Closing the session is what releases the lock now.
        drop(conn.detach());
    }
    migrated
}

async fn migrate_locked(conn: &mut PoolConnection<MySql>) -> Result<Migrated, MySqlError> {
    (&mut **conn).execute(CREATE_VERSION_TABLE).await?;
    let found: i64 = sqlx::query_scalar(CURRENT_VERSION)
        .fetch_one(&mut **conn)
        .await?;
    if found > SCHEMA_VERSION {
        return Err(MySqlError::SchemaTooNew {
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
        let failed = |source| MySqlError::Migrate { version, source };
        // Without bind parameters the text protocol runs every statement
        // of the file.
        (&mut **conn).execute(*sql).await.map_err(failed)?;
        sqlx::query(RECORD_VERSION)
            .bind(version)
            .bind(*description)
            .execute(&mut **conn)
            .await
            .map_err(failed)?;
    }
    Ok(Migrated {
        from: found,
        to: SCHEMA_VERSION,
    })
}

pub(crate) const INSERT: &str = include_str!("../queries/insert.sql");
pub(crate) const READ_EXISTING: &str = include_str!("../queries/read_existing.sql");
pub(crate) const READ_LEASE: &str = include_str!("../queries/read_lease.sql");
pub(crate) const TAKE_OVER: &str = include_str!("../queries/take_over.sql");
pub(crate) const REPLACE_EXPIRED: &str = include_str!("../queries/replace_expired.sql");
pub(crate) const RESOLVE: &str = include_str!("../queries/resolve.sql");
pub(crate) const RELEASE: &str = include_str!("../queries/release.sql");
pub(crate) const MARK_UNKNOWN: &str = include_str!("../queries/mark_unknown.sql");
pub(crate) const RENEW: &str = include_str!("../queries/renew.sql");
pub(crate) const READ_BATCH: &str = include_str!("../queries/read_batch.sql");
/// One record of `READ_BATCH`: binds its tenant, operation and key in
/// between.
pub(crate) const READ_BATCH_RECORD: [&str; 4] =
    ["(tenant = ", " AND operation = ", " AND idem_key = ", ")"];
pub(crate) const GET: &str = include_str!("../queries/get.sql");
pub(crate) const LIST: &str = include_str!("../queries/list.sql");
/// `LIST` filters: each is followed by its bind, then by its `_END` (if any).
pub(crate) const LIST_STATE: &str = " AND state = ";
pub(crate) const LIST_OLDER_THAN: &str = " AND created_at <= TIMESTAMPADD(MICROSECOND, -1000 * ";
pub(crate) const LIST_OLDER_THAN_END: &str = ", UTC_TIMESTAMP(3))";
pub(crate) const LIST_TENANT: &str = " AND tenant = ";
/// The cursor: binds created_at (ms), tenant, operation, key in between.
pub(crate) const LIST_AFTER: [&str; 5] = [
    " AND (created_at, tenant, operation, idem_key) > (TIMESTAMPADD(MICROSECOND, 1000 * ",
    ", '1970-01-01 00:00:00'), CAST(",
    " AS BINARY), CAST(",
    " AS BINARY), CAST(",
    " AS BINARY))",
];
/// Then the limit's bind.
pub(crate) const LIST_TAIL: &str = " ORDER BY created_at, tenant, operation, idem_key LIMIT ";
pub(crate) const PURGE_EXPIRED: &str = include_str!("../queries/purge_expired.sql");
pub(crate) const DELETE: &str = include_str!("../queries/delete.sql");

fn corrupt(what: impl std::fmt::Display) -> MySqlError {
    MySqlError::Corrupt(what.to_string())
}

/// A text column, stored as bytes: what is not UTF-8 is corrupt.
fn text(row: &MySqlRow, column: &str) -> Result<String, MySqlError> {
    let bytes: Vec<u8> = row.try_get(column)?;
    String::from_utf8(bytes).map_err(|_| corrupt(format!("{column} is not UTF-8")))
}

/// An optional text column, stored as bytes.
fn optional_text(row: &MySqlRow, column: &str) -> Result<Option<String>, MySqlError> {
    let bytes: Option<Vec<u8>> = row.try_get(column)?;
    bytes
        .map(|b| String::from_utf8(b).map_err(|_| corrupt(format!("{column} is not UTF-8"))))
        .transpose()
}

/// A time column in milliseconds since the epoch (the queries name them
/// `*_ms`).
pub(crate) fn millis_column(row: &MySqlRow, column: &str) -> Result<Timestamp, MySqlError> {
    Ok(Timestamp::from_millis(row.try_get::<i64, _>(column)?))
}

/// An attempt number as stored; never below 1.
pub(crate) fn attempt_column(row: &MySqlRow) -> Result<u32, MySqlError> {
    let attempt: i32 = row.try_get("attempt")?;
    u32::try_from(attempt)
        .ok()
        .filter(|a| *a >= 1)
        .ok_or_else(|| corrupt(format!("attempt {attempt} is not a positive number")))
}

/// Maps one row carrying the record columns (as the queries name them).
pub(crate) fn record_from_row(row: &MySqlRow) -> Result<Record, MySqlError> {
    let tenant = text(row, "tenant")?;
    let operation = text(row, "operation")?;
    let scope = Scope::new(&tenant, &operation).map_err(corrupt)?;
    let key: IdempotencyKey = text(row, "idem_key")?.parse().map_err(corrupt)?;
    let fingerprint: Vec<u8> = row.try_get("fingerprint")?;
    let fingerprint: [u8; 32] = fingerprint
        .try_into()
        .map_err(|_| corrupt("fingerprint is not 32 bytes"))?;
    let state: RecordState = text(row, "state")?.parse().map_err(corrupt)?;
    let owner: Vec<u8> = row.try_get("owner")?;
    let owner: [u8; 16] = owner
        .try_into()
        .map_err(|_| corrupt("owner is not 16 bytes"))?;
    let attempt = attempt_column(row)?;
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
    Ok(Record {
        scope,
        key,
        fingerprint: Fingerprint::from_digest(fingerprint),
        state,
        created_at: millis_column(row, "created_at_ms")?,
        updated_at: millis_column(row, "updated_at_ms")?,
        expires_at: millis_column(row, "expires_at_ms")?,
        lease: Lease {
            owner: OwnerToken::from_bytes(owner),
            attempt,
            locked_until: millis_column(row, "locked_until_ms")?,
        },
        response,
        resource_id: optional_text(row, "resource_id")?,
        error_code: optional_text(row, "error_code")?,
    })
}

//! Errors of the MySQL store and how they map onto [`StoreError`].

use std::time::Duration;

use idem::StoreError;
use sqlx::mysql::MySqlDatabaseError;

/// What went wrong configuring, connecting to, migrating or using the
/// MySQL store. Every message that names the server shows its URL with the
/// password replaced by `***`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MySqlError {
    /// The store URL or an option is not understood.
    #[error("invalid MySQL store URL {url}: {reason}")]
    Url {
        /// The URL given, password redacted.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The server could not be reached or refused the connection.
    #[error("cannot connect to MySQL at {url}: {reason}")]
    Connect {
        /// The server's URL, password redacted.
        url: String,
        /// A one-line explanation (refused, unknown database, bad credentials…).
        reason: String,
        /// The driver's error, if there is one (none for a timeout).
        #[source]
        source: Option<sqlx::Error>,
    },
    /// The database holds a schema written by a newer idem.
    #[error(
        "the idem schema in this database is version {found}, newer than the {supported} this build supports; upgrade idem"
    )]
    SchemaTooNew {
        /// Version found in `idem_schema_migrations`.
        found: i64,
        /// Newest version this build knows.
        supported: i64,
    },
    /// Applying a migration failed.
    #[error("migrating the idem schema to version {version} failed: {source}")]
    Migrate {
        /// The version being applied.
        version: i64,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// A row holds something this build cannot interpret.
    #[error("idem_records holds an unreadable row: {0}")]
    Corrupt(String),
    /// The reservation kept losing races against concurrent changes of the
    /// same record (never expected in practice: each retry follows a change
    /// made by someone else).
    #[error("reservation gave up after {0} rounds of concurrent changes to the same record")]
    Contention(u32),
    /// The database has no idem tables yet (or not this one): the schema
    /// was never migrated.
    #[error("{}", not_migrated(.table))]
    NotMigrated {
        /// The missing table, as the server named it.
        table: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// Any other driver error.
    #[error(transparent)]
    Sqlx(sqlx::Error),
}

/// Every driver error enters here, so that a missing idem table reads as
/// the missing migration it is, whatever the query.
impl From<sqlx::Error> for MySqlError {
    fn from(source: sqlx::Error) -> Self {
        match missing_idem_table(&source) {
            Some(table) => Self::NotMigrated { table, source },
            None => Self::Sqlx(source),
        }
    }
}

/// The one message for a database without the idem schema: what is
/// missing, and how to create it.
fn not_migrated(table: &str) -> String {
    format!(
        "the idem schema is not in this database (table {table:?} does not exist): create it once with `idem migrate --store URL` (or MySqlStore::migrate, or connect with migrate=true)"
    )
}

/// The server's error number of a driver error (1062 duplicate key, 1213
/// deadlock…), if it is a server error.
pub(crate) fn error_number(err: &sqlx::Error) -> Option<u16> {
    let sqlx::Error::Database(db) = err else {
        return None;
    };
    db.try_downcast_ref::<MySqlDatabaseError>()
        .map(MySqlDatabaseError::number)
}

/// ER_DUP_ENTRY: an insert met an existing primary key.
pub(crate) const DUPLICATE_KEY: u16 = 1062;
/// ER_LOCK_DEADLOCK: InnoDB rolled the transaction back to break a cycle.
pub(crate) const DEADLOCK: u16 = 1213;
/// ER_LOCK_WAIT_TIMEOUT: a row lock was not granted in time.
pub(crate) const LOCK_WAIT_TIMEOUT: u16 = 1205;
/// ER_NO_SUCH_TABLE.
const NO_SUCH_TABLE: u16 = 1146;

/// The idem table an ER_NO_SUCH_TABLE error names, if any: the sign of a
/// schema never migrated. A missing table of the caller's own is not ours
/// to explain.
fn missing_idem_table(err: &sqlx::Error) -> Option<String> {
    if error_number(err) != Some(NO_SUCH_TABLE) {
        return None;
    }
    let sqlx::Error::Database(db) = err else {
        return None;
    };
    // "Table 'db.idem_records' doesn't exist"
    let quoted = db.message().split('\'').nth(1)?;
    let table = quoted.rsplit('.').next().unwrap_or(quoted);
    table.starts_with("idem_").then(|| quoted.to_owned())
}

impl MySqlError {
    /// Whether trying again later may succeed: the server is down, busy
    /// or restarting, the connection broke, or InnoDB broke a deadlock.
    /// Not for a refusal that stays until someone changes something (bad
    /// credentials, no such database, a schema never migrated or too new).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Connect { source: None, .. } | Self::Contention(_) => true,
            Self::Connect {
                source: Some(source),
                ..
            }
            | Self::Migrate { source, .. }
            | Self::Sqlx(source) => sqlx_is_transient(source),
            _ => false,
        }
    }

    /// A connection failure, explained in one line.
    pub(crate) fn connect(url: &str, source: sqlx::Error) -> Self {
        Self::Connect {
            url: idem::store::redact_url(url),
            reason: connect_reason(&source),
            source: Some(source),
        }
    }

    /// No connection within the connect timeout.
    pub(crate) fn connect_timeout(url: &str, after: Duration) -> Self {
        Self::Connect {
            url: idem::store::redact_url(url),
            reason: format!(
                "no connection within {after:?} (is the server up, and the host and port right?)"
            ),
            source: None,
        }
    }
}

/// What went wrong in the inbox or the ordering guard.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MessagingError {
    /// A message, id or name was refused before it reached the database.
    #[error("invalid {field}: {reason}")]
    InvalidMessage {
        /// Which field.
        field: &'static str,
        /// Why.
        reason: String,
    },
    /// The database has no idem tables yet: the schema was never migrated.
    #[error("{}", not_migrated(.table))]
    NotMigrated {
        /// The missing table, as the server named it.
        table: String,
        /// The driver's error.
        #[source]
        source: sqlx::Error,
    },
    /// The database failed; the transaction should be rolled back and the
    /// message handled again later.
    #[error("database error: {0}")]
    Database(sqlx::Error),
}

impl From<sqlx::Error> for MessagingError {
    fn from(source: sqlx::Error) -> Self {
        match missing_idem_table(&source) {
            Some(table) => Self::NotMigrated { table, source },
            None => Self::Database(source),
        }
    }
}

impl MessagingError {
    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidMessage {
            field,
            reason: reason.into(),
        }
    }

    /// Whether handling the message again later may succeed (a lost
    /// connection, a deadlock, a lock wait timeout).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::InvalidMessage { .. } | Self::NotMigrated { .. } => false,
            Self::Database(err) => sqlx_is_transient(err),
        }
    }
}

/// One line saying why a connection failed, in the user's words.
fn connect_reason(err: &sqlx::Error) -> String {
    match err {
        sqlx::Error::Io(io) => match io.kind() {
            std::io::ErrorKind::ConnectionRefused => {
                "connection refused (is MySQL or MariaDB running and listening on that host and port?)"
                    .to_owned()
            }
            std::io::ErrorKind::TimedOut => "the connection attempt timed out".to_owned(),
            _ => format!("network error: {io}"),
        },
        sqlx::Error::Database(db) => match error_number(err) {
            // ER_BAD_DB_ERROR
            Some(1049) => format!("{} (create it, or fix the database name)", db.message()),
            // ER_ACCESS_DENIED_ERROR, ER_DBACCESS_DENIED_ERROR
            Some(1045 | 1044) => format!("authentication failed: {}", db.message()),
            Some(number) => format!("the server refused: {} (error {number})", db.message()),
            None => format!("the server refused: {}", db.message()),
        },
        sqlx::Error::Tls(e) => format!("TLS failed: {e}"),
        sqlx::Error::PoolTimedOut => "no connection within the acquire timeout".to_owned(),
        sqlx::Error::Configuration(e) => format!("bad connection options: {e}"),
        other => other.to_string(),
    }
}

/// ER_NET_PACKET_TOO_LARGE: a statement larger than the server's
/// `max_allowed_packet` (an answer too large to store). Its SQLSTATE is
/// of the connection class, but the same statement fails again.
const PACKET_TOO_LARGE: u16 = 1153;

/// Server errors that mean "try again later": deadlocks and lock wait
/// timeouts, too many connections (1040), a server shutting down (1053),
/// lost connections (2006, 2013), and the connection-class SQLSTATE 08
/// except a statement too large for the server.
fn transient_error(number: u16, sqlstate: Option<&str>) -> bool {
    if number == PACKET_TOO_LARGE {
        return false;
    }
    matches!(
        number,
        DEADLOCK | LOCK_WAIT_TIMEOUT | 1040 | 1053 | 2006 | 2013
    ) || sqlstate.is_some_and(|s| s.starts_with("08"))
}

/// Whether a driver error is transient.
fn sqlx_is_transient(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<MySqlDatabaseError>()
            .is_some_and(|e| transient_error(e.number(), e.code())),
        _ => false,
    }
}

/// Whether a driver error means a row could not be read back.
fn sqlx_is_corrupt(err: &sqlx::Error) -> bool {
    matches!(
        err,
        sqlx::Error::ColumnDecode { .. }
            | sqlx::Error::Decode(_)
            | sqlx::Error::ColumnNotFound(_)
            | sqlx::Error::ColumnIndexOutOfBounds { .. }
    )
}

/// Transient conditions (refused connections, pool timeouts, I/O,
/// deadlocks, lock wait timeouts) become [`StoreError::Unavailable`];
/// unreadable rows and too-new schemas [`StoreError::Corrupt`]; the rest
/// [`StoreError::Backend`].
impl From<MySqlError> for StoreError {
    fn from(err: MySqlError) -> Self {
        match &err {
            _ if err.is_transient() => StoreError::Unavailable(Box::new(err)),
            MySqlError::Sqlx(source) if sqlx_is_corrupt(source) => {
                StoreError::Corrupt(Box::new(err))
            }
            MySqlError::Corrupt(_) | MySqlError::SchemaTooNew { .. } => {
                StoreError::Corrupt(Box::new(err))
            }
            _ => StoreError::Backend(Box::new(err)),
        }
    }
}

/// A driver error as a [`StoreError`].
pub(crate) fn to_store(err: sqlx::Error) -> StoreError {
    MySqlError::from(err).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_errors() {
        for number in [1213, 1205, 1040, 1053, 2006, 2013] {
            assert!(transient_error(number, None), "{number}");
        }
        assert!(transient_error(1999, Some("08S01")));
        assert!(!transient_error(1153, Some("08S01")), "too large stays so");
        for number in [1062, 1146, 1049, 1045] {
            assert!(!transient_error(number, Some("42S02")), "{number}");
        }
    }

    #[test]
    fn mapping_to_store_errors() {
        assert!(StoreError::from(MySqlError::Sqlx(sqlx::Error::PoolTimedOut)).is_transient());
        assert!(matches!(
            StoreError::from(MySqlError::Corrupt("x".into())),
            StoreError::Corrupt(_)
        ));
        assert!(matches!(
            StoreError::from(MySqlError::Sqlx(sqlx::Error::RowNotFound)),
            StoreError::Backend(_)
        ));
        assert!(
            StoreError::from(MySqlError::connect_timeout(
                "mysql://h",
                Duration::from_secs(1)
            ))
            .is_transient()
        );
    }
}

//! Errors of the PostgreSQL store and how they map onto [`StoreError`].

use std::time::Duration;

use idem::StoreError;

/// What went wrong configuring, connecting to, migrating or using the
/// PostgreSQL store. Every message that names the server shows its URL with
/// the password replaced by `***`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PgError {
    /// The store URL or an option is not understood.
    #[error("invalid PostgreSQL store URL {url}: {reason}")]
    Url {
        /// The URL given, password redacted.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The server could not be reached or refused the connection.
    #[error("cannot connect to PostgreSQL at {url}: {reason}")]
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
    #[error("{}", not_migrated(.relation))]
    NotMigrated {
        /// The missing table, as PostgreSQL named it.
        relation: String,
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
impl From<sqlx::Error> for PgError {
    fn from(source: sqlx::Error) -> Self {
        match missing_idem_relation(&source) {
            Some(relation) => Self::NotMigrated { relation, source },
            None => Self::Sqlx(source),
        }
    }
}

/// The one message for a database without the idem schema: what is
/// missing, and how to create it.
fn not_migrated(relation: &str) -> String {
    format!(
        "the idem schema is not in this database (relation {relation:?} does not exist): create it once with `idem migrate --store URL` (or PgStore::migrate, or connect with migrate=true)"
    )
}

/// The idem table an `undefined_table` (42P01) error names, if any: the
/// sign of a schema never migrated. A missing table of the caller's own is
/// not ours to explain.
fn missing_idem_relation(err: &sqlx::Error) -> Option<String> {
    let sqlx::Error::Database(db) = err else {
        return None;
    };
    if db.code().as_deref() != Some("42P01") {
        return None;
    }
    let message = db.message();
    let relation = message.split('"').nth(1)?;
    let table = relation.rsplit('.').next().unwrap_or(relation);
    table.starts_with("idem_").then(|| relation.to_owned())
}

impl PgError {
    /// Whether trying again later may succeed: the server is down, busy
    /// or restarting, or the connection broke. Not for a refusal that
    /// stays until someone changes something (bad credentials, no such
    /// database, a schema never migrated or too new).
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

/// What went wrong in the inbox, the outbox or the ordering guard.
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
    #[error("{}", not_migrated(.relation))]
    NotMigrated {
        /// The missing table, as PostgreSQL named it.
        relation: String,
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
        match missing_idem_relation(&source) {
            Some(relation) => Self::NotMigrated { relation, source },
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
    /// connection, a serialization failure, a deadlock).
    pub fn is_transient(&self) -> bool {
        match self {
            Self::InvalidMessage { .. } | Self::NotMigrated { .. } => false,
            Self::Database(sqlx::Error::Database(db)) => {
                db.code().as_deref().is_some_and(transient_code)
            }
            Self::Database(
                sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed,
            ) => true,
            Self::Database(_) => false,
        }
    }
}

/// One line saying why a connection failed, in the user's words.
fn connect_reason(err: &sqlx::Error) -> String {
    match err {
        sqlx::Error::Io(io) => match io.kind() {
            std::io::ErrorKind::ConnectionRefused => {
                "connection refused (is PostgreSQL running and listening on that host and port?)"
                    .to_owned()
            }
            std::io::ErrorKind::TimedOut => "the connection attempt timed out".to_owned(),
            _ => format!("network error: {io}"),
        },
        sqlx::Error::Database(db) => match db.code().as_deref() {
            Some("3D000") => format!("{} (create it, or fix the database name)", db.message()),
            Some("28P01" | "28000") => format!("authentication failed: {}", db.message()),
            Some(code) => format!("the server refused: {} (SQLSTATE {code})", db.message()),
            None => format!("the server refused: {}", db.message()),
        },
        sqlx::Error::Tls(e) => format!("TLS failed: {e}"),
        sqlx::Error::PoolTimedOut => "no connection within the acquire timeout".to_owned(),
        sqlx::Error::Configuration(e) => format!("bad connection options: {e}"),
        other => other.to_string(),
    }
}

/// SQLSTATE classes and codes that mean "try again later": connection
/// exceptions (08), insufficient resources (53), operator intervention
/// (57P01–57P05), serialization failures and deadlocks (40001, 40P01), lock
/// timeouts (55P03).
fn transient_code(code: &str) -> bool {
    code.starts_with("08")
        || code.starts_with("53")
        || code.starts_with("57P")
        || matches!(code, "40001" | "40P01" | "55P03")
}

/// Whether a driver error is transient.
fn sqlx_is_transient(err: &sqlx::Error) -> bool {
    match err {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|c| transient_code(&c)),
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

/// Transient conditions (refused connections, pool timeouts, I/O, server
/// shutting down, serialization failures) become
/// [`StoreError::Unavailable`]; unreadable rows and too-new schemas
/// [`StoreError::Corrupt`]; the rest [`StoreError::Backend`].
impl From<PgError> for StoreError {
    fn from(err: PgError) -> Self {
        match &err {
            _ if err.is_transient() => StoreError::Unavailable(Box::new(err)),
            PgError::Sqlx(source) if sqlx_is_corrupt(source) => StoreError::Corrupt(Box::new(err)),
            PgError::Corrupt(_) | PgError::SchemaTooNew { .. } => {
                StoreError::Corrupt(Box::new(err))
            }
            _ => StoreError::Backend(Box::new(err)),
        }
    }
}

/// A driver error as a [`StoreError`].
pub(crate) fn to_store(err: sqlx::Error) -> StoreError {
    PgError::from(err).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transient_codes() {
        for code in ["08006", "53300", "57P01", "40001", "40P01", "55P03"] {
            assert!(transient_code(code), "{code}");
        }
        for code in ["23505", "42P01", "3D000", "28P01"] {
            assert!(!transient_code(code), "{code}");
        }
    }

    #[test]
    fn mapping_to_store_errors() {
        assert!(StoreError::from(PgError::Sqlx(sqlx::Error::PoolTimedOut)).is_transient());
        assert!(matches!(
            StoreError::from(PgError::Corrupt("x".into())),
            StoreError::Corrupt(_)
        ));
        assert!(matches!(
            StoreError::from(PgError::Sqlx(sqlx::Error::RowNotFound)),
            StoreError::Backend(_)
        ));
        assert!(
            StoreError::from(PgError::connect_timeout(
                "postgres://h",
                Duration::from_secs(1)
            ))
            .is_transient()
        );
    }
}

//! Errors of the SQLite store and how they map onto [`StoreError`].

use std::path::PathBuf;
use std::sync::Arc;

use idem::StoreError;
use rusqlite::ErrorCode;

/// What went wrong opening or using the SQLite store.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SqliteError {
    /// The store URL or an option in it is not understood.
    #[error("invalid SQLite store URL {url:?}: {reason}")]
    Url {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The database file could not be opened or prepared.
    #[error("cannot open SQLite store at {}: {source}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// The driver's error.
        #[source]
        source: Box<SqliteError>,
    },
    /// The file exists but is not an SQLite database (or is damaged).
    #[error("the file is not an SQLite database, or it is corrupt ({0})")]
    NotADatabase(#[source] rusqlite::Error),
    /// Another process holds the database locked beyond the busy timeout.
    #[error(
        "the database is locked by another connection ({0}); is another process holding a long transaction?"
    )]
    Locked(#[source] rusqlite::Error),
    /// The database was written by a newer idem with a schema this build
    /// does not know.
    #[error(
        "the database schema is version {found}, newer than the {supported} this build supports; upgrade idem"
    )]
    SchemaTooNew {
        /// Version found in the file.
        found: i64,
        /// Newest version this build knows.
        supported: i64,
    },
    /// Any other driver error.
    #[error(transparent)]
    Sqlite(rusqlite::Error),
    /// A thread of the store (writer, checkpointer) could not be started.
    #[error("cannot start the SQLite {0} thread: {1}")]
    Thread(&'static str, #[source] std::io::Error),
    /// The writer thread is gone (the store was shut down or it crashed).
    #[error("the SQLite writer thread has stopped")]
    WriterStopped,
    /// The database file could not be created.
    #[error("cannot create the database file: {0}")]
    Create(#[source] std::io::Error),
    /// An inbox consumer name or message id was refused before it reached
    /// the database (empty, or longer than
    /// [`MAX_ID_LEN`](crate::inbox::MAX_ID_LEN)).
    #[error("invalid {field}: {reason}")]
    InvalidMessage {
        /// Which field.
        field: &'static str,
        /// Why.
        reason: String,
    },
}

impl From<rusqlite::Error> for SqliteError {
    fn from(err: rusqlite::Error) -> Self {
        match err.sqlite_error_code() {
            Some(ErrorCode::NotADatabase | ErrorCode::DatabaseCorrupt) => Self::NotADatabase(err),
            Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked) => Self::Locked(err),
            _ => Self::Sqlite(err),
        }
    }
}

impl SqliteError {
    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Self::InvalidMessage {
            field,
            reason: reason.into(),
        }
    }

    fn innermost(&self) -> &SqliteError {
        match self {
            Self::Open { source, .. } => source.innermost(),
            other => other,
        }
    }
}

/// Transient conditions (busy, I/O, disk full, writer gone) become
/// [`StoreError::Unavailable`]; unreadable data becomes
/// [`StoreError::Corrupt`]; the rest [`StoreError::Backend`].
impl From<SqliteError> for StoreError {
    fn from(err: SqliteError) -> Self {
        match err.innermost() {
            SqliteError::NotADatabase(_) | SqliteError::SchemaTooNew { .. } => {
                StoreError::Corrupt(Box::new(err))
            }
            SqliteError::Locked(_) | SqliteError::WriterStopped => {
                StoreError::Unavailable(Box::new(err))
            }
            SqliteError::Sqlite(e) if is_transient(e) => StoreError::Unavailable(Box::new(err)),
            SqliteError::Sqlite(rusqlite::Error::FromSqlConversionFailure(..)) => {
                StoreError::Corrupt(Box::new(err))
            }
            _ => StoreError::Backend(Box::new(err)),
        }
    }
}

fn is_transient(e: &rusqlite::Error) -> bool {
    matches!(
        e.sqlite_error_code(),
        Some(
            ErrorCode::SystemIoFailure
                | ErrorCode::DiskFull
                | ErrorCode::CannotOpen
                | ErrorCode::OutOfMemory
                | ErrorCode::DatabaseBusy
                | ErrorCode::DatabaseLocked
        )
    )
}

/// One failed commit answers every caller in the batch; they share the
/// driver error.
pub(crate) fn shared(err: &Arc<rusqlite::Error>) -> StoreError {
    let transient = is_transient(err);
    let boxed: idem::store::BoxError = Box::new(SharedError(Arc::clone(err)));
    if transient {
        StoreError::Unavailable(boxed)
    } else {
        StoreError::Backend(boxed)
    }
}

/// A driver error shared by every caller of a failed batch.
#[derive(Debug, thiserror::Error)]
#[error("the write batch failed: {0}")]
struct SharedError(#[source] Arc<rusqlite::Error>);

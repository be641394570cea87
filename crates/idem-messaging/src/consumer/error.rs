//! How handling a message fails: retried after a backoff, or parked at
//! once.

use crate::cause::caused;
use idem::store::BoxError;
use idem_postgres::MessagingError;
use idem_postgres::sqlx::{self};

/// Why a handler did not apply a message.
///
/// Each kind holds what went wrong: a message, an error (a driver's, a
/// client's), or a message and the error behind it (the `*_with`
/// constructors), whose cause stays reachable as the error's
/// [`source`](std::error::Error::source); `HandlerError::Retry(err.into())`
/// wraps an error as it is (same text, same source). Its text (`why`, or
/// `why: cause`) is what the runner logs and gives as the reason when it
/// parks the message.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Something that may pass later (a lock timeout, a service down):
    /// the message is redelivered after a backoff.
    #[error(transparent)]
    Retry(BoxError),
    /// The message can never be applied (malformed, refers to nothing):
    /// it is parked at once.
    #[error(transparent)]
    Permanent(BoxError),
}

impl HandlerError {
    /// A failure worth retrying.
    pub fn retry(why: impl Into<String>) -> Self {
        Self::Retry(why.into().into())
    }

    /// A failure no retry will fix.
    pub fn permanent(why: impl Into<String>) -> Self {
        Self::Permanent(why.into().into())
    }

    /// A failure worth retrying, because of `source`: shows as
    /// `why: source`.
    pub fn retry_with(why: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self::Retry(caused(why, source))
    }

    /// A failure no retry will fix, because of `source`: shows as
    /// `why: source`.
    pub fn permanent_with(why: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self::Permanent(caused(why, source))
    }
}

/// A database failure: retried (`database: …`).
impl From<sqlx::Error> for HandlerError {
    fn from(err: sqlx::Error) -> Self {
        Self::retry_with("database", err)
    }
}

/// A refused id or message is permanent; a database failure is retried.
impl From<MessagingError> for HandlerError {
    fn from(err: MessagingError) -> Self {
        match err {
            MessagingError::InvalidMessage { .. } => Self::Permanent(Box::new(err)),
            _ => Self::Retry(Box::new(err)),
        }
    }
}

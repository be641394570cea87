//! Errors of the Redis store and how they map onto [`StoreError`].

use idem::StoreError;
use redis::ErrorKind;

/// What went wrong configuring, connecting to or using the Redis store.
/// Every message that names the server shows its URL with the password
/// replaced by `***`.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisError {
    /// The store URL or an option is not understood.
    #[error("invalid Redis store URL {url}: {reason}")]
    Url {
        /// The URL given, password redacted.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The server could not be reached or refused the connection.
    #[error("cannot connect to Redis at {url}: {reason}")]
    Connect {
        /// The server's URL, password redacted.
        url: String,
        /// A one-line explanation.
        reason: String,
        /// The driver's error.
        #[source]
        source: redis::RedisError,
    },
    /// A stored record or a script's answer cannot be interpreted.
    #[error("unreadable data in Redis: {0}")]
    Corrupt(String),
    /// Any other driver error.
    #[error(transparent)]
    Redis(#[from] redis::RedisError),
}

impl RedisError {
    pub(crate) fn connect(url: &str, source: redis::RedisError) -> Self {
        let reason = if source.is_connection_refusal() {
            "connection refused (is Redis running and listening on that host and port?)".to_owned()
        } else if source.is_timeout() {
            "the connection attempt timed out".to_owned()
        } else if source.kind() == ErrorKind::AuthenticationFailed
            || source
                .code()
                .is_some_and(|c| c == "WRONGPASS" || c == "NOAUTH")
        {
            format!("authentication failed: {source}")
        } else {
            source.to_string()
        };
        Self::Connect {
            url: idem::store::redact_url(url),
            reason,
            source,
        }
    }
}

/// Whether a driver error is transient: I/O, refused or dropped
/// connections, timeouts, a server still loading its data set, cluster
/// fail-overs.
fn is_transient(err: &redis::RedisError) -> bool {
    err.is_io_error()
        || err.is_connection_refusal()
        || err.is_connection_dropped()
        || err.is_timeout()
        || matches!(
            err.kind(),
            ErrorKind::BusyLoadingError
                | ErrorKind::TryAgain
                | ErrorKind::ClusterDown
                | ErrorKind::MasterDown
                | ErrorKind::ReadOnly
        )
}

impl RedisError {
    /// Whether trying again later may succeed (the server is down,
    /// loading, failing over, or the connection broke); not for a refusal
    /// that stays, such as a wrong password.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Connect { source, .. } | Self::Redis(source) => is_transient(source),
            _ => false,
        }
    }
}

/// Transient conditions become [`StoreError::Unavailable`], unreadable
/// records [`StoreError::Corrupt`], the rest [`StoreError::Backend`].
impl From<RedisError> for StoreError {
    fn from(err: RedisError) -> Self {
        match &err {
            _ if err.is_transient() => StoreError::Unavailable(Box::new(err)),
            RedisError::Redis(source) if source.kind() == ErrorKind::TypeError => {
                StoreError::Corrupt(Box::new(err))
            }
            RedisError::Corrupt(_) => StoreError::Corrupt(Box::new(err)),
            _ => StoreError::Backend(Box::new(err)),
        }
    }
}

/// A driver error as a [`StoreError`].
pub(crate) fn to_store(err: redis::RedisError) -> StoreError {
    RedisError::Redis(err).into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapping_to_store_errors() {
        let io =
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(StoreError::from(RedisError::Redis(io)).is_transient());
        assert!(matches!(
            StoreError::from(RedisError::Corrupt("x".into())),
            StoreError::Corrupt(_)
        ));
        let other = redis::RedisError::from((ErrorKind::ResponseError, "ERR", "x".to_owned()));
        assert!(matches!(
            StoreError::from(RedisError::Redis(other)),
            StoreError::Backend(_)
        ));
    }
}

//! [`GatewayError`]: everything the `idem` binary can fail with, each
//! cause kept as its source, and [`error_chain`], the one way the binary
//! renders an error and its causes on one line.
//!
//! ```
//! use idem_gateway::error::{GatewayError, error_chain};
//!
//! let io = std::io::Error::other("disk full");
//! let err = GatewayError::io("cannot write the hash secret idem.db.secret", io);
//! assert_eq!(error_chain(&err), "cannot write the hash secret idem.db.secret: disk full");
//! ```

use std::net::SocketAddr;

use crate::config::ConfigError;

/// What went wrong in a command of the `idem` binary. Displayed alone it
/// says what failed; [`error_chain`] adds its causes. A command that fails
/// with one exits with status 1 (2 is kept for a command line that cannot
/// even be read, 130 for an interrupted command).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GatewayError {
    /// The configuration (file, flags or environment) is wrong; the
    /// message names the file, line, key, value and reason.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A value given on the command line or in a request file cannot be
    /// used; the message names the flag and what was expected.
    #[error("{0}")]
    Invalid(String),
    /// A parameter of an operator's request (an answer recorded by hand)
    /// cannot be used.
    #[error(transparent)]
    Answer(#[from] crate::records::InvalidParameter),
    /// A store URL that cannot be understood, or a store that cannot be
    /// used as asked (no such database file, no shared hash secret).
    #[error("{0}")]
    StoreUrl(String),
    /// The embedded store is already served by another gateway.
    #[error("{0}")]
    InUse(String),
    /// A store operation failed.
    #[error(transparent)]
    Store(#[from] idem::StoreError),
    /// An operator action on a record was refused or failed.
    #[error(transparent)]
    Operator(#[from] idem::operator::OperatorError),
    /// The embedded store's URL cannot be used.
    #[error(transparent)]
    Sqlite(#[from] idem_sqlite::SqliteError),
    /// The embedded store failed to open.
    #[error("store {url}")]
    SqliteOpen {
        /// The store URL.
        url: String,
        /// Why.
        #[source]
        source: idem_sqlite::SqliteError,
    },
    /// PostgreSQL failed (connect, migrate, a query of the outbox).
    #[error(transparent)]
    Postgres(#[from] idem_postgres::PgError),
    /// MySQL or MariaDB failed (connect, migrate, parse its URL).
    #[cfg(feature = "mysql")]
    #[error(transparent)]
    MySql(#[from] idem_mysql::MySqlError),
    /// DynamoDB failed (connect, the clock check, migrate, parse its URL).
    #[cfg(feature = "dynamodb")]
    #[error(transparent)]
    Dynamo(#[from] idem_dynamodb::DynamoError),
    /// The outbox could not be read or changed.
    #[error(transparent)]
    Outbox(#[from] idem_postgres::MessagingError),
    /// Redis failed (connect, parse its URL).
    #[error(transparent)]
    Redis(#[from] idem_redis::RedisError),
    /// A message broker failed or refused.
    #[error(transparent)]
    Publish(#[from] idem_messaging::PublishError),
    /// A listener could not be bound.
    #[error("cannot listen on {addr}{}", if *.admin { " (admin)" } else { "" })]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Whether it is the admin listener.
        admin: bool,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A file, socket or terminal failed.
    #[error("{context}")]
    Io {
        /// What was being done, naming the file where there is one.
        context: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// `idem demo` saw a payment charged twice, or another answer than
    /// the contract's.
    #[error("the demo found a problem: {0}")]
    DemoFailed(String),
    /// A background task the command waited for panicked or was cancelled.
    #[error("{context}")]
    Task {
        /// What the task was doing.
        context: String,
        /// Why.
        #[source]
        source: tokio::task::JoinError,
    },
}

impl GatewayError {
    /// Whether the same step may succeed if tried again later: a store or
    /// broker that is down or restarting, not one that refuses for good
    /// (bad credentials, no such database) or a mistake in the command.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Postgres(err) => err.is_transient(),
            #[cfg(feature = "mysql")]
            Self::MySql(err) => err.is_transient(),
            #[cfg(feature = "dynamodb")]
            Self::Dynamo(err) => err.is_transient(),
            Self::Redis(err) => err.is_transient(),
            Self::Store(err) => err.is_transient(),
            _ => false,
        }
    }

    /// A file, socket or terminal failure while doing `context`.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> Self {
        Self::Io {
            context: context.into(),
            source,
        }
    }
}

/// An error and its causes on one line, each cause once: a cause its
/// parent printed (the line ends `…: cause`) is not repeated, and a word
/// of the parent's own text that spells a cause does not hide it.
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut out = err.to_string();
    let mut cur = err.source();
    while let Some(e) = cur {
        let s = e.to_string();
        let said =
            |t: &str| out == t || out.strip_suffix(t).is_some_and(|head| head.ends_with(": "));
        // A driver's wrapping of a message already said ("error returned
        // from database: role \"x\" does not exist") adds only its label.
        let rewrapped = s.split_once(": ").is_some_and(|(_, rest)| said(rest));
        if !said(&s) && !rewrapped {
            out.push_str(": ");
            out.push_str(&s);
        }
        cur = e.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chain_names_each_cause_once() {
        let err = GatewayError::Listen {
            addr: "127.0.0.1:9090".parse().expect("an address"),
            admin: true,
            source: std::io::Error::new(std::io::ErrorKind::AddrInUse, "address in use"),
        };
        assert_eq!(
            error_chain(&err),
            "cannot listen on 127.0.0.1:9090 (admin): address in use"
        );
        let transparent = GatewayError::Store(idem::StoreError::unavailable("down"));
        assert_eq!(
            error_chain(&transparent),
            idem::StoreError::unavailable("down").to_string()
        );
    }

    /// A cause is left out only when the line already ends with it (the
    /// parent printed it as `…: cause`): a word of the parent's own text
    /// that happens to spell the cause does not hide it.
    #[test]
    fn a_cause_is_dropped_only_when_the_parent_printed_it() {
        let io = |text: &str| std::io::Error::other(text.to_owned());
        let config = GatewayError::io("reading idem.toml (timeout 5s)", io("timeout"));
        assert_eq!(
            error_chain(&config),
            "reading idem.toml (timeout 5s): timeout"
        );
        let printed = GatewayError::io("reading idem.toml", io("permission denied"));
        assert_eq!(
            error_chain(&printed),
            "reading idem.toml: permission denied"
        );
    }
}

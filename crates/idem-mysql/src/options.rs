//! [`MySqlOptions`]: how to reach the server, how large the pool is and
//! how the store behaves on it, from a `mysql://` URL or built in code.

use std::time::Duration;

use idem::store::backend::{QueryOption, QueryOptionError, QueryOptions};
use sqlx::ConnectOptions;
use sqlx::mysql::MySqlConnectOptions;

use crate::batch;
use crate::error::MySqlError;

/// The options idem reads from a store URL; every other one is the
/// driver's.
const OURS: [&str; 10] = [
    "max_connections",
    "min_connections",
    "acquire_timeout_ms",
    "connect_timeout_ms",
    "migrate",
    "test_before_acquire",
    "ping_after_idle_ms",
    "group_commit",
    "group_commit_max",
    "group_commit_in_flight",
];

/// Options for [`MySqlStore::connect_with`](crate::MySqlStore::connect_with).
///
/// Defaults: up to 16 connections, 5 s to acquire one, 5 s to connect,
/// idle connections closed after 10 minutes, migrations applied at
/// connect. The idem tables live in the URL's database. Its `Debug`
/// output shows the redacted URL, never the password.
///
/// ```
/// use std::time::Duration;
/// use idem_mysql::MySqlOptions;
///
/// # fn main() -> Result<(), idem_mysql::MySqlError> {
/// let opts = MySqlOptions::from_url("mysql://idem:s3cret@db/idem?max_connections=32")?
///     .with_acquire_timeout(Duration::from_secs(2));
/// assert_eq!(opts.max_connections(), 32);
/// assert_eq!(opts.display_url(), "mysql://idem:***@db/idem?max_connections=32");
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct MySqlOptions {
    connect: MySqlConnectOptions,
    display_url: String,
    max_connections: u32,
    min_connections: u32,
    acquire_timeout: Duration,
    connect_timeout: Duration,
    idle_timeout: Option<Duration>,
    migrate: bool,
    test_before_acquire: bool,
    ping_after_idle: Duration,
    group_commit: bool,
    group_commit_max: u32,
    group_commit_in_flight: u32,
}

impl std::fmt::Debug for MySqlOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MySqlOptions")
            .field("url", &self.display_url)
            .field("max_connections", &self.max_connections)
            .field("min_connections", &self.min_connections)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("migrate", &self.migrate)
            .field("test_before_acquire", &self.test_before_acquire)
            .field("ping_after_idle", &self.ping_after_idle)
            .field("group_commit", &self.group_commit)
            .field("group_commit_max", &self.group_commit_max)
            .field("group_commit_in_flight", &self.group_commit_in_flight)
            .finish_non_exhaustive()
    }
}

impl MySqlOptions {
    /// Default options for explicit connection options.
    pub fn new(connect: MySqlConnectOptions) -> Self {
        let display_url = format!(
            "mysql://{}@{}:{}/{}",
            connect.get_username(),
            connect.get_host(),
            connect.get_port(),
            connect.get_database().unwrap_or_default()
        );
        Self {
            // sqlx logs each statement (DEBUG) and each slow one (WARN,
            // with its whole text) under its own target; the store reports
            // slow operations itself (store time-out, latency metrics).
            connect: connect.disable_statement_logging(),
            display_url,
            max_connections: 16,
            min_connections: 0,
            acquire_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Some(Duration::from_secs(600)),
            migrate: true,
            test_before_acquire: true,
            ping_after_idle: Duration::from_secs(1),
            group_commit: true,
            group_commit_max: batch::GroupCommit::DEFAULT.max_batch,
            group_commit_in_flight: batch::GroupCommit::DEFAULT.in_flight,
        }
    }

    /// Parses `mysql://user:password@host:port/database?options` (or
    /// `mariadb://…`). Besides the driver's own options (`ssl-mode`,
    /// `charset`, `socket`…), idem reads `max_connections=N`,
    /// `min_connections=N`, `acquire_timeout_ms=N`, `connect_timeout_ms=N`,
    /// `migrate=true|false`, `test_before_acquire=true|false`,
    /// `ping_after_idle_ms=N` (0 pings before every operation),
    /// `group_commit=true|false`, `group_commit_max=N` and
    /// `group_commit_in_flight=N`.
    ///
    /// Fails with [`MySqlError::Url`] (password redacted) on another
    /// scheme, a URL without a database, an option without a value, a URL
    /// the driver refuses, a value an option does not take, or settings
    /// that do not fit together.
    pub fn from_url(url: &str) -> Result<Self, MySqlError> {
        let bad = |reason: String| MySqlError::Url {
            url: idem::store::redact_url(url),
            reason,
        };
        let driver_scheme = if let Some(rest) = url.strip_prefix("mariadb://") {
            format!("mysql://{rest}")
        } else if url.starts_with("mysql://") {
            url.to_owned()
        } else {
            return Err(bad("must start with mysql:// or mariadb://".to_owned()));
        };
        let (base, query) = QueryOptions::split(&driver_scheme);
        let mut driver_query = Vec::new();
        let mut ours = Vec::new();
        for option in query {
            option.value().map_err(|e| bad(e.to_string()))?;
            if OURS.contains(&option.name()) {
                ours.push(option);
            } else {
                driver_query.push(option.pair());
            }
        }
        let driver_url = if driver_query.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", driver_query.join("&"))
        };
        let connect: MySqlConnectOptions = driver_url
            .parse()
            .map_err(|e: sqlx::Error| bad(e.to_string()))?;
        if connect.get_database().is_none_or(str::is_empty) {
            return Err(bad(
                "names no database (mysql://host/DATABASE): the idem tables live in one".to_owned(),
            ));
        }
        let mut opts = Self::new(connect);
        opts.display_url = idem::store::redact_url(url);
        for option in ours {
            opts.set(&option).map_err(|e| bad(e.to_string()))?;
        }
        opts.validate().map_err(bad)?;
        Ok(opts)
    }

    /// Applies one of [`OURS`] from a URL.
    fn set(&mut self, option: &QueryOption<'_>) -> Result<(), QueryOptionError> {
        let millis = |n: u32| Duration::from_millis(n.into());
        match option.name() {
            "max_connections" => self.max_connections = option.positive_u32()?,
            "min_connections" => self.min_connections = option.positive_u32()?,
            "acquire_timeout_ms" => self.acquire_timeout = millis(option.positive_u32()?),
            "connect_timeout_ms" => self.connect_timeout = millis(option.positive_u32()?),
            "migrate" => self.migrate = option.flag()?,
            "test_before_acquire" => self.test_before_acquire = option.flag()?,
            "ping_after_idle_ms" => self.ping_after_idle = option.millis()?,
            "group_commit" => self.group_commit = option.flag()?,
            "group_commit_max" => self.group_commit_max = option.positive_u32()?,
            "group_commit_in_flight" => self.group_commit_in_flight = option.positive_u32()?,
            _ => {}
        }
        Ok(())
    }

    /// How to reach the server (host, database, credentials, TLS mode…).
    pub fn connect_options(&self) -> &MySqlConnectOptions {
        &self.connect
    }

    /// Uses other connection options (to reach the server through a
    /// proxy, say). The URL shown in messages
    /// ([`display_url`](Self::display_url)) stays the one the options came
    /// from.
    pub fn with_connect_options(mut self, connect: MySqlConnectOptions) -> Self {
        self.connect = connect;
        self
    }

    /// The URL the options came from, password redacted, for messages.
    pub fn display_url(&self) -> &str {
        &self.display_url
    }

    /// Most connections the pool opens (default 16).
    pub fn max_connections(&self) -> u32 {
        self.max_connections
    }

    /// Sets the pool's maximum number of connections.
    pub fn with_max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }

    /// Connections kept open even when idle (default 0).
    pub fn min_connections(&self) -> u32 {
        self.min_connections
    }

    /// Sets how many connections are kept open even when idle (at most
    /// [`max_connections`](Self::max_connections)).
    pub fn with_min_connections(mut self, n: u32) -> Self {
        self.min_connections = n;
        self
    }

    /// How long an operation waits for a free connection before failing
    /// with [`StoreError::Unavailable`](idem::StoreError::Unavailable)
    /// (default 5 s).
    pub fn acquire_timeout(&self) -> Duration {
        self.acquire_timeout
    }

    /// Sets how long an operation waits for a free connection.
    pub fn with_acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// How long [`MySqlStore::connect_with`](crate::MySqlStore::connect_with)
    /// waits for the first connection (default 5 s).
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// Sets how long connecting waits for the first connection.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Idle connections above [`min_connections`](Self::min_connections)
    /// are closed after this (default 10 minutes, below the server's
    /// `wait_timeout` of 8 hours); `None` keeps them.
    pub fn idle_timeout(&self) -> Option<Duration> {
        self.idle_timeout
    }

    /// Sets when idle connections are closed; `None` keeps them open.
    pub fn with_idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// Whether [`MySqlStore::connect_with`](crate::MySqlStore::connect_with)
    /// applies migrations (default true).
    pub fn migrate(&self) -> bool {
        self.migrate
    }

    /// Whether to apply migrations at connect.
    pub fn with_migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Whether the pool pings a connection before handing it out (on by
    /// default), so that a connection the server closed while idle (a
    /// restart, `wait_timeout`) is replaced instead of failing an
    /// operation. Only connections idle for at least
    /// [`ping_after_idle`](Self::ping_after_idle) are pinged. Off, a dead
    /// connection fails one operation with
    /// [`StoreError::Unavailable`](idem::StoreError::Unavailable) before
    /// the pool replaces it.
    pub fn test_before_acquire(&self) -> bool {
        self.test_before_acquire
    }

    /// Sets whether connections are pinged before use.
    pub fn with_test_before_acquire(mut self, ping: bool) -> Self {
        self.test_before_acquire = ping;
        self
    }

    /// How long a connection must have sat idle to be pinged before use
    /// (default 1 s; zero pings before every operation). Under load
    /// connections go straight back to work, and no round trip is spent
    /// on a ping beside each operation's own.
    pub fn ping_after_idle(&self) -> Duration {
        self.ping_after_idle
    }

    /// Sets how long a connection must have sat idle to be pinged before
    /// use (see [`ping_after_idle`](Self::ping_after_idle)).
    pub fn with_ping_after_idle(mut self, idle: Duration) -> Self {
        self.ping_after_idle = idle;
        self
    }

    /// Whether concurrent reservations (and concurrent resolutions) are
    /// grouped into one transaction and one commit (on by default). While
    /// fewer than [`group_commit_in_flight`](Self::group_commit_in_flight)
    /// transactions of a kind run, an operation runs alone, as it comes;
    /// when they all run, operations queue and the next free slot runs
    /// them together. Off, every operation commits on its own.
    pub fn group_commit(&self) -> bool {
        self.group_commit
    }

    /// Turns group commit on or off (see
    /// [`group_commit`](Self::group_commit)).
    pub fn with_group_commit(mut self, on: bool) -> Self {
        self.group_commit = on;
        self
    }

    /// Most operations one grouped transaction carries (default 64).
    pub fn group_commit_max(&self) -> u32 {
        self.group_commit_max
    }

    /// Sets how many operations one grouped transaction carries at most.
    pub fn with_group_commit_max(mut self, n: u32) -> Self {
        self.group_commit_max = n;
        self
    }

    /// Most grouped transactions of one kind (reservations, resolutions)
    /// running at once, each on a connection of the pool (default 2). A
    /// grouped transaction that waits (on a row another transaction holds
    /// uncommitted, say a caller's own
    /// [`MySqlStore::reserve_in`](crate::MySqlStore::reserve_in)) holds up
    /// the operations queued behind it.
    pub fn group_commit_in_flight(&self) -> u32 {
        self.group_commit_in_flight
    }

    /// Sets how many grouped transactions of one kind run at once (see
    /// [`group_commit_in_flight`](Self::group_commit_in_flight)).
    pub fn with_group_commit_in_flight(mut self, n: u32) -> Self {
        self.group_commit_in_flight = n;
        self
    }

    /// How operations are grouped; `None` when group commit is off.
    pub(crate) fn group(&self) -> Option<batch::GroupCommit> {
        self.group_commit.then_some(batch::GroupCommit {
            max_batch: self.group_commit_max,
            in_flight: self.group_commit_in_flight,
        })
    }

    /// Whether the settings fit together; the reason when not.
    pub(crate) fn validate(&self) -> Result<(), String> {
        if self.max_connections == 0 {
            return Err("max_connections must be at least 1".to_owned());
        }
        if self.group_commit_max == 0 || self.group_commit_in_flight == 0 {
            return Err(
                "group_commit_max and group_commit_in_flight must be at least 1".to_owned(),
            );
        }
        if self.min_connections > self.max_connections {
            return Err(format!(
                "min_connections ({}) exceeds max_connections ({})",
                self.min_connections, self.max_connections
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_parsing() {
        let o = MySqlOptions::from_url("mysql://app:pw@db:3307/idem").expect("valid");
        assert_eq!(o.connect_options().get_host(), "db");
        assert_eq!(o.connect_options().get_port(), 3307);
        assert_eq!(o.connect_options().get_database(), Some("idem"));
        assert_eq!(o.display_url(), "mysql://app:***@db:3307/idem");
        assert!(!format!("{o:?}").contains("pw"), "Debug redacts");
        assert!(o.migrate());
        assert!(o.test_before_acquire());
        assert_eq!(o.ping_after_idle(), Duration::from_secs(1), "default");
        let o = MySqlOptions::from_url("mysql://db/idem?ping_after_idle_ms=0").expect("valid");
        assert_eq!(o.ping_after_idle(), Duration::ZERO);
        let o = MySqlOptions::from_url(
            "mariadb://db/idem?max_connections=4&min_connections=2&acquire_timeout_ms=250&connect_timeout_ms=100&migrate=false&test_before_acquire=false&charset=utf8mb4",
        )
        .expect("valid");
        assert_eq!(o.max_connections(), 4);
        assert_eq!(o.min_connections(), 2);
        assert_eq!(o.acquire_timeout(), Duration::from_millis(250));
        assert_eq!(o.connect_timeout(), Duration::from_millis(100));
        assert!(!o.migrate());
        assert!(!o.test_before_acquire());
        assert_eq!(o.connect_options().get_database(), Some("idem"));
        assert!(o.group_commit(), "default");
        assert_eq!((o.group_commit_max(), o.group_commit_in_flight()), (64, 2));
        let o = MySqlOptions::from_url(
            "mysql://db/idem?group_commit=false&group_commit_max=8&group_commit_in_flight=3",
        )
        .expect("valid");
        assert!(!o.group_commit());
        assert_eq!(o.group(), None);
        let o = o.with_group_commit(true);
        assert_eq!(
            o.group(),
            Some(batch::GroupCommit {
                max_batch: 8,
                in_flight: 3
            })
        );
    }

    #[test]
    fn bad_urls_say_what_is_wrong() {
        for (url, needle) in [
            ("postgres://db/idem", "must start with mysql://"),
            ("redis://:s3cret@db", "must start with mysql://"),
            ("mysql://u:s3cret@db", "names no database"),
            ("mysql://u:s3cret@db/", "names no database"),
            ("mysql://db/idem?max_connections=0", "positive integer"),
            ("mysql://db/idem?max_connections=x", "positive integer"),
            ("mysql://db/idem?migrate=maybe", "true or false"),
            ("mysql://db/idem?pool", "has no value"),
            ("mysql://db/idem?group_commit=yes", "true or false"),
            (
                "mysql://db/idem?ping_after_idle_ms=soon",
                "whole number of milliseconds",
            ),
            ("mysql://db/idem?group_commit_max=0", "positive integer"),
            (
                "mysql://db/idem?group_commit_in_flight=-1",
                "positive integer",
            ),
            ("mysql://u:s3cret@db:port/idem", "invalid MySQL store URL"),
            (
                "mysql://u:s3cret@db/idem?ssl-mode=sometimes",
                "invalid MySQL",
            ),
            (
                "mysql://db/idem?min_connections=9&max_connections=2",
                "exceeds",
            ),
        ] {
            let err = MySqlOptions::from_url(url).expect_err(url).to_string();
            assert!(err.contains(needle), "{url}: {err}");
            assert!(!err.contains("s3cret"), "{err}");
        }
    }
}

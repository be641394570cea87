//! [`PgOptions`]: how to reach the server, how large the pool is and how
//! the store behaves on it, from a `postgres://` URL or built in code.

use std::time::Duration;

use idem::store::backend::{QueryOption, QueryOptionError, QueryOptions};
use sqlx::ConnectOptions;
use sqlx::postgres::PgConnectOptions;

use crate::batch;
use crate::error::PgError;

/// The options idem reads from a store URL; every other one is the
/// driver's.
const OURS: [&str; 12] = [
    "max_connections",
    "thread_connections",
    "min_connections",
    "acquire_timeout_ms",
    "connect_timeout_ms",
    "schema",
    "migrate",
    "test_before_acquire",
    "ping_after_idle_ms",
    "group_commit",
    "group_commit_max",
    "group_commit_in_flight",
];

/// Options for [`PgStore::connect_with`](crate::PgStore::connect_with).
///
/// Defaults: up to 16 connections, 5 s to acquire one, 5 s to connect,
/// idle connections closed after 10 minutes, migrations applied at connect,
/// the server's default `search_path`. Its `Debug` output shows the
/// redacted URL, never the password.
///
/// ```
/// use std::time::Duration;
/// use idem_postgres::PgOptions;
///
/// # fn main() -> Result<(), idem_postgres::PgError> {
/// let opts = PgOptions::from_url("postgres://idem:s3cret@db/idem?max_connections=32")?
///     .with_schema("idem")
///     .with_acquire_timeout(Duration::from_secs(2));
/// assert_eq!(opts.max_connections(), 32);
/// assert_eq!(opts.schema(), Some("idem"));
/// assert_eq!(opts.display_url(), "postgres://idem:***@db/idem?max_connections=32");
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct PgOptions {
    connect: PgConnectOptions,
    display_url: String,
    max_connections: u32,
    /// `None`: not given (none).
    thread_connections: Option<u32>,
    min_connections: u32,
    acquire_timeout: Duration,
    connect_timeout: Duration,
    idle_timeout: Option<Duration>,
    migrate: bool,
    test_before_acquire: bool,
    ping_after_idle: Duration,
    schema: Option<String>,
    group_commit: bool,
    group_commit_max: u32,
    group_commit_in_flight: u32,
}

impl std::fmt::Debug for PgOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgOptions")
            .field("url", &self.display_url)
            .field("max_connections", &self.max_connections)
            .field("thread_connections", &self.thread_connections)
            .field("min_connections", &self.min_connections)
            .field("acquire_timeout", &self.acquire_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("migrate", &self.migrate)
            .field("test_before_acquire", &self.test_before_acquire)
            .field("ping_after_idle", &self.ping_after_idle)
            .field("schema", &self.schema)
            .field("group_commit", &self.group_commit)
            .field("group_commit_max", &self.group_commit_max)
            .field("group_commit_in_flight", &self.group_commit_in_flight)
            .finish_non_exhaustive()
    }
}

impl PgOptions {
    /// Default options for explicit connection options.
    pub fn new(connect: PgConnectOptions) -> Self {
        let display_url = format!(
            "postgres://{}@{}:{}/{}",
            connect.get_username(),
            connect.get_host(),
            connect.get_port(),
            connect.get_database().unwrap_or_default()
        );
        Self {
            // sqlx logs each statement (DEBUG) and each one slower than 1 s
            // (WARN, with its whole text) under its own target; the store
            // reports slow operations itself (store time-out, latency
            // metrics), and `idem migrate` must print only its own lines.
            connect: connect.disable_statement_logging(),
            display_url,
            max_connections: 16,
            thread_connections: None,
            min_connections: 0,
            acquire_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            idle_timeout: Some(Duration::from_secs(600)),
            migrate: true,
            test_before_acquire: true,
            ping_after_idle: Duration::from_secs(1),
            schema: None,
            group_commit: true,
            group_commit_max: batch::GroupCommit::DEFAULT.max_batch,
            group_commit_in_flight: batch::GroupCommit::DEFAULT.in_flight,
        }
    }

    /// Parses `postgres://user:password@host:port/database?options` (or
    /// `postgresql://…`). Besides the driver's own options (`sslmode`,
    /// `application_name`, `options`…), idem reads `max_connections=N`,
    /// `thread_connections=N`, `min_connections=N`, `acquire_timeout_ms=N`, `connect_timeout_ms=N`,
    /// `schema=NAME`, `migrate=true|false`, `test_before_acquire=true|false`,
    /// `ping_after_idle_ms=N` (0 pings before every operation),
    /// `group_commit=true|false`, `group_commit_max=N` and
    /// `group_commit_in_flight=N`.
    ///
    /// Fails with [`PgError::Url`] (password redacted) on another scheme,
    /// an option without a value, a URL the driver refuses, a value an
    /// option does not take, or settings that do not fit together.
    pub fn from_url(url: &str) -> Result<Self, PgError> {
        let bad = |reason: String| PgError::Url {
            url: idem::store::redact_url(url),
            reason,
        };
        if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
            return Err(bad(
                "must start with postgres:// or postgresql://".to_owned()
            ));
        }
        let (base, query) = QueryOptions::split(url);
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
        let connect: PgConnectOptions = driver_url
            .parse()
            .map_err(|e: sqlx::Error| bad(e.to_string()))?;
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
            "thread_connections" => {
                let n = option.value()?.parse().map_err(|_| {
                    option.invalid_value("a whole number of connections, 0 for none".to_owned())
                })?;
                self.thread_connections = Some(n);
            }
            "min_connections" => self.min_connections = option.positive_u32()?,
            "acquire_timeout_ms" => self.acquire_timeout = millis(option.positive_u32()?),
            "connect_timeout_ms" => self.connect_timeout = millis(option.positive_u32()?),
            "schema" => self.schema = Some(option.value()?.to_owned()),
            "group_commit_max" => self.group_commit_max = option.positive_u32()?,
            "group_commit_in_flight" => self.group_commit_in_flight = option.positive_u32()?,
            "ping_after_idle_ms" => self.ping_after_idle = option.millis()?,
            "migrate" => self.migrate = option.flag()?,
            "group_commit" => self.group_commit = option.flag()?,
            "test_before_acquire" => self.test_before_acquire = option.flag()?,
            _ => {}
        }
        Ok(())
    }

    /// How to reach the server (host, database, credentials, TLS mode…).
    pub fn connect_options(&self) -> &PgConnectOptions {
        &self.connect
    }

    /// Uses other connection options (to reach the server through a
    /// proxy, say, or under another `application_name`). The URL shown in
    /// messages ([`display_url`](Self::display_url)) stays the one the
    /// options came from.
    pub fn with_connect_options(mut self, connect: PgConnectOptions) -> Self {
        self.connect = connect;
        self
    }

    /// The URL the options came from, password redacted, for messages.
    pub fn display_url(&self) -> &str {
        &self.display_url
    }

    /// Most connections the store opens (default 16): the pool's, and
    /// [`thread_connections`](Self::thread_connections) of them for
    /// threads of their own.
    pub fn max_connections(&self) -> u32 {
        self.max_connections
    }

    /// Sets the store's maximum number of connections.
    pub fn with_max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }

    /// How many of [`max_connections`](Self::max_connections) may be
    /// connections of a thread's own (default 0; URL
    /// `thread_connections=N`): one each for threads
    /// [dedicated](idem::store::local::dedicate_current_thread) to one
    /// single-threaded runtime, opened by that thread, so that its event
    /// loop hears the server's answers and a round trip wakes no other
    /// thread. The pool opens at most the rest, and must keep at least one.
    /// The gateway sets it to its number of serving threads, up to half of
    /// `max_connections` and leaving the pool its `min_connections`,
    /// unless the URL gives it.
    pub fn thread_connections(&self) -> u32 {
        self.thread_connections.unwrap_or(0)
    }

    /// Sets [`thread_connections`](Self::thread_connections).
    pub fn with_thread_connections(mut self, n: u32) -> Self {
        self.thread_connections = Some(n);
        self
    }

    /// Whether [`thread_connections`](Self::thread_connections) was given
    /// (in the URL or by [`with_thread_connections`](Self::with_thread_connections)).
    pub fn thread_connections_given(&self) -> bool {
        self.thread_connections.is_some()
    }

    /// Most connections the pool opens: those not set aside for threads
    /// of their own.
    pub(crate) fn pool_connections(&self) -> u32 {
        self.max_connections
            .saturating_sub(self.thread_connections())
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

    /// How long [`PgStore::connect_with`](crate::PgStore::connect_with)
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
    /// are closed after this (default 10 minutes); `None` keeps them.
    pub fn idle_timeout(&self) -> Option<Duration> {
        self.idle_timeout
    }

    /// Sets when idle connections are closed; `None` keeps them open.
    pub fn with_idle_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// Whether [`PgStore::connect_with`](crate::PgStore::connect_with)
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
    /// default), so that a connection that died while idle (a server
    /// restart during a quiet spell) is replaced instead of failing an
    /// operation. Only connections idle for at least
    /// [`ping_after_idle`](Self::ping_after_idle) are pinged. Off, a dead
    /// connection fails one operation with
    /// [`StoreError::Unavailable`](idem::StoreError::Unavailable) before
    /// the pool replaces it.
    pub fn test_before_acquire(&self) -> bool {
        self.test_before_acquire
    }

    /// Sets whether idle connections are pinged before use (see
    /// [`test_before_acquire`](Self::test_before_acquire)).
    pub fn with_test_before_acquire(mut self, ping: bool) -> Self {
        self.test_before_acquire = ping;
        self
    }

    /// How long a connection must have sat idle to be pinged before use
    /// (default 1 s; zero pings before every operation). Under load
    /// connections go straight back to work and no round trip is spent on
    /// pings — a ping per operation costs 10–25 % of the gateway's
    /// PostgreSQL throughput (docs/BENCHMARKS.md#current-figures).
    pub fn ping_after_idle(&self) -> Duration {
        self.ping_after_idle
    }

    /// Sets how long a connection must have sat idle to be pinged before
    /// use (see [`ping_after_idle`](Self::ping_after_idle)).
    pub fn with_ping_after_idle(mut self, idle: Duration) -> Self {
        self.ping_after_idle = idle;
        self
    }

    /// A PostgreSQL schema for the idem tables (created by migration if
    /// missing), set as every connection's `search_path`; `None` uses the
    /// server's default (usually `public`).
    pub fn schema(&self) -> Option<&str> {
        self.schema.as_deref()
    }

    /// Uses `schema` for the idem tables (see [`schema`](Self::schema)):
    /// 1 to 63 letters, digits or underscores, checked at connect.
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// Whether concurrent reservations (and concurrent resolutions) are
    /// grouped into one statement and one commit (on by default). While
    /// fewer than [`group_commit_in_flight`](Self::group_commit_in_flight)
    /// statements of a kind run, an operation runs alone, as it comes;
    /// when they all run, operations queue and the next free slot runs
    /// them together. Off, every operation is its own statement.
    pub fn group_commit(&self) -> bool {
        self.group_commit
    }

    /// Turns group commit on or off (see
    /// [`group_commit`](Self::group_commit)).
    pub fn with_group_commit(mut self, on: bool) -> Self {
        self.group_commit = on;
        self
    }

    /// Most operations one grouped statement carries (default 64).
    pub fn group_commit_max(&self) -> u32 {
        self.group_commit_max
    }

    /// Sets how many operations one grouped statement carries at most.
    pub fn with_group_commit_max(mut self, n: u32) -> Self {
        self.group_commit_max = n;
        self
    }

    /// Most statements of one kind (reservations, resolutions) running at
    /// once, each on a connection of the pool (default 2). Fewer make
    /// larger groups: on two cores, 2 serve 1.3× the requests of 4
    /// (docs/BENCHMARKS.md#current-figures). A grouped statement that waits (on
    /// a row another transaction holds uncommitted, say a caller's own
    /// [`PgStore::reserve_in`](crate::PgStore::reserve_in)) holds up the
    /// operations queued behind it.
    pub fn group_commit_in_flight(&self) -> u32 {
        self.group_commit_in_flight
    }

    /// Sets how many statements of one kind run at once (see
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
        if self.thread_connections() >= self.max_connections {
            return Err(format!(
                "thread_connections ({}) must be below max_connections ({}): the pool keeps at least one",
                self.thread_connections(),
                self.max_connections
            ));
        }
        if self.min_connections > self.pool_connections() {
            return Err(format!(
                "min_connections ({}) exceeds the pool's {} connections (max_connections less thread_connections)",
                self.min_connections,
                self.pool_connections()
            ));
        }
        if let Some(schema) = &self.schema
            && (schema.is_empty()
                || schema.len() > 63
                || !schema
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_'))
        {
            return Err(format!(
                "schema {schema:?} must be 1 to 63 letters, digits or underscores"
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
        let o = PgOptions::from_url("postgres://app:pw@db:5433/idem").expect("valid");
        assert_eq!(o.connect_options().get_host(), "db");
        assert_eq!(o.connect_options().get_port(), 5433);
        assert_eq!(o.connect_options().get_database(), Some("idem"));
        assert_eq!(o.display_url(), "postgres://app:***@db:5433/idem");
        assert!(!format!("{o:?}").contains("pw"), "Debug redacts");
        assert!(o.migrate());
        let o = PgOptions::from_url(
            "postgresql://db/idem?max_connections=4&acquire_timeout_ms=250&connect_timeout_ms=100&schema=idem_x&migrate=false&test_before_acquire=false&application_name=gw",
        )
        .expect("valid");
        assert_eq!(o.max_connections(), 4);
        assert_eq!(o.acquire_timeout(), Duration::from_millis(250));
        assert_eq!(o.connect_timeout(), Duration::from_millis(100));
        assert_eq!(o.schema(), Some("idem_x"));
        assert!(!o.migrate());
        assert!(!o.test_before_acquire());
        assert_eq!(o.connect_options().get_application_name(), Some("gw"));
        assert_eq!(o.ping_after_idle(), Duration::from_secs(1), "default");
        let o = PgOptions::from_url("postgres://db/idem?ping_after_idle_ms=0").expect("valid");
        assert_eq!(o.ping_after_idle(), Duration::ZERO);
        assert!(o.group_commit(), "default");
        assert_eq!((o.group_commit_max(), o.group_commit_in_flight()), (64, 2));
        let o = PgOptions::from_url(
            "postgres://db/idem?group_commit=false&group_commit_max=8&group_commit_in_flight=3",
        )
        .expect("valid");
        assert!(!o.group_commit());
        assert_eq!((o.group_commit_max(), o.group_commit_in_flight()), (8, 3));
        assert_eq!(o.thread_connections(), 0, "none unless asked");
        assert!(!o.thread_connections_given());
        let o = PgOptions::from_url("postgres://db/idem?max_connections=8&thread_connections=2")
            .expect("valid");
        assert_eq!((o.thread_connections(), o.pool_connections()), (2, 6));
        assert!(o.thread_connections_given());
        let o = PgOptions::from_url("postgres://db/idem?thread_connections=0").expect("valid");
        assert!(o.thread_connections_given(), "0 is an answer: none");
    }

    #[test]
    fn bad_urls_say_what_is_wrong() {
        for (url, needle) in [
            ("mysql://db/idem", "must start with postgres://"),
            ("redis://:s3cret@db", "must start with postgres://"),
            ("postgres://db/idem?max_connections=0", "positive integer"),
            ("postgres://db/idem?max_connections=x", "positive integer"),
            ("postgres://db/idem?migrate=maybe", "true or false"),
            ("postgres://db/idem?group_commit=yes", "true or false"),
            ("postgres://db/idem?group_commit_max=0", "positive integer"),
            (
                "postgres://db/idem?group_commit_in_flight=-1",
                "positive integer",
            ),
            (
                "postgres://db/idem?ping_after_idle_ms=soon",
                "whole number of milliseconds",
            ),
            ("postgres://db/idem?schema=a;b", "letters, digits"),
            ("postgres://db/idem?pool", "has no value"),
            (
                "postgres://u:s3cret@db:port/idem",
                "invalid PostgreSQL store URL",
            ),
            ("postgres://u:s3cret@db/idem?sslmode=sometimes", "sslmode"),
            (
                "postgres://db/idem?min_connections=9&max_connections=2",
                "exceeds",
            ),
            (
                "postgres://db/idem?max_connections=2&thread_connections=2",
                "the pool keeps at least one",
            ),
            (
                "postgres://db/idem?max_connections=4&thread_connections=2&min_connections=3",
                "exceeds the pool's 2 connections",
            ),
            ("postgres://db/idem?thread_connections=-1", "0 for none"),
        ] {
            let err = PgOptions::from_url(url).expect_err(url).to_string();
            assert!(err.contains(needle), "{url}: {err}");
            assert!(!err.contains("s3cret"), "{err}");
        }
    }

    /// An operation of the tests' own for a [`batch::Batcher`], on record `n`.
    struct Op(batch::RecordId);

    impl batch::Batched for Op {
        fn record(&self) -> &batch::RecordId {
            &self.0
        }
    }

    fn op(n: usize) -> Op {
        Op(("t".to_owned(), "op".to_owned(), format!("k-{n}")))
    }

    /// Polls `fut` once, with a waker that does nothing: a later `.await`
    /// polls it again with a real one.
    fn poll_once<F: std::future::Future + Unpin>(fut: &mut F) -> std::task::Poll<F::Output> {
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        std::pin::Pin::new(fut).poll(&mut cx)
    }

    /// `with_group_commit_in_flight(3)` and `with_group_commit_max(2)` are
    /// their URL options, and bound the store's collector: three operations
    /// at once run alone, each holding a slot; with every slot busy the
    /// next ones queue, and run in statements of at most two once slots
    /// free.
    #[tokio::test]
    async fn group_commit_settings_bound_the_slots_and_the_statements() {
        let built = PgOptions::from_url("postgres://db/idem")
            .expect("valid")
            .with_group_commit_max(2)
            .with_group_commit_in_flight(3);
        let group = built.group().expect("group commit is on");
        let pool =
            sqlx::postgres::PgPoolOptions::new().connect_lazy_with(built.connect_options().clone());
        let statements = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let batcher = batch::Batcher::start(
            crate::conns::Conns::new(pool, None, 0),
            group,
            std::sync::Arc::default(),
            {
                let statements = std::sync::Arc::clone(&statements);
                move |_conns, ops: Vec<Op>| {
                    statements.lock().expect("statements").push(ops.len());
                    std::future::ready(Ok(vec![(); ops.len()]))
                }
            },
            batch::classify,
        );
        let mut slots = Vec::new();
        for n in 0..3 {
            let mut turn = Box::pin(batcher.turn(|| op(n)));
            match poll_once(&mut turn) {
                std::task::Poll::Ready(Ok(batch::Answer::Alone(Some(slot)))) => slots.push(slot),
                std::task::Poll::Ready(_) => panic!("operation {n}: not alone in a slot"),
                std::task::Poll::Pending => panic!("operation {n} of 3 found no free slot"),
            }
        }
        let mut queued: Vec<_> = (3..8)
            .map(|n| Box::pin(batcher.turn(move || op(n))))
            .collect();
        for turn in &mut queued {
            assert!(poll_once(turn).is_pending(), "every slot is busy: queued");
        }
        drop(slots);
        for turn in queued {
            assert!(
                matches!(turn.await, Ok(batch::Answer::Done(()))),
                "run in a grouped statement"
            );
        }
        let statements = statements.lock().expect("statements").clone();
        assert_eq!(statements.iter().sum::<usize>(), 5, "{statements:?}");
        assert!(statements.iter().all(|&n| n <= 2), "{statements:?}");
        let from_url =
            PgOptions::from_url("postgres://db/idem?group_commit_max=2&group_commit_in_flight=3")
                .expect("valid");
        assert_eq!(Some(group), from_url.group());
    }

    /// Options the store refuses, at parsing and at connect (before any
    /// connection is tried): a group of 0 operations or 0 statements at
    /// once, and more connections kept open than the pool has.
    #[tokio::test]
    async fn group_commit_and_min_connections_bounds_are_enforced() {
        let base =
            PgOptions::from_url("postgres://127.0.0.1:1/idem?max_connections=4").expect("valid");
        assert!(base.clone().with_min_connections(4).validate().is_ok());
        for (opts, needle) in [
            (base.clone().with_group_commit_max(0), "at least 1"),
            (base.clone().with_group_commit_in_flight(0), "at least 1"),
            (
                base.clone().with_min_connections(5),
                "min_connections (5) exceeds",
            ),
        ] {
            let err = opts.validate().expect_err(needle);
            assert!(err.contains(needle), "{err}");
            let refused = crate::PgStore::connect_with(opts).await.expect_err(needle);
            assert!(
                matches!(&refused, PgError::Url { reason, .. } if reason.contains(needle)),
                "{refused}"
            );
        }
        assert_eq!(
            base.clone().with_min_connections(3).min_connections(),
            PgOptions::from_url("postgres://127.0.0.1:1/idem?max_connections=4&min_connections=3")
                .expect("valid")
                .min_connections()
        );
    }
}

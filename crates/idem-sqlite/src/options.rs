//! [`SqliteOptions`]: the database file and how the store uses it, from a
//! `sqlite://` URL or built in code.

use std::path::{Path, PathBuf};
use std::time::Duration;

use idem::store::backend::{QueryOption, QueryOptionError, QueryOptions};

use crate::error::SqliteError;

/// The options a store URL may carry.
/// The longest busy time-out SQLite takes (an `int` of milliseconds).
pub(crate) const MAX_BUSY_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);

const KNOWN: [&str; 4] = ["synchronous", "max_batch", "readers", "busy_timeout_ms"];

/// How commits reach the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Synchronous {
    /// fsync the WAL on every commit: an answered write survives power loss.
    #[default]
    Full,
    /// fsync only at checkpoints: survives a process crash, not power loss.
    Normal,
}

/// Options for [`SqliteStore::open_with`](crate::SqliteStore::open_with).
/// Defaults: durable (`Synchronous::Full`), batches of up to 512
/// operations, 4 reader connections, 5 s busy timeout.
///
/// ```
/// use std::time::Duration;
/// use idem_sqlite::{SqliteOptions, Synchronous};
///
/// # fn main() -> Result<(), idem_sqlite::SqliteError> {
/// let opts = SqliteOptions::from_url("sqlite:///var/lib/idem/idem.db?readers=8")?
///     .with_busy_timeout(Duration::from_secs(1));
/// assert_eq!(opts.path(), std::path::Path::new("/var/lib/idem/idem.db"));
/// assert_eq!(opts.readers(), 8);
/// assert_eq!(opts.synchronous(), Synchronous::Full);
///
/// let baseline = SqliteOptions::new("bench.db").with_max_batch(1);
/// assert_eq!(baseline.max_batch(), 1);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SqliteOptions {
    path: PathBuf,
    synchronous: Synchronous,
    max_batch: usize,
    readers: usize,
    busy_timeout: Duration,
    queue: usize,
}

impl SqliteOptions {
    /// Default options for a file.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            synchronous: Synchronous::Full,
            max_batch: 512,
            readers: 4,
            busy_timeout: Duration::from_secs(5),
            queue: 8192,
        }
    }

    /// Parses `sqlite://PATH[?option=value&…]`. `sqlite://idem.db` is
    /// relative to the working directory, `sqlite:///var/lib/idem.db`
    /// absolute. Options: `synchronous=full|normal`, `max_batch=N`,
    /// `readers=N`, `busy_timeout_ms=N`.
    ///
    /// Fails with [`SqliteError::Url`] on another scheme, a missing path,
    /// `:memory:`, an option without a value, an unknown option, or a
    /// value an option does not take.
    pub fn from_url(url: &str) -> Result<Self, SqliteError> {
        let bad = |reason: String| SqliteError::Url {
            url: url.to_owned(),
            reason,
        };
        let rest = url
            .strip_prefix("sqlite://")
            .ok_or_else(|| bad("must start with sqlite://".to_owned()))?;
        let (path, query) = QueryOptions::split(rest);
        if path.is_empty() {
            return Err(bad("no file path after sqlite://".to_owned()));
        }
        if path == ":memory:" {
            return Err(bad(
                "in-memory SQLite is not supported; use idem::MemoryStore for a store without a file"
                    .to_owned(),
            ));
        }
        let mut opts = Self::new(path);
        for option in query {
            opts.set(&option).map_err(|e| bad(e.to_string()))?;
        }
        Ok(opts)
    }

    /// Applies one option from a URL.
    fn set(&mut self, option: &QueryOption<'_>) -> Result<(), QueryOptionError> {
        option.value()?;
        match option.name() {
            "synchronous" => {
                self.synchronous = option
                    .choice(&[("full", Synchronous::Full), ("normal", Synchronous::Normal)])?;
            }
            "max_batch" => self.max_batch = option.positive_usize()?,
            "readers" => self.readers = option.positive_usize()?,
            "busy_timeout_ms" => {
                let timeout = option.positive_millis()?;
                if timeout > MAX_BUSY_TIMEOUT {
                    return Err(option.invalid_value(format!(
                        "at most {} (SQLite's limit, about 24 days)",
                        MAX_BUSY_TIMEOUT.as_millis()
                    )));
                }
                self.busy_timeout = timeout;
            }
            _ => return Err(option.unknown(&KNOWN)),
        }
        Ok(())
    }

    /// The database file; created if missing (its directory must exist).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Durability of commits (default [`Synchronous::Full`]).
    pub fn synchronous(&self) -> Synchronous {
        self.synchronous
    }

    /// Sets the durability of commits.
    pub fn with_synchronous(mut self, synchronous: Synchronous) -> Self {
        self.synchronous = synchronous;
        self
    }

    /// Most operations committed together (default 512). `1` turns group
    /// commit off (one transaction per operation), which is the benchmark
    /// baseline.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Sets how many operations are committed together at most (see
    /// [`max_batch`](Self::max_batch)); 0 counts as 1.
    pub fn with_max_batch(mut self, n: usize) -> Self {
        self.max_batch = n;
        self
    }

    /// Reader connections for `get` and `list` (default 4).
    pub fn readers(&self) -> usize {
        self.readers
    }

    /// Sets how many reader connections are opened; 0 counts as 1.
    pub fn with_readers(mut self, n: usize) -> Self {
        self.readers = n;
        self
    }

    /// How long to wait for a lock held by another process (default 5 s).
    pub fn busy_timeout(&self) -> Duration {
        self.busy_timeout
    }

    /// Sets how long to wait for a lock held by another process (at most
    /// about 24 days, SQLite's limit; a longer one is cut to it).
    pub fn with_busy_timeout(mut self, timeout: Duration) -> Self {
        self.busy_timeout = timeout.min(MAX_BUSY_TIMEOUT);
        self
    }

    /// Operations that may wait for the writer before callers are slowed
    /// (default 8192).
    pub fn queue(&self) -> usize {
        self.queue
    }

    /// Sets how many operations may wait for the writer before callers
    /// are slowed; 0 counts as 1.
    pub fn with_queue(mut self, n: usize) -> Self {
        self.queue = n;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_parsing() {
        let o = SqliteOptions::from_url("sqlite://idem.db").expect("valid");
        assert_eq!(o.path(), Path::new("idem.db"));
        assert_eq!(o.synchronous(), Synchronous::Full);
        let o = SqliteOptions::from_url("sqlite:///var/lib/idem/x.db?synchronous=normal&max_batch=1&readers=2&busy_timeout_ms=100")
            .expect("valid");
        assert_eq!(o.path(), Path::new("/var/lib/idem/x.db"));
        assert_eq!(o.synchronous(), Synchronous::Normal);
        assert_eq!((o.max_batch(), o.readers()), (1, 2));
        assert_eq!(o.busy_timeout(), Duration::from_millis(100));
    }

    #[test]
    fn busy_timeouts_past_sqlites_limit_are_cut_to_it() {
        let o = SqliteOptions::new("x.db").with_busy_timeout(Duration::MAX);
        assert_eq!(o.busy_timeout(), MAX_BUSY_TIMEOUT);
    }

    #[test]
    fn bad_urls_say_what_is_wrong() {
        for (url, needle) in [
            ("postgres://x", "must start with sqlite://"),
            ("sqlite://", "no file path"),
            ("sqlite://:memory:", "MemoryStore"),
            ("sqlite://x.db?max_batch=0", "positive integer"),
            ("sqlite://x.db?max_batch=lots", "positive integer"),
            ("sqlite://x.db?synchronous=off", "full or normal"),
            ("sqlite://x.db?fast", "has no value"),
            ("sqlite://x.db?colour=blue", "unknown option"),
            // SQLite takes a busy time-out in an int of milliseconds;
            // rusqlite panics past it.
            (
                "sqlite://x.db?busy_timeout_ms=2147483648",
                "at most 2147483647",
            ),
        ] {
            let err = SqliteOptions::from_url(url).expect_err(url).to_string();
            assert!(err.contains(needle), "{url}: {err}");
        }
    }

    /// A store opened with `opts` on `idem.db` in `dir`.
    fn open(dir: &tempfile::TempDir, opts: SqliteOptions) -> crate::SqliteStore {
        assert_eq!(opts.path(), dir.path().join("idem.db"));
        crate::SqliteStore::open_with(opts).expect("open")
    }

    fn url(dir: &tempfile::TempDir, query: &str) -> String {
        format!("sqlite://{}?{query}", dir.path().join("idem.db").display())
    }

    /// `with_readers(n)` is `?readers=n`, and the store opens that many
    /// reader connections, each with a permit to use it; 0 counts as 1.
    #[test]
    fn with_readers_opens_that_many_reader_connections() {
        let dir = tempfile::tempdir().expect("temp dir");
        let base = || SqliteOptions::new(dir.path().join("idem.db"));
        for (n, opened) in [(1, 1), (3, 3), (0, 1)] {
            let store = open(&dir, base().with_readers(n));
            let connections = crate::lock(&store.readers).len();
            let permits = store.reader_slots.available_permits();
            assert_eq!(
                (connections, permits),
                (opened, opened),
                "with_readers({n})"
            );
        }
        assert_eq!(
            base().with_readers(3),
            SqliteOptions::from_url(&url(&dir, "readers=3")).expect("valid")
        );
    }

    /// `PRAGMA synchronous` of the store's connection, read on the writer
    /// (where commits happen) and on a reader.
    async fn synchronous_pragma(store: &crate::SqliteStore) -> (i64, i64) {
        let pragma = |conn: &rusqlite::Connection| {
            conn.pragma_query_value(None, "synchronous", |row| row.get::<_, i64>(0))
        };
        let writer = store
            .write(move |conn, _| pragma(conn).map_err(crate::to_store))
            .await
            .expect("writer");
        let reader = store
            .read(move |conn| Ok(pragma(conn)?))
            .await
            .expect("reader");
        (writer, reader)
    }

    /// `with_synchronous` is `?synchronous=`, and sets `PRAGMA synchronous`
    /// on every connection: NORMAL (1) or FULL (2, the default).
    #[tokio::test]
    async fn with_synchronous_sets_the_pragma_on_the_writer_and_readers() {
        let dir = tempfile::tempdir().expect("temp dir");
        let base = || SqliteOptions::new(dir.path().join("idem.db"));
        for (synchronous, pragma) in [(Synchronous::Normal, 1), (Synchronous::Full, 2)] {
            let store = open(&dir, base().with_synchronous(synchronous));
            assert_eq!(
                synchronous_pragma(&store).await,
                (pragma, pragma),
                "{synchronous:?}"
            );
        }
        assert_eq!(
            base().with_synchronous(Synchronous::Normal),
            SqliteOptions::from_url(&url(&dir, "synchronous=normal")).expect("valid")
        );
        assert_eq!(
            base().with_synchronous(Synchronous::Full),
            SqliteOptions::from_url(&url(&dir, "synchronous=full")).expect("valid")
        );
    }

    /// `with_queue(n)`: n operations fit in the writer's queue, the next
    /// caller waits for room; 0 counts as 1. (No URL option sets it.)
    #[tokio::test]
    async fn with_queue_bounds_the_operations_waiting_for_the_writer() {
        let dir = tempfile::tempdir().expect("temp dir");
        for (n, room) in [(3, 3), (1, 1), (0, 1)] {
            let store = open(
                &dir,
                SqliteOptions::new(dir.path().join("idem.db")).with_queue(n),
            );
            let writer = store.writer.as_ref().expect("running");
            assert_eq!(writer.max_capacity(), room, "with_queue({n})");
            // Places taken, not sent: the writer never sees them.
            let taken: Vec<_> = std::iter::from_fn(|| writer.try_reserve().ok()).collect();
            assert_eq!(taken.len(), room, "with_queue({n})");
            drop(taken);
        }
    }
}

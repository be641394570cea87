//! Choosing and connecting the store from its URL.
//!
//! | URL | store |
//! |---|---|
//! | `sqlite://PATH[?…]` | embedded SQLite (default `sqlite://idem.db`) |
//! | `postgres://…`, `postgresql://…` | PostgreSQL, shared by many gateways |
//! | `redis://…`, `rediss://…` | Redis (a bounded window: see its crate docs) |
//! | `tiered:redis://…,postgres://…` | Redis answers replays, PostgreSQL decides |
//! | `memory://` | in process, nothing survives (tests, demos) |
//!
//! A URL that cannot be understood, or an embedded file that cannot be
//! opened, stops the gateway at start with one line. A server that cannot
//! be reached does not: the gateway starts, `/readyz` fails and protected
//! routes answer per their fail mode, while the connection is retried in
//! the background until it succeeds — no restart needed.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use idem::HashSecret;
use idem::{
    DynStore, FinalOutcome, IdempotencyKey, Lease, ListFilter, ListRecords, MemoryStore, Page,
    Purge, Record, Reservation, ReserveRequest, Scope, Store, StoreError, Tiered, Timestamp,
};
use idem_http::Hashing;
use idem_postgres::{PgOptions, PgStore};
use idem_redis::{RedisOptions, RedisStore};
use idem_sqlite::SqliteStore;

use idem::seal::Sealed;
use idem::store::redact_url as redact;

use crate::config::{CacheSettings, SealSettings};
use crate::metrics::{StoreOp, StoreOpMetrics};
use crate::server::error_chain;

/// A store URL, understood but not yet connected.
#[derive(Debug, Clone)]
pub enum StoreUrl {
    /// `sqlite://…`.
    Sqlite(String),
    /// `memory://`.
    Memory,
    /// `postgres://…`.
    Postgres(Box<PgOptions>),
    /// `redis://…`.
    Redis(Box<RedisOptions>),
    /// `tiered:redis://…,postgres://…`.
    Tiered(Box<RedisOptions>, Box<PgOptions>),
}

impl StoreUrl {
    /// Parses a store URL; the error is one line, password redacted.
    pub fn parse(url: &str) -> Result<Self, String> {
        if let Some(rest) = url.strip_prefix("tiered:") {
            let (fast, durable) = rest.split_once(',').ok_or_else(|| {
                format!(
                    "store {}: write tiered:redis://…,postgres://…",
                    redact_tiered(url)
                )
            })?;
            let fast = RedisOptions::from_url(fast.trim()).map_err(|e| error_chain(&e))?;
            let durable = PgOptions::from_url(durable.trim()).map_err(|e| error_chain(&e))?;
            return Ok(Self::Tiered(Box::new(fast), Box::new(durable)));
        }
        let scheme = url.split_once("://").map(|(s, _)| s).unwrap_or("");
        match scheme {
            "sqlite" => Ok(Self::Sqlite(url.to_owned())),
            "memory" => Ok(Self::Memory),
            "postgres" | "postgresql" => PgOptions::from_url(url)
                .map(|o| Self::Postgres(Box::new(o)))
                .map_err(|e| error_chain(&e)),
            "redis" | "rediss" | "redis+cluster" | "rediss+cluster" => RedisOptions::from_url(url)
                .map(|o| Self::Redis(Box::new(o)))
                .map_err(|e| error_chain(&e)),
            _ => Err(format!(
                "store {}: unknown store URL scheme {scheme:?}; expected sqlite://, postgres://, redis://, tiered:redis://…,postgres://… or memory://",
                redact(url)
            )),
        }
    }

    /// The backend's name: `sqlite`, `memory`, `postgres`, `redis`, `tiered`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Sqlite(_) => "sqlite",
            Self::Memory => "memory",
            Self::Postgres(_) => "postgres",
            Self::Redis(_) => "redis",
            Self::Tiered(..) => "tiered",
        }
    }

    /// The same store, opened only if it already exists: an SQLite file
    /// that is not there is an error (instead of a new empty database), and
    /// a PostgreSQL schema is not migrated. For operator commands.
    pub fn existing(self) -> Result<Self, String> {
        Ok(match self {
            Self::Sqlite(url) => {
                let opts =
                    idem_sqlite::SqliteOptions::from_url(&url).map_err(|e| error_chain(&e))?;
                if !opts.path.is_file() {
                    return Err(format!(
                        "{url}: no database file at {} (idem serve creates it; check the path)",
                        opts.path.display()
                    ));
                }
                Self::Sqlite(url)
            }
            Self::Postgres(o) => Self::Postgres(Box::new((*o).with_migrate(false))),
            Self::Tiered(fast, durable) => {
                Self::Tiered(fast, Box::new((*durable).with_migrate(false)))
            }
            other => other,
        })
    }

    /// Whether the store is a server that may come and go (retried), as
    /// opposed to a file or memory (opened once, fatal on error).
    pub fn is_remote(&self) -> bool {
        matches!(self, Self::Postgres(_) | Self::Redis(_) | Self::Tiered(..))
    }

    /// How this store's tenants and fingerprints are hashed, given the
    /// configured secret (see [`Hashing`]):
    ///
    /// * a configured secret keys them;
    /// * the embedded store keeps a secret of its own beside its
    ///   database (`<file>.secret`, mode 0600), made at first start;
    /// * `memory://` makes one per process (its records die with it);
    /// * a shared store refuses to start without one: gateways that share
    ///   a store must share the secret, or none finds the others' records.
    ///
    /// `accept_v1_until` (or a secret made beside a database that already
    /// held records: the longest `retention` from now) keeps finding
    /// records written before keyed hashing until then.
    pub fn hashing(
        &self,
        secret: Option<Arc<HashSecret>>,
        accept_v1_until: Option<SystemTime>,
        retention: Duration,
    ) -> Result<Hashing, String> {
        let (secret, until) = match (secret, self) {
            (Some(secret), _) => (secret, accept_v1_until),
            (None, Self::Memory) => (Arc::new(HashSecret::generate().0), None),
            (None, Self::Sqlite(url)) => {
                let opts =
                    idem_sqlite::SqliteOptions::from_url(url).map_err(|e| error_chain(&e))?;
                let (secret, until) = embedded_secret(&opts.path, retention)?;
                (secret, accept_v1_until.or(until))
            }
            (None, shared) => {
                return Err(format!(
                    "a {} store is shared by every gateway that uses it, and they must share one hash secret for tenants and fingerprints: set {} (openssl rand -hex 32) or hash_secret_file in the config file. Upgrading a store that already holds records? Also set accept_v1_until = \"{}\" (now plus the longest retention) so their retries still find them",
                    shared.kind(),
                    crate::config::HASH_SECRET_ENV,
                    humantime::format_rfc3339_seconds(SystemTime::now() + retention),
                ));
            }
        };
        let hashing = Hashing::keyed(secret);
        Ok(match until {
            Some(until) if SystemTime::now() < until => {
                tracing::info!(until = %humantime::format_rfc3339_seconds(until), "records written before keyed hashing are looked for until then (one extra store read per new key)");
                hashing.with_earlier_until(until)
            }
            _ => hashing,
        })
    }

    /// Connects (and, for PostgreSQL, migrates unless `migrate=false`).
    pub async fn connect(&self) -> Result<DynStore, String> {
        match self {
            Self::Sqlite(url) => {
                let url = url.clone();
                tokio::task::spawn_blocking(move || {
                    SqliteStore::open_url(&url)
                        .map(DynStore::new)
                        .map_err(|e| format!("store {url}: {}", error_chain(&e)))
                })
                .await
                .map_err(|e| format!("opening the store failed: {e}"))?
            }
            Self::Memory => Ok(DynStore::new(MemoryStore::new())),
            Self::Postgres(o) => PgStore::connect_with((**o).clone())
                .await
                .map(|store| {
                    crate::metrics::watch_group_commit(&store);
                    DynStore::new(store)
                })
                .map_err(|e| error_chain(&e)),
            Self::Redis(o) => RedisStore::connect_with((**o).clone())
                .await
                .map(DynStore::new)
                .map_err(|e| error_chain(&e)),
            Self::Tiered(fast, durable) => {
                let durable = PgStore::connect_with((**durable).clone())
                    .await
                    .map_err(|e| error_chain(&e))?;
                let fast = RedisStore::connect_with((**fast).clone())
                    .await
                    .map_err(|e| error_chain(&e))?;
                crate::metrics::watch_group_commit(&durable);
                Ok(DynStore::new(Tiered::new(fast, durable)))
            }
        }
    }
}

/// The embedded store's own hash secret, beside its database: read, or
/// made (mode 0600) at first start. Made beside a database that already
/// exists (records from before keyed hashing), the file also says until
/// when those are looked for: `retention` from now.
fn embedded_secret(
    db: &Path,
    retention: Duration,
) -> Result<(Arc<HashSecret>, Option<SystemTime>), String> {
    let mut name = db.as_os_str().to_owned();
    name.push(".secret");
    let path = PathBuf::from(name);
    let read = |path: &Path| {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read the hash secret {}: {e}", path.display()))?;
        crate::config::parse_secret_file(&text)
            .map(|(s, until)| (Arc::new(s), until))
            .map_err(|e| format!("{}: {e}", path.display()))
    };
    if path.exists() {
        return read(&path);
    }
    let (secret, hex) = HashSecret::generate();
    let existing = std::fs::metadata(db).is_ok_and(|m| m.len() > 0);
    let until = existing.then(|| SystemTime::now() + retention);
    let mut text = format!(
        "# The secret keying this database's tenants and fingerprints (made by idem serve).\n# Keep it with the database: without it, no retry finds its record.\n{hex}\n"
    );
    if let Some(until) = until {
        text.push_str(&format!(
            "# The database held records from before keyed hashing: looked for until then.\naccept_v1_until = {}\n",
            humantime::format_rfc3339_seconds(until)
        ));
    }
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    match options.open(&path) {
        Ok(mut file) => {
            use std::io::Write as _;
            file.write_all(text.as_bytes())
                .and_then(|()| file.sync_all())
                .map_err(|e| format!("cannot write the hash secret {}: {e}", path.display()))?;
            tracing::info!(file = %path.display(), "made a hash secret for this database: keep it with the database");
            Ok((Arc::new(secret), until))
        }
        // Another gateway made it first.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => read(&path),
        Err(e) => Err(format!(
            "cannot create the hash secret {}: {e}",
            path.display()
        )),
    }
}

/// `idem migrate`: brings the store's schema to this build's version and
/// says what it did; an error (unreachable, refused, newer schema) is one
/// line for a non-zero exit.
pub async fn migrate(url: &str) -> Result<String, String> {
    let pg = |o: &PgOptions| o.clone().with_migrate(true);
    match StoreUrl::parse(url)? {
        StoreUrl::Sqlite(u) => {
            // Opening applies the migrations.
            StoreUrl::Sqlite(u.clone()).connect().await?;
            Ok(format!("{u}: schema up to date"))
        }
        StoreUrl::Postgres(o) | StoreUrl::Tiered(_, o) => {
            PgStore::connect_with(pg(&o))
                .await
                .map_err(|e| error_chain(&e))?;
            Ok(format!("{}: schema up to date", redact(url)))
        }
        StoreUrl::Redis(_) => Ok(format!(
            "{}: Redis keeps no schema; nothing to migrate",
            redact(url)
        )),
        StoreUrl::Memory => Ok("memory://: nothing to migrate".to_owned()),
    }
}

fn redact_tiered(url: &str) -> String {
    url.split(',').map(redact).collect::<Vec<_>>().join(",")
}

/// A store that may still be connecting: until it is, every operation
/// fails as [`StoreError::Unavailable`] with the last connection error, so
/// routes answer per their fail mode and `/readyz` reports it.
#[derive(Debug, Clone)]
pub struct GatewayStore {
    ready: Arc<OnceLock<DynStore>>,
    last_error: Arc<Mutex<String>>,
    kind: &'static str,
    ops: StoreOpMetrics,
    cache: Option<CacheSettings>,
    timeout: Duration,
    seal: Option<SealSettings>,
}

impl GatewayStore {
    /// Opens the store: at once for files and memory (errors are fatal);
    /// for servers, a first attempt now and, if it fails, retries in the
    /// background with backoff. With `cache`, a bounded in-process copy of
    /// recent records sits in front of it (see [`CacheSettings`]). Each
    /// operation on the request path gets `timeout` to answer (see
    /// [`Settings::store_timeout`](crate::config::Settings::store_timeout)).
    /// With `seal`, response bodies are sealed at rest (the copies in
    /// the in-process cache stay clear: they never leave memory).
    pub async fn open(
        url: &str,
        cache: Option<CacheSettings>,
        timeout: Duration,
        seal: Option<SealSettings>,
    ) -> Result<Self, String> {
        let parsed = StoreUrl::parse(url)?;
        let store = Self {
            ready: Arc::new(OnceLock::new()),
            last_error: Arc::new(Mutex::new(String::new())),
            kind: parsed.kind(),
            ops: StoreOpMetrics::new(parsed.kind()),
            // An in-memory store needs no copy of itself.
            cache: cache.filter(|_| !matches!(parsed, StoreUrl::Memory)),
            timeout,
            seal,
        };
        match parsed.connect().await {
            Ok(s) => store.set(s),
            Err(err) if parsed.is_remote() => {
                tracing::warn!(reason = "store_unreachable", %err, "store unreachable at start; serving per fail mode and retrying in the background");
                *store.last_error.lock().unwrap_or_else(|p| p.into_inner()) = err;
                let retry = store.clone();
                tokio::spawn(async move { retry.keep_connecting(parsed).await });
            }
            Err(err) => return Err(err),
        }
        Ok(store)
    }

    async fn keep_connecting(self, url: StoreUrl) {
        let mut pause = Duration::from_millis(250);
        loop {
            tokio::time::sleep(pause).await;
            match url.connect().await {
                Ok(s) => {
                    self.set(s);
                    tracing::info!(
                        reason = "store_connected",
                        "store reachable; protection active"
                    );
                    return;
                }
                Err(err) => {
                    tracing::debug!(%err, "store still unreachable");
                    *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = err;
                    pause = (pause * 2).min(Duration::from_secs(5));
                }
            }
        }
    }

    fn set(&self, store: DynStore) {
        let store = match &self.seal {
            Some(seal) => DynStore::new(
                Sealed::new(store, Arc::clone(&seal.keys)).with_require_sealed(seal.require_sealed),
            ),
            None => store,
        };
        let store = match self.cache {
            Some(c) => DynStore::new(Tiered::new(MemoryStore::cache(c.size, c.max_age), store)),
            None => store,
        };
        let _ = self.ready.set(store);
    }

    /// The backend's name, as in the metrics' `store` label.
    pub fn kind(&self) -> &'static str {
        self.kind
    }

    fn store(&self) -> Result<&DynStore, StoreError> {
        self.ready.get().ok_or_else(|| {
            StoreError::unavailable(format!(
                "store not connected yet: {}",
                self.last_error.lock().unwrap_or_else(|p| p.into_inner())
            ))
        })
    }
}

impl GatewayStore {
    /// Runs a request-path operation within the store time-out: a store
    /// that stops answering (a black-holed link, a hung server) holds a
    /// request at most that long; then it counts as unavailable and the
    /// route's fail mode answers. The operation may still take effect on
    /// the server; the record's lease and fencing make that harmless.
    async fn bounded<T>(
        &self,
        op: StoreOp,
        fut: impl Future<Output = Result<T, StoreError>>,
    ) -> Result<T, StoreError> {
        let timeout = self.timeout;
        self.ops
            .timed(op, async move {
                tokio::time::timeout(timeout, fut)
                    .await
                    .unwrap_or_else(|_| {
                        Err(StoreError::unavailable(format!(
                            "no answer from the store within {timeout:?}"
                        )))
                    })
            })
            .await
    }
}

impl Store for GatewayStore {
    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        self.bounded(StoreOp::Reserve, async { self.store()?.reserve(req).await })
            .await
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.bounded(StoreOp::Get, async { self.store()?.get(scope, key).await })
            .await
    }

    async fn resolve(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        outcome: &FinalOutcome,
    ) -> Result<(), StoreError> {
        self.bounded(StoreOp::Resolve, async {
            self.store()?.resolve(scope, key, lease, outcome).await
        })
        .await
    }

    async fn release(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        self.bounded(StoreOp::Release, async {
            self.store()?.release(scope, key, lease).await
        })
        .await
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        reason: &str,
    ) -> Result<(), StoreError> {
        self.bounded(StoreOp::MarkUnknown, async {
            self.store()?.mark_unknown(scope, key, lease, reason).await
        })
        .await
    }

    async fn renew(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        duration: Duration,
    ) -> Result<Timestamp, StoreError> {
        self.bounded(StoreOp::Renew, async {
            self.store()?.renew(scope, key, lease, duration).await
        })
        .await
    }
}

impl ListRecords for GatewayStore {
    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        self.ops
            .timed(StoreOp::List, async { self.store()?.list(filter).await })
            .await
    }
}

impl Purge for GatewayStore {
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        self.ops
            .timed(StoreOp::Purge, async {
                self.store()?.purge_expired(batch).await
            })
            .await
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        self.ops
            .timed(StoreOp::Delete, async {
                self.store()?.delete(scope, key).await
            })
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    #[test]
    fn a_secret_made_beside_a_database_with_records_looks_for_them_for_one_retention() {
        let dir = tempfile::tempdir().expect("temp dir");
        let day = Duration::from_secs(86_400);
        // A database that already exists: records from before keyed hashing.
        let old = dir.path().join("old.db");
        std::fs::write(&old, b"SQLite format 3\0").expect("write");
        let (secret, until) = embedded_secret(&old, day).expect("made");
        let until = until.expect("earlier records are looked for");
        let left = until
            .duration_since(SystemTime::now())
            .expect("in the future");
        assert!(
            left <= day && left > day - Duration::from_secs(60),
            "{left:?}"
        );
        // Read back, the same secret and the same deadline.
        let (again, until_again) = embedded_secret(&old, day).expect("read");
        assert_eq!(secret.tenant(b"c"), again.tenant(b"c"));
        assert_eq!(
            until_again
                .map(humantime::format_rfc3339_seconds)
                .map(|t| t.to_string()),
            Some(humantime::format_rfc3339_seconds(until).to_string())
        );
        // A new database has none to look for.
        let (_, none) = embedded_secret(&dir.path().join("new.db"), day).expect("made");
        assert_eq!(none, None);
        // A secret file that is not one is refused, without quoting it.
        std::fs::write(dir.path().join("bad.db.secret"), "0123 not hex").expect("write");
        let err = embedded_secret(&dir.path().join("bad.db"), day).expect_err("bad");
        assert!(err.contains("hex") && !err.contains("0123"), "{err}");
        // memory:// makes its own; a shared store without one is refused.
        let memory = StoreUrl::Memory.hashing(None, None, day).expect("memory");
        assert!(memory.is_keyed() && !memory.finds_earlier());
        let pg = StoreUrl::parse("postgres://u@127.0.0.1/test").expect("url");
        assert!(
            pg.hashing(None, None, day)
                .expect_err("refused")
                .contains("IDEM_HASH_SECRET")
        );
        let given = Arc::new(HashSecret::generate().0);
        let upgrading = pg
            .hashing(Some(given), Some(SystemTime::now() + day), day)
            .expect("keyed");
        assert!(upgrading.finds_earlier());
    }

    #[test]
    fn urls_are_understood_or_refused_in_one_line() {
        assert!(matches!(
            StoreUrl::parse("sqlite://idem.db"),
            Ok(StoreUrl::Sqlite(_))
        ));
        assert!(matches!(StoreUrl::parse("memory://"), Ok(StoreUrl::Memory)));
        assert!(matches!(
            StoreUrl::parse("postgres://u@127.0.0.1/test"),
            Ok(StoreUrl::Postgres(_))
        ));
        assert!(matches!(
            StoreUrl::parse("redis://127.0.0.1:6379/2"),
            Ok(StoreUrl::Redis(_))
        ));
        assert!(matches!(
            StoreUrl::parse("tiered:redis://127.0.0.1:6379,postgres://u@127.0.0.1/test"),
            Ok(StoreUrl::Tiered(..))
        ));
        for (url, needle) in [
            ("mysql://u:pw@h/db", "unknown store URL scheme"),
            ("tiered:redis://127.0.0.1", "tiered:redis://"),
            ("tiered:postgres://u:pw@h/db,redis://h", "redis"),
        ] {
            let err = StoreUrl::parse(url).expect_err(url);
            assert!(err.contains(needle), "{url}: {err}");
            assert!(!err.contains("pw@"), "password leaked: {err}");
            assert!(!err.contains('\n'), "one line: {err}");
        }
    }

    #[tokio::test]
    async fn files_fail_at_once_servers_are_retried() {
        let err = GatewayStore::open("sqlite:///nonexistent-dir/x.db", None, SECOND, None)
            .await
            .expect_err("missing dir");
        assert!(err.contains("/nonexistent-dir/x.db"), "{err}");
        // Nothing listens on port 1: the gateway starts, the store reports why.
        let store = GatewayStore::open(
            "postgres://postgres@127.0.0.1:1/test?connect_timeout_ms=200",
            None,
            SECOND,
            None,
        )
        .await
        .expect("starts anyway");
        let scope = Scope::new("t", "op").expect("scope");
        let key: IdempotencyKey = "k".parse().expect("key");
        let err = store.get(&scope, &key).await.expect_err("not connected");
        assert!(err.is_transient());
        assert!(
            error_chain(&err).contains("not connected yet"),
            "{}",
            error_chain(&err)
        );
    }
}

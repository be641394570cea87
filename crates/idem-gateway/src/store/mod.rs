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
//! opened, stops the gateway at start with one line; so does a server that
//! refuses for good (wrong password, no such database), since waiting will
//! not change its answer. A server that cannot be reached does not: the
//! gateway starts, `/readyz` fails and protected
//! routes answer per their fail mode, while the connection is retried in
//! the background until it succeeds — no restart needed.

mod hashing;
mod lock;
mod url;

pub use lock::ServingLock;
pub use url::StoreUrl;

use std::future::Future;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use idem::{DynStore, MemoryStore, StoreError, Tiered};

use idem::seal::Sealed;
use idem::store::{Around, Hook, Op};

use crate::config::{CacheSettings, SealSettings};
use crate::error::{GatewayError, error_chain};
use crate::metrics::StoreOpMetrics;

/// The gateway's store: every operation goes through the [`Connection`]
/// hook (the store may still be connecting; each operation is timed, and
/// bounded by the store time-out on the request path).
pub type GatewayStore = Around<Connection>;

/// Opens the store: at once for files and memory (errors are fatal);
/// for servers, a first attempt now and, if it fails, retries in the
/// background with backoff. With `cache`, a bounded in-process copy of
/// recent records sits in front of it (see [`CacheSettings`]). Each
/// operation on the request path gets `timeout` to answer (see
/// [`Settings::store_timeout`](crate::config::Settings::store_timeout)).
/// With `seal`, response bodies are sealed at rest (the copies in
/// the in-process cache stay clear: they never leave memory). `threads`
/// serving threads call it ([`StoreUrl::for_serving_threads`]).
pub async fn open(
    url: &str,
    cache: Option<CacheSettings>,
    timeout: Duration,
    seal: Option<SealSettings>,
    threads: usize,
) -> Result<GatewayStore, GatewayError> {
    let parsed = StoreUrl::parse(url)?.for_serving_threads(threads);
    let conn = Connection {
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
        Ok(s) => conn.set(s),
        Err(err) if parsed.is_remote() && err.is_transient() => {
            let err = error_chain(&err);
            tracing::warn!(reason = "store_unreachable", %err, "store unreachable at start; serving per fail mode and retrying in the background");
            *conn.last_error.lock().unwrap_or_else(|p| p.into_inner()) = err;
            let retry = conn.clone();
            tokio::spawn(async move { retry.keep_connecting(parsed).await });
        }
        Err(err) => return Err(err),
    }
    Ok(Around::new(conn))
}

/// A store that may still be connecting: until it is, every operation
/// fails as [`StoreError::Unavailable`] with the last connection error, so
/// routes answer per their fail mode and `/readyz` reports it.
#[derive(Debug, Clone)]
pub struct Connection {
    ready: Arc<OnceLock<DynStore>>,
    last_error: Arc<Mutex<String>>,
    kind: &'static str,
    ops: StoreOpMetrics,
    cache: Option<CacheSettings>,
    timeout: Duration,
    seal: Option<SealSettings>,
}

impl Connection {
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
                    let err = error_chain(&err);
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

impl Hook for Connection {
    type Inner = DynStore;

    /// Times every operation. One on the request path also runs within the
    /// store time-out: a store that stops answering (a black-holed link, a
    /// hung server) holds a request at most that long; then it counts as
    /// unavailable and the route's fail mode answers. The operation may
    /// still take effect on the server; the record's lease and fencing make
    /// that harmless. Operator operations (list, purge, delete) are not
    /// bounded.
    fn around<'a, T, Fut>(
        &'a self,
        op: Op,
        call: impl FnOnce(&'a DynStore) -> Fut + Send + 'a,
    ) -> impl Future<Output = Result<T, StoreError>> + Send + 'a
    where
        T: Send + 'a,
        Fut: Future<Output = Result<T, StoreError>> + Send + 'a,
    {
        let timeout = self.timeout;
        let bounded = !matches!(op, Op::List | Op::Purge | Op::Delete);
        self.ops.timed(op, async move {
            let work = call(self.store()?);
            if !bounded {
                return work.await;
            }
            tokio::time::timeout(timeout, work)
                .await
                .unwrap_or_else(|_| {
                    Err(StoreError::unavailable(format!(
                        "no answer from the store within {timeout:?}"
                    )))
                })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::hashing::embedded_secret;
    use idem::HashSecret;
    use idem::{IdempotencyKey, Scope, Store};
    use std::time::SystemTime;

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
        let err = error_chain(&embedded_secret(&dir.path().join("bad.db"), day).expect_err("bad"));
        assert!(err.contains("hex") && !err.contains("0123"), "{err}");
        // memory:// makes its own; a shared store without one is refused.
        let memory = StoreUrl::Memory.hashing(None, None, day).expect("memory");
        assert!(memory.is_keyed() && !memory.accepts_v1());
        let pg = StoreUrl::parse("postgres://u@127.0.0.1/test").expect("url");
        assert!(
            error_chain(&pg.hashing(None, None, day).expect_err("refused"))
                .contains("IDEM_HASH_SECRET")
        );
        let given = Arc::new(HashSecret::generate().0);
        let upgrading = pg
            .hashing(Some(given), Some(SystemTime::now() + day), day)
            .expect("keyed");
        assert!(upgrading.accepts_v1());
    }

    #[test]
    fn postgres_sets_aside_a_connection_per_serving_thread_unless_told() {
        let own = |url: &str, threads| match StoreUrl::parse(url)
            .expect("url")
            .for_serving_threads(threads)
        {
            StoreUrl::Postgres(o) | StoreUrl::Tiered(_, o) => o.thread_connections(),
            other => panic!("{other:?}"),
        };
        assert_eq!(own("postgres://u@db/idem", 2), 2);
        assert_eq!(
            own("postgres://u@db/idem?max_connections=3", 2),
            1,
            "up to half"
        );
        assert_eq!(own("postgres://u@db/idem?max_connections=1", 2), 0);
        assert_eq!(
            own(
                "postgres://u@db/idem?max_connections=4&min_connections=3",
                2
            ),
            1,
            "the pool keeps its min_connections"
        );
        assert_eq!(
            own("postgres://u@db/idem?thread_connections=0", 2),
            0,
            "told"
        );
        assert_eq!(
            own("postgres://u@db/idem?thread_connections=5", 2),
            5,
            "told"
        );
        assert_eq!(own("postgres://u@db/idem", 0), 0, "no serving threads");
        assert_eq!(
            own("tiered:redis://127.0.0.1:6379,postgres://u@db/idem", 4),
            4
        );
    }

    #[test]
    fn urls_are_understood_or_refused_in_one_line() {
        assert!(matches!(
            StoreUrl::parse("sqlite://idem.db"),
            Ok(StoreUrl::Sqlite(_))
        ));
        let embedded = StoreUrl::embedded(std::path::Path::new("/tmp/idem demo.db"));
        assert!(
            matches!(StoreUrl::parse(&embedded), Ok(StoreUrl::Sqlite(ref u)) if *u == embedded),
            "{embedded}"
        );
        assert!(matches!(StoreUrl::parse("memory://"), Ok(StoreUrl::Memory)));
        assert!(matches!(
            StoreUrl::parse("postgres://u@127.0.0.1/test"),
            Ok(StoreUrl::Postgres(_))
        ));
        assert!(matches!(
            StoreUrl::parse("redis://127.0.0.1:6379/2"),
            Ok(StoreUrl::Redis(_))
        ));
        #[cfg(feature = "dynamodb")]
        {
            let url =
                StoreUrl::parse("dynamodb://idem?region=us-east-1&endpoint=http://127.0.0.1:8000")
                    .expect("dynamodb");
            assert_eq!(url.kind(), "dynamodb");
            assert!(url.is_remote());
            let refused = url
                .hashing(None, None, std::time::Duration::from_secs(60))
                .expect_err("a shared store needs the secret");
            assert!(
                refused.to_string().contains("a dynamodb store is shared"),
                "{refused}"
            );
        }
        #[cfg(feature = "mysql")]
        for mysql in [
            "mysql://u@127.0.0.1/test",
            "mariadb://u@127.0.0.1:3306/test",
        ] {
            let url = StoreUrl::parse(mysql).expect(mysql);
            assert!(matches!(url, StoreUrl::MySql(_)), "{mysql}");
            assert_eq!(url.kind(), "mysql");
            assert!(url.is_remote() && url.lists_cheaply());
            // Shared by every gateway on it: never without the hash secret.
            let refused = url
                .hashing(None, None, std::time::Duration::from_secs(60))
                .expect_err("a shared store needs the secret");
            assert!(
                refused.to_string().contains("a mysql store is shared"),
                "{refused}"
            );
        }
        assert!(matches!(
            StoreUrl::parse("tiered:redis://127.0.0.1:6379,postgres://u@127.0.0.1/test"),
            Ok(StoreUrl::Tiered(..))
        ));
        // The binary speaks Redis Cluster, alone or as the fast tier (its
        // node list has commas of its own).
        assert!(matches!(
            StoreUrl::parse("redis+cluster://127.0.0.1:7000,127.0.0.1:7001?min_replicas=1"),
            Ok(StoreUrl::Redis(o)) if o.min_replicas() == 1
        ));
        assert!(matches!(
            StoreUrl::parse(
                "tiered:redis+cluster://127.0.0.1:7000,127.0.0.1:7001,postgres://u@h1,h2/test"
            ),
            Ok(StoreUrl::Tiered(..))
        ));
        for (url, needle) in [
            ("oracle://u:pw@h/db", "unknown store URL scheme"),
            ("mysql://u:pw@h", "mysql://"),
            (
                "idem.db",
                "a store is a URL with a scheme (for the embedded store's database file idem.db, write sqlite://idem.db)",
            ),
            (
                "postgres:u:pw@h/db",
                "(write it with ://, as in postgres://…)",
            ),
            ("tiered:redis://127.0.0.1", "tiered:redis://"),
            ("tiered:postgres://u:pw@h/db,redis://h", "redis"),
        ] {
            let err = error_chain(&StoreUrl::parse(url).expect_err(url));
            assert!(err.contains(needle), "{url}: {err}");
            assert!(!err.contains("pw@"), "password leaked: {err}");
            assert!(!err.contains('\n'), "one line: {err}");
        }
    }

    #[tokio::test]
    async fn files_fail_at_once_servers_are_retried() {
        let err = open("sqlite:///nonexistent-dir/x.db", None, SECOND, None, 1)
            .await
            .expect_err("missing dir");
        let err = error_chain(&err);
        assert!(err.contains("/nonexistent-dir/x.db"), "{err}");
        // Nothing listens on port 1: the gateway starts, the store reports why.
        let store = open(
            "postgres://postgres@127.0.0.1:1/test?connect_timeout_ms=200",
            None,
            SECOND,
            None,
            1,
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

    /// DynamoDB's clock bound and item limit reach every route: a lease
    /// it cannot cover is refused, stored bodies are capped to fit.
    #[cfg(feature = "dynamodb")]
    #[test]
    fn dynamodb_fits_the_routes_to_its_clock_bound_and_item_limit() {
        use http::Method;
        use idem_http::{RoutePolicy, Routes};
        let url =
            StoreUrl::parse("dynamodb://idem?region=us-east-1&max_skew_ms=1000").expect("dynamodb");
        let lease = |secs| {
            RoutePolicy::default().with_engine(
                idem::Policy::default().with_lease(std::time::Duration::from_secs(secs)),
            )
        };
        let short = Routes::default()
            .route(Method::POST, "/a", lease(2))
            .expect("route");
        let err = url
            .fit_routes(short)
            .expect_err("2 s is not over twice 1 s");
        assert!(
            err.to_string().contains("lease of 2s is too short"),
            "{err}"
        );
        let routes = Routes::default()
            .route(
                Method::POST,
                "/a",
                lease(30).with_max_stored_response(1024 * 1024),
            )
            .expect("route")
            .route(Method::POST, "/b", lease(30).with_max_stored_response(1024))
            .expect("route");
        let fitted = url.fit_routes(routes).expect("fits");
        let limits: Vec<usize> = fitted.policies().map(|p| p.max_stored_response).collect();
        assert_eq!(
            limits,
            [
                url::DYNAMO_MAX_STORED_RESPONSE,
                1024,
                url::DYNAMO_MAX_STORED_RESPONSE
            ]
        );
        // Other stores leave the routes as they are.
        let pg = StoreUrl::parse("postgres://u@h/db").expect("pg");
        let routes = Routes::default()
            .route(Method::POST, "/a", lease(1))
            .expect("route");
        assert!(pg.fit_routes(routes).is_ok());
    }
}

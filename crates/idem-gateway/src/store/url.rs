//! [`StoreUrl`]: the only code that knows the store URL schemes, what
//! each backend needs to be opened, and how its hashes are keyed.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use idem::HashSecret;
use idem::{DynStore, MemoryStore, Tiered};
#[cfg(feature = "dynamodb")]
use idem_dynamodb::{DynamoOptions, DynamoStore};
use idem_http::Hashing;
#[cfg(feature = "mysql")]
use idem_mysql::{MySqlOptions, MySqlStore};
use idem_postgres::{PgOptions, PgStore};
use idem_redis::{RedisOptions, RedisStore};
use idem_sqlite::SqliteStore;

use idem::store::redact_url as redact;

use super::hashing::embedded_secret;
use crate::error::GatewayError;

/// The largest answer body a DynamoDB record keeps: its item holds 400 KB
/// in all, and the key, fingerprint, times and headers take the rest.
#[cfg(feature = "dynamodb")]
pub(crate) const DYNAMO_MAX_STORED_RESPONSE: usize = 350 * 1024;

/// A store URL, understood but not yet connected.
#[derive(Debug, Clone)]
pub enum StoreUrl {
    /// `sqlite://…`.
    Sqlite(String),
    /// `memory://`.
    Memory,
    /// `postgres://…`.
    Postgres(Box<PgOptions>),
    /// `mysql://…` or `mariadb://…`.
    #[cfg(feature = "mysql")]
    MySql(Box<MySqlOptions>),
    /// `dynamodb://TABLE?…`.
    #[cfg(feature = "dynamodb")]
    Dynamo(Box<DynamoOptions>),
    /// `redis://…`.
    Redis(Box<RedisOptions>),
    /// `tiered:redis://…,postgres://…`.
    Tiered(Box<RedisOptions>, Box<PgOptions>),
}

impl StoreUrl {
    /// Parses a store URL; the error is one line, password redacted.
    pub fn parse(url: &str) -> Result<Self, GatewayError> {
        if let Some(rest) = url.strip_prefix("tiered:") {
            // The durable part starts at `,postgres`: a cluster's node
            // list before it has commas of its own.
            let split = rest
                .find(",postgres://")
                .or_else(|| rest.find(",postgresql://"))
                .map(|at| (&rest[..at], &rest[at + 1..]));
            let (fast, durable) = split.ok_or_else(|| {
                GatewayError::StoreUrl(format!(
                    "store {}: write tiered:redis://…,postgres://…",
                    redact_tiered(url)
                ))
            })?;
            let fast = RedisOptions::from_url(fast.trim())?;
            let durable = PgOptions::from_url(durable.trim())?;
            return Ok(Self::Tiered(Box::new(fast), Box::new(durable)));
        }
        let scheme = url.split_once("://").map(|(s, _)| s).unwrap_or("");
        match scheme {
            "sqlite" => Ok(Self::Sqlite(url.to_owned())),
            "memory" => Ok(Self::Memory),
            "postgres" | "postgresql" => PgOptions::from_url(url)
                .map(|o| Self::Postgres(Box::new(o)))
                .map_err(GatewayError::from),
            #[cfg(feature = "mysql")]
            "mysql" | "mariadb" => MySqlOptions::from_url(url)
                .map(|o| Self::MySql(Box::new(o)))
                .map_err(GatewayError::from),
            #[cfg(not(feature = "mysql"))]
            "mysql" | "mariadb" => Err(GatewayError::StoreUrl(format!(
                "store {}: this idem was built without the MySQL store (cargo feature mysql)",
                redact(url)
            ))),
            #[cfg(feature = "dynamodb")]
            "dynamodb" => DynamoOptions::from_url(url)
                .map(|o| Self::Dynamo(Box::new(o)))
                .map_err(GatewayError::from),
            #[cfg(not(feature = "dynamodb"))]
            "dynamodb" => Err(GatewayError::StoreUrl(format!(
                "store {}: this idem was built without the DynamoDB store (cargo feature dynamodb)",
                redact(url)
            ))),
            "redis" | "rediss" | "redis+cluster" | "rediss+cluster" => RedisOptions::from_url(url)
                .map(|o| Self::Redis(Box::new(o)))
                .map_err(GatewayError::from),
            "" => Err(GatewayError::StoreUrl(format!(
                "store {}: a store is a URL with a scheme{}; expected sqlite://, postgres://, mysql://, dynamodb://, redis://, tiered:redis://…,postgres://… or memory://",
                redact(url),
                Self::meant(url)
            ))),
            _ => Err(GatewayError::StoreUrl(format!(
                "store {}: unknown store URL scheme {scheme:?}; expected sqlite://, postgres://, mysql://, dynamodb://, redis://, tiered:redis://…,postgres://… or memory://",
                redact(url)
            ))),
        }
    }

    /// For a store written without a scheme, the URL it most likely meant:
    /// a file path is the embedded store's database.
    fn meant(url: &str) -> String {
        let url = url.trim();
        match url.split_once(':') {
            Some((
                "postgres" | "postgresql" | "mysql" | "mariadb" | "redis" | "sqlite" | "memory",
                _,
            )) => {
                format!(
                    " (write it with ://, as in {}://…)",
                    url.split(':').next().unwrap_or("")
                )
            }
            Some(_) => String::new(),
            None if url.is_empty() => String::new(),
            None => format!(
                " (for the embedded store's database file {url}, write {})",
                Self::embedded(std::path::Path::new(url))
            ),
        }
    }

    /// The URL of the embedded store in the database file `path`.
    pub fn embedded(path: &std::path::Path) -> String {
        format!("sqlite://{}", path.display())
    }

    /// The backend's name: `sqlite`, `memory`, `postgres`, `mysql`,
    /// `dynamodb`, `redis`, `tiered`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Sqlite(_) => "sqlite",
            Self::Memory => "memory",
            Self::Postgres(_) => "postgres",
            #[cfg(feature = "mysql")]
            Self::MySql(_) => "mysql",
            #[cfg(feature = "dynamodb")]
            Self::Dynamo(_) => "dynamodb",
            Self::Redis(_) => "redis",
            Self::Tiered(..) => "tiered",
        }
    }

    /// The same store, for a gateway with `threads` serving threads: unless
    /// the URL says otherwise (`thread_connections=`), PostgreSQL sets
    /// aside one connection per serving thread, up to half of
    /// `max_connections` and leaving the pool its `min_connections`, for
    /// that thread's own use (see [`PgOptions::thread_connections`]).
    pub fn for_serving_threads(self, threads: usize) -> Self {
        let own = |o: Box<PgOptions>| {
            if o.thread_connections_given() {
                return o;
            }
            let (max, min) = (o.max_connections(), o.min_connections());
            let n = u32::try_from(threads)
                .unwrap_or(u32::MAX)
                .min(max / 2)
                .min(max.saturating_sub(min));
            Box::new(o.with_thread_connections(n))
        };
        match self {
            Self::Postgres(o) => Self::Postgres(own(o)),
            Self::Tiered(fast, durable) => Self::Tiered(fast, own(durable)),
            other => other,
        }
    }

    /// `routes` as this store can keep their promises, or why it cannot.
    /// DynamoDB has no clock of its own, so each gateway's clock may be
    /// off by up to `max_skew`: a lease must outlast twice that, or two
    /// gateways could both hold one key. Its items hold at most 400 KB,
    /// so an answer body larger than 350 KiB is
    /// kept as a record without its body (replayed as not retained),
    /// whatever a route's `max_stored_response` says.
    pub fn fit_routes(&self, routes: idem_http::Routes) -> Result<idem_http::Routes, GatewayError> {
        match self {
            #[cfg(feature = "dynamodb")]
            Self::Dynamo(o) => {
                let skew = o.max_skew();
                if let Some(short) = routes.policies().find(|p| p.engine.lease <= 2 * skew) {
                    return Err(GatewayError::StoreUrl(format!(
                        "a lease of {} is too short for dynamodb:// with max_skew_ms={}: each gateway's clock may be off by max_skew, so every lease must exceed twice it (raise lease, or lower max_skew_ms)",
                        humantime::format_duration(short.engine.lease),
                        skew.as_millis()
                    )));
                }
                let mut lowered = 0;
                let routes = routes.map_policies(|p| {
                    if p.max_stored_response > DYNAMO_MAX_STORED_RESPONSE {
                        p.max_stored_response = DYNAMO_MAX_STORED_RESPONSE;
                        lowered += 1;
                    }
                });
                if lowered > 0 {
                    tracing::info!(
                        routes = lowered,
                        max_stored_response = DYNAMO_MAX_STORED_RESPONSE,
                        "dynamodb:// keeps answer bodies up to 350 KiB (an item holds 400 KB): larger ones are recorded without their body and replayed as not retained"
                    );
                }
                Ok(routes)
            }
            _ => Ok(routes),
        }
    }

    /// The same store, opened only if it already exists: an SQLite file
    /// that is not there is an error (instead of a new empty database), and
    /// a PostgreSQL or MySQL schema is not migrated. For operator commands.
    pub fn existing(self) -> Result<Self, GatewayError> {
        Ok(match self {
            Self::Sqlite(url) => {
                let opts = idem_sqlite::SqliteOptions::from_url(&url)?;
                if !opts.path().is_file() {
                    return Err(GatewayError::StoreUrl(format!(
                        "{url}: no database file at {} (idem serve creates it; check the path)",
                        opts.path().display()
                    )));
                }
                Self::Sqlite(url)
            }
            Self::Postgres(o) => Self::Postgres(Box::new((*o).with_migrate(false))),
            #[cfg(feature = "mysql")]
            Self::MySql(o) => Self::MySql(Box::new((*o).with_migrate(false))),
            #[cfg(feature = "dynamodb")]
            Self::Dynamo(o) => Self::Dynamo(Box::new((*o).with_migrate(false))),
            Self::Tiered(fast, durable) => {
                Self::Tiered(fast, Box::new((*durable).with_migrate(false)))
            }
            other => other,
        })
    }

    /// Whether listing the store's records is cheap enough for the
    /// stuck-record monitor to run by default: not on Redis alone, where a
    /// listing scans every key (the tiered store lists through PostgreSQL).
    pub fn lists_cheaply(&self) -> bool {
        !matches!(self, Self::Redis(_))
    }

    /// Whether the store is a server that may come and go (retried), as
    /// opposed to a file or memory (opened once, fatal on error).
    pub fn is_remote(&self) -> bool {
        !matches!(self, Self::Sqlite(_) | Self::Memory)
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
    ) -> Result<Hashing, GatewayError> {
        let (secret, until) = match (secret, self) {
            (Some(secret), _) => (secret, accept_v1_until),
            (None, Self::Memory) => (Arc::new(HashSecret::generate().0), None),
            (None, Self::Sqlite(url)) => {
                let opts = idem_sqlite::SqliteOptions::from_url(url)?;
                let (secret, until) = embedded_secret(opts.path(), retention)?;
                (secret, accept_v1_until.or(until))
            }
            (None, shared) => {
                return Err(GatewayError::StoreUrl(format!(
                    "a {} store is shared by every gateway that uses it, and they must share one hash secret for tenants and fingerprints: set {} (openssl rand -hex 32) or hash_secret_file in the config file. Upgrading a store that already holds records? Also set accept_v1_until = \"{}\" (now plus the longest retention) so their retries still find them",
                    shared.kind(),
                    crate::config::HASH_SECRET_ENV,
                    humantime::format_rfc3339_seconds(SystemTime::now() + retention),
                )));
            }
        };
        let hashing = Hashing::keyed(secret);
        Ok(match until {
            Some(until) if SystemTime::now() < until => {
                tracing::info!(until = %humantime::format_rfc3339_seconds(until), "records written before keyed hashing are looked for until then (one extra store read per new key)");
                hashing.accept_v1_until(until)
            }
            _ => hashing,
        })
    }

    /// For the embedded store, the [`ServingLock`](super::ServingLock) a
    /// serving gateway holds on its file; other stores need none.
    pub fn serving_lock(&self) -> Result<Option<super::ServingLock>, GatewayError> {
        match self {
            Self::Sqlite(url) => {
                let opts = idem_sqlite::SqliteOptions::from_url(url)?;
                super::ServingLock::acquire(opts.path()).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// Opens (creating and migrating) the embedded store at `url`, off the
    /// async threads: the one way the gateway opens a SQLite file.
    pub async fn open_embedded(url: &str) -> Result<SqliteStore, GatewayError> {
        let url = url.to_owned();
        tokio::task::spawn_blocking(move || {
            SqliteStore::open_url(&url).map_err(|source| GatewayError::SqliteOpen { url, source })
        })
        .await
        .map_err(|source| GatewayError::Task {
            context: "opening the store failed".to_owned(),
            source,
        })?
    }

    /// Connects (and, for PostgreSQL, MySQL and DynamoDB, migrates unless
    /// `migrate=false`).
    pub async fn connect(&self) -> Result<DynStore, GatewayError> {
        match self {
            Self::Sqlite(url) => Self::open_embedded(url).await.map(DynStore::new),
            Self::Memory => Ok(DynStore::new(MemoryStore::new())),
            Self::Postgres(o) => PgStore::connect_with((**o).clone())
                .await
                .map(|store| {
                    crate::metrics::watch_group_commit(&store);
                    DynStore::new(store)
                })
                .map_err(GatewayError::from),
            #[cfg(feature = "dynamodb")]
            Self::Dynamo(o) => DynamoStore::connect_with((**o).clone())
                .await
                .map(|store| {
                    crate::metrics::watch_items_too_large(&store);
                    DynStore::new(store)
                })
                .map_err(GatewayError::from),
            #[cfg(feature = "mysql")]
            Self::MySql(o) => MySqlStore::connect_with((**o).clone())
                .await
                .map(|store| {
                    crate::metrics::watch_group_commit(&store);
                    DynStore::new(store)
                })
                .map_err(GatewayError::from),
            Self::Redis(o) => RedisStore::connect_with((**o).clone())
                .await
                .map(DynStore::new)
                .map_err(GatewayError::from),
            Self::Tiered(fast, durable) => {
                let durable = PgStore::connect_with((**durable).clone()).await?;
                let fast = RedisStore::connect_with((**fast).clone()).await?;
                crate::metrics::watch_group_commit(&durable);
                Ok(DynStore::new(Tiered::new(fast, durable)))
            }
        }
    }
}

fn redact_tiered(url: &str) -> String {
    url.split(',').map(redact).collect::<Vec<_>>().join(",")
}

//! # idem-postgres — the PostgreSQL store
//!
//! A [`Store`] shared by any number of gateways or service instances, in
//! one table, `idem_records`:
//!
//! * **atomic reservation**: one `INSERT … ON CONFLICT DO NOTHING` that, in
//!   the same statement, reads back the existing row when there is one;
//!   lapsed leases and expired records are taken over by *conditional*
//!   `UPDATE`s on the exact version read, so two racers never both win;
//! * **fencing**: every resolution, release, mark and renewal matches the
//!   owner token and the attempt, or changes nothing and reports
//!   [`StoreError::Fenced`];
//! * **one clock**: every time is the database's `clock_timestamp()`
//!   (truncated to milliseconds), never a client's;
//! * **in your transaction**: [`PgStore::reserve_in`] and
//!   [`PgStore::resolve_in`] take the caller's
//!   [`sqlx::Transaction`], so the reservation, the business change and
//!   the answer commit or roll back together;
//! * **migrations**: versioned, in `migrations/*.sql`, applied under an
//!   advisory lock at connect (or by [`PgStore::migrate`]);
//! * a **bounded pool**: maximum size, acquire timeout, connect timeout;
//! * **group commit**: concurrent reservations share one statement and one
//!   commit, and so do concurrent resolutions (see
//!   [`PgOptions::group_commit`]); operations inside a caller's transaction
//!   are never grouped.
//!
//! ```no_run
//! use idem::{Engine, Fingerprint, Scope, StoredResponse};
//! use idem_postgres::PgStore;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = PgStore::connect("postgres://idem@127.0.0.1/idem").await?;
//! let engine = Engine::new(store);
//! let scope = Scope::new("acme", "POST /v1/payments")?;
//! let key = "pay-17".parse()?;
//! let fp = Fingerprint::builder().json_body(br#"{"amount":100}"#).finish();
//! engine
//!     .run(&scope, &key, fp, || async { StoredResponse::new(201, "paid") })
//!     .await?;
//! # Ok(())
//! # }
//! ```
//!
//! ## Reserving inside your own transaction
//!
//! ```no_run
//! use std::time::Duration;
//! use idem::{FinalOutcome, Fingerprint, LeaseExpiry, OwnerToken, Reservation,
//!            ReserveRequest, Scope, StoredResponse, Verdict};
//! use idem_postgres::PgStore;
//!
//! # async fn f(store: PgStore) -> Result<(), Box<dyn std::error::Error>> {
//! let scope = Scope::new("acme", "ship-order")?;
//! let key = "order-17".parse()?;
//! let mut tx = store.pool().begin().await?;
//! let req = ReserveRequest {
//!     scope: &scope,
//!     key: &key,
//!     fingerprint: Fingerprint::builder().part("order", b"17").finish(),
//!     owner: OwnerToken::random(),
//!     lease: Duration::from_secs(30),
//!     retention: Duration::from_secs(86_400),
//!     on_lease_expiry: LeaseExpiry::Retry,
//! };
//! if let Reservation::Acquired(lease) = store.reserve_in(&mut tx, req).await? {
//!     sqlx::query("UPDATE orders SET shipped = true WHERE id = 17")
//!         .execute(&mut *tx)
//!         .await?;
//!     let outcome = FinalOutcome {
//!         verdict: Verdict::Completed,
//!         response: StoredResponse::new(200, "shipped"),
//!         resource_id: Some("order-17".into()),
//!         error_code: None,
//!         retention: Duration::from_secs(86_400),
//!     };
//!     store.resolve_in(&mut tx, &scope, &key, &lease, &outcome).await?;
//! }
//! tx.commit().await?; // reservation, shipment and answer, all or nothing
//! # Ok(())
//! # }
//! ```
//!
//! Inside a caller's transaction the usual PostgreSQL rules apply: a
//! concurrent duplicate waits on the row until that transaction ends, and
//! under `REPEATABLE READ` or `SERIALIZABLE` a conflicting reservation may
//! fail with a serialization error ([`StoreError::Unavailable`]): retry the
//! transaction.

mod batch;
mod error;
pub mod guard;
pub mod inbox;
pub mod outbox;
mod schema;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idem::store::{Cursor, ExistingDecision, decide_existing};
use idem::{
    FinalOutcome, IdempotencyKey, Lease, ListFilter, ListRecords, Page, Purge, Record, Reservation,
    ReserveRequest, Scope, Store, StoreError, Timestamp,
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::{Connection, Executor, PgConnection, PgPool, Postgres, Row, Transaction};

pub use error::{MessagingError, PgError};
/// The driver, re-exported so users never mismatch versions.
pub use sqlx;

/// How many times a reservation re-reads a record that changed under it
/// before giving up with [`PgError::Contention`]. Each round follows a
/// change someone else committed, so this is never reached in practice.
const MAX_ROUNDS: u32 = 32;

/// Longest lease or retention stored (100 years); longer ones are capped so
/// that time arithmetic in the database cannot overflow.
const MAX_DURATION_MS: i64 = 100 * 365 * 86_400 * 1_000;

/// Most records one [`ListRecords::list`] page returns.
const MAX_PAGE: usize = 10_000;

/// Options for [`PgStore::connect_with`].
///
/// Defaults: up to 16 connections, 5 s to acquire one, 5 s to connect,
/// idle connections closed after 10 minutes, migrations applied at connect,
/// the server's default `search_path`. Its `Debug` output shows the
/// redacted URL, never the password.
#[derive(Clone)]
#[non_exhaustive]
pub struct PgOptions {
    /// How to reach the server (host, database, credentials, TLS mode…).
    pub connect: PgConnectOptions,
    /// The URL the options came from, password redacted, for messages.
    pub display_url: String,
    /// Most connections the pool opens.
    pub max_connections: u32,
    /// Connections kept open even when idle.
    pub min_connections: u32,
    /// How long an operation waits for a free connection before failing
    /// with [`StoreError::Unavailable`].
    pub acquire_timeout: Duration,
    /// How long [`PgStore::connect_with`] waits for the first connection.
    pub connect_timeout: Duration,
    /// Idle connections above `min_connections` are closed after this.
    pub idle_timeout: Option<Duration>,
    /// Whether [`PgStore::connect_with`] applies migrations.
    pub migrate: bool,
    /// Whether the pool pings a connection before handing it out (on by
    /// default), so that a connection that died while idle (a server
    /// restart during a quiet spell) is replaced instead of failing an
    /// operation. Only connections idle for at least
    /// [`ping_after_idle`](Self::ping_after_idle) are pinged. Off, a dead
    /// connection fails one operation with [`StoreError::Unavailable`]
    /// before the pool replaces it.
    pub test_before_acquire: bool,
    /// How long a connection must have sat idle to be pinged before use
    /// (default 1 s; zero pings before every operation). Under load
    /// connections go straight back to work and no round trip is spent on
    /// pings — a ping per operation cost 10–25 % of the gateway's
    /// PostgreSQL throughput (docs/BENCHMARKS.md).
    pub ping_after_idle: Duration,
    /// A PostgreSQL schema for the idem tables (created by migration if
    /// missing), set as every connection's `search_path`; `None` uses the
    /// server's default (usually `public`).
    pub schema: Option<String>,
    /// Whether concurrent reservations (and concurrent resolutions) are
    /// grouped into one statement and one commit (on by default). While
    /// fewer than [`group_commit_in_flight`](Self::group_commit_in_flight)
    /// statements of a kind run, an operation runs alone, as it comes;
    /// when they all run, operations queue and the next free slot runs
    /// them together. Off, every operation is its own statement.
    pub group_commit: bool,
    /// Most operations one grouped statement carries (default 64).
    pub group_commit_max: u32,
    /// Most statements of one kind (reservations, resolutions) running at
    /// once, each on a connection of the pool (default 2). Fewer make
    /// larger groups: on two cores, 2 served 1.3× the requests of 4, and 8
    /// fewer still (docs/BENCHMARKS.md). A grouped statement that waits (on
    /// a row another transaction holds uncommitted, say a caller's own
    /// [`PgStore::reserve_in`]) holds up the operations queued behind it.
    pub group_commit_in_flight: u32,
}

impl std::fmt::Debug for PgOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgOptions")
            .field("url", &self.display_url)
            .field("max_connections", &self.max_connections)
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
            connect,
            display_url,
            max_connections: 16,
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
    /// `min_connections=N`, `acquire_timeout_ms=N`, `connect_timeout_ms=N`,
    /// `schema=NAME`, `migrate=true|false`, `test_before_acquire=true|false`,
    /// `ping_after_idle_ms=N` (0 pings before every operation),
    /// `group_commit=true|false`, `group_commit_max=N` and
    /// `group_commit_in_flight=N`.
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
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let mut driver_query = Vec::new();
        let mut ours = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair
                .split_once('=')
                .ok_or_else(|| bad(format!("option {pair:?} has no value")))?;
            match name {
                "max_connections"
                | "min_connections"
                | "acquire_timeout_ms"
                | "connect_timeout_ms"
                | "schema"
                | "migrate"
                | "test_before_acquire"
                | "ping_after_idle_ms"
                | "group_commit"
                | "group_commit_max"
                | "group_commit_in_flight" => {
                    ours.push((name, value));
                }
                _ => driver_query.push(pair),
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
        for (name, value) in ours {
            let number =
                || {
                    value.parse::<u32>().ok().filter(|n| *n > 0).ok_or_else(|| {
                        bad(format!("{name} must be a positive integer, not {value:?}"))
                    })
                };
            match name {
                "max_connections" => opts.max_connections = number()?,
                "min_connections" => opts.min_connections = number()?,
                "acquire_timeout_ms" => {
                    opts.acquire_timeout = Duration::from_millis(number()?.into());
                }
                "connect_timeout_ms" => {
                    opts.connect_timeout = Duration::from_millis(number()?.into());
                }
                "schema" => opts.schema = Some(value.to_owned()),
                "group_commit_max" => opts.group_commit_max = number()?,
                "group_commit_in_flight" => opts.group_commit_in_flight = number()?,
                "ping_after_idle_ms" => {
                    let ms = value.parse::<u64>().map_err(|_| {
                        bad(format!(
                            "{name} must be a whole number of milliseconds, not {value:?}"
                        ))
                    })?;
                    opts.ping_after_idle = Duration::from_millis(ms);
                }
                "migrate" | "test_before_acquire" | "group_commit" => {
                    let flag = match value {
                        "true" => true,
                        "false" => false,
                        _ => {
                            return Err(bad(format!(
                                "{name} must be true or false, not {value:?}"
                            )));
                        }
                    };
                    match name {
                        "migrate" => opts.migrate = flag,
                        "group_commit" => opts.group_commit = flag,
                        _ => opts.test_before_acquire = flag,
                    }
                }
                _ => {}
            }
        }
        opts.validate().map_err(bad)?;
        Ok(opts)
    }

    /// Uses `schema` for the idem tables (see [`schema`](Self::schema)).
    pub fn with_schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = Some(schema.into());
        self
    }

    /// Sets the pool's maximum size.
    pub fn with_max_connections(mut self, n: u32) -> Self {
        self.max_connections = n;
        self
    }

    /// Sets how long an operation waits for a free connection.
    pub fn with_acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// Sets how long connecting waits for the first connection.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Whether to apply migrations at connect.
    pub fn with_migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// How operations are grouped; `None` when group commit is off.
    fn group(&self) -> Option<batch::GroupCommit> {
        self.group_commit.then_some(batch::GroupCommit {
            max_batch: self.group_commit_max,
            in_flight: self.group_commit_in_flight,
        })
    }

    fn validate(&self) -> Result<(), String> {
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

/// The PostgreSQL [`Store`]; see the [crate docs](crate). Cheap to clone:
/// clones share the pool.
#[derive(Debug, Clone)]
pub struct PgStore {
    pool: PgPool,
    schema: Option<String>,
    /// How operations are grouped; `None`: group commit is off.
    group: Option<batch::GroupCommit>,
    /// The collectors, started by the first operation (inside a runtime).
    batches: Arc<OnceLock<Batches>>,
    /// What the collectors ran.
    counts: Arc<batch::Counts>,
}

/// What group commit did so far ([`PgStore::group_commit_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct GroupCommitStats {
    /// Grouped statements run (reservations and resolutions).
    pub statements: u64,
    /// Operations they carried; over `statements`, the mean group size.
    pub operations: u64,
    /// Operations that found a slot free and ran alone, as plain
    /// statements.
    pub alone: u64,
}

/// The collector of each kind of grouped operation.
#[derive(Debug)]
struct Batches {
    reserve: batch::Batcher<ReserveItem, Option<PgRow>>,
    resolve: batch::Batcher<ResolveItem, bool>,
}

impl PgStore {
    /// Connects with default options to the server named by a
    /// `postgres://` URL and applies migrations.
    pub async fn connect(url: &str) -> Result<Self, PgError> {
        Self::connect_with(PgOptions::from_url(url)?).await
    }

    /// Connects with explicit options: opens the pool, checks that one
    /// connection can be made within `connect_timeout`, and applies
    /// migrations unless `migrate` is false.
    pub async fn connect_with(opts: PgOptions) -> Result<Self, PgError> {
        opts.validate().map_err(|reason| PgError::Url {
            url: opts.display_url.clone(),
            reason,
        })?;
        let mut connect = opts.connect.clone();
        if let Some(schema) = &opts.schema {
            connect = connect.options([("search_path", schema.as_str())]);
        }
        // The first connection, made directly and bounded, so that a wrong
        // host, port, database or password shows up at once as one clear
        // line (the pool would keep retrying until its acquire timeout).
        match tokio::time::timeout(opts.connect_timeout, PgConnection::connect_with(&connect)).await
        {
            Ok(Ok(conn)) => {
                if let Err(err) = conn.close().await {
                    tracing::debug!(%err, "closing the probe connection failed");
                }
            }
            Ok(Err(err)) => return Err(PgError::connect(&opts.display_url, err)),
            Err(_) => {
                return Err(PgError::connect_timeout(
                    &opts.display_url,
                    opts.connect_timeout,
                ));
            }
        }
        let (ping, ping_after_idle) = (opts.test_before_acquire, opts.ping_after_idle);
        let pool = PgPoolOptions::new()
            .max_connections(opts.max_connections)
            .min_connections(opts.min_connections)
            .acquire_timeout(opts.acquire_timeout)
            .idle_timeout(opts.idle_timeout)
            // sqlx's own test pings before every acquire; ours only after
            // an idle spell (see `ping_after_idle`).
            .test_before_acquire(false)
            .before_acquire(move |conn, meta| {
                Box::pin(async move {
                    if ping && meta.idle_for >= ping_after_idle {
                        sqlx::Connection::ping(conn).await?;
                    }
                    Ok(true)
                })
            })
            .connect_lazy_with(connect);
        let group = opts.group();
        let store = Self {
            pool,
            schema: opts.schema,
            group,
            batches: Arc::default(),
            counts: Arc::default(),
        };
        if opts.migrate {
            store.migrate().await?;
        }
        Ok(store)
    }

    /// Uses an existing pool (whose connections must already see the idem
    /// tables on their `search_path`), with group commit at its defaults.
    /// Applies no migration: call [`migrate`](Self::migrate) if needed.
    pub fn from_pool(pool: PgPool) -> Self {
        Self {
            pool,
            schema: None,
            group: Some(batch::GroupCommit::DEFAULT),
            batches: Arc::default(),
            counts: Arc::default(),
        }
    }

    /// How many grouped statements ran, how many operations they carried,
    /// and how many operations ran alone, since this store (and its
    /// clones) started.
    pub fn group_commit_stats(&self) -> GroupCommitStats {
        let (statements, operations, alone) = self.counts.read();
        GroupCommitStats {
            statements,
            operations,
            alone,
        }
    }

    /// The grouped-operation collectors, when group commit is on; started
    /// on first use, from inside the runtime.
    fn batches(&self) -> Option<&Batches> {
        let group = self.group?;
        Some(self.batches.get_or_init(|| Batches {
            reserve: batch::Batcher::start(
                self.pool.clone(),
                group,
                Arc::clone(&self.counts),
                reserve_batch,
            ),
            resolve: batch::Batcher::start(
                self.pool.clone(),
                group,
                Arc::clone(&self.counts),
                resolve_batch,
            ),
        }))
    }

    /// Brings the schema to the version this build writes. Safe to run from
    /// many processes at once (they take turns on an advisory lock), and a
    /// no-op when the schema is current. Fails with
    /// [`PgError::SchemaTooNew`] if a newer idem migrated the database.
    pub fn migrate(&self) -> impl Future<Output = Result<(), PgError>> + Send + '_ {
        // Boxed as `dyn Send` so the compiler checks `Send` here, with
        // concrete lifetimes: callers can spawn it (rust-lang/rust#102211).
        let fut: Pin<Box<dyn Future<Output = Result<(), PgError>> + Send + '_>> =
            Box::pin(async move {
                let conn = self.pool.acquire().await?;
                schema::migrate(conn, self.schema.clone()).await
            });
        fut
    }

    /// The schema version this build writes.
    pub const fn schema_version() -> i64 {
        schema::SCHEMA_VERSION
    }

    /// The connection pool, for the caller's own transactions
    /// (`store.pool().begin()`).
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Closes the pool: waits for connections in use to be returned, then
    /// closes them all.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// [`Store::reserve`] inside the caller's transaction: the reservation
    /// becomes visible to others (and lasting) only when `tx` commits, and
    /// vanishes if it rolls back. A concurrent reservation of the same key
    /// waits until `tx` ends.
    pub async fn reserve_in(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        req: ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        reserve_on(&mut *tx, &req).await
    }

    /// [`Store::resolve`] inside the caller's transaction, so the answer is
    /// recorded exactly when the business change commits.
    pub async fn resolve_in(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        outcome: &FinalOutcome,
    ) -> Result<(), StoreError> {
        resolve_on(&mut **tx, scope, key, lease, outcome).await
    }

    /// [`Store::release`] inside the caller's transaction.
    pub async fn release_in(
        &self,
        tx: &mut Transaction<'_, Postgres>,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        release_on(&mut **tx, scope, key, lease).await
    }
}

/// A duration in whole milliseconds, capped at [`MAX_DURATION_MS`].
fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis())
        .unwrap_or(i64::MAX)
        .min(MAX_DURATION_MS)
}

/// An attempt number as stored; one that does not fit can match no row.
fn attempt_param(attempt: u32) -> i32 {
    i32::try_from(attempt).unwrap_or(-1)
}

/// Zero rows touched means "not the owner (any more)".
/// A fenced statement with its first five parameters bound, in the order
/// every fenced query file uses: the record (tenant, operation, key) and
/// the lease (owner, attempt).
fn fenced_query<'q>(
    sql: &'q str,
    scope: &'q Scope,
    key: &'q IdempotencyKey,
    owner: &'q [u8; 16],
    attempt: u32,
) -> sqlx::query::Query<'q, Postgres, sqlx::postgres::PgArguments> {
    sqlx::query(sql)
        .bind(scope.tenant())
        .bind(scope.operation())
        .bind(key.as_str())
        .bind(owner.as_slice())
        .bind(attempt_param(attempt))
}

fn fenced(rows: u64) -> Result<(), StoreError> {
    if rows == 0 {
        Err(StoreError::Fenced)
    } else {
        Ok(())
    }
}

fn pg(err: PgError) -> StoreError {
    err.into()
}

fn ms_column(row: &sqlx::postgres::PgRow, column: &str) -> Result<Timestamp, StoreError> {
    row.try_get::<i64, _>(column)
        .map(Timestamp::from_millis)
        .map_err(error::to_store)
}

/// The reservation: insert-or-read in one statement, then, when the
/// existing row must be replaced or taken over, one conditional update on
/// the version read. A lost race (the row changed or vanished in between)
/// starts over.
async fn reserve_on(
    conn: &mut PgConnection,
    req: &ReserveRequest<'_>,
) -> Result<Reservation, StoreError> {
    let (tenant, operation, key) = (req.scope.tenant(), req.scope.operation(), req.key.as_str());
    let owner = req.owner.to_bytes();
    for _ in 0..MAX_ROUNDS {
        let row = sqlx::query(schema::RESERVE)
            .bind(tenant)
            .bind(operation)
            .bind(key)
            .bind(req.fingerprint.digest().as_slice())
            .bind(owner.as_slice())
            .bind(millis(req.lease))
            .bind(millis(req.retention))
            .fetch_optional(&mut *conn)
            .await
            .map_err(error::to_store)?;
        // Not visible yet (committed after our snapshot) or just deleted.
        let Some(row) = row else { continue };
        if let Some(reservation) = settle(&mut *conn, req, &row).await? {
            return Ok(reservation);
        }
    }
    Err(pg(PgError::Contention(MAX_ROUNDS)))
}

/// Decides a reservation on the row the insert-or-read answered: ours if
/// it inserted; else idem's rules on the existing record, replacing or
/// taking it over with one conditional update on the version read. `None`:
/// that update matched nothing (someone else changed the record since it
/// was read), so the caller reads again.
async fn settle<'e, E: Executor<'e, Database = Postgres>>(
    exec: E,
    req: &ReserveRequest<'_>,
    row: &PgRow,
) -> Result<Option<Reservation>, StoreError> {
    let existing = schema::record_from_row(row).map_err(pg)?;
    if row
        .try_get::<bool, _>("inserted")
        .map_err(error::to_store)?
    {
        return Ok(Some(Reservation::Acquired(existing.lease)));
    }
    let now = ms_column(row, "now_ms")?;
    let read_owner = existing.lease.owner.to_bytes();
    let read_attempt = attempt_param(existing.lease.attempt);
    let (tenant, operation, key) = (req.scope.tenant(), req.scope.operation(), req.key.as_str());
    let owner = req.owner.to_bytes();
    let (lease_ms, retention_ms) = (millis(req.lease), millis(req.retention));
    Ok(match decide_existing(&existing, req, now) {
        ExistingDecision::Replace => {
            let replaced = sqlx::query(schema::REPLACE_EXPIRED)
                .bind(tenant)
                .bind(operation)
                .bind(key)
                .bind(req.fingerprint.digest().as_slice())
                .bind(owner.as_slice())
                .bind(lease_ms)
                .bind(retention_ms)
                .bind(read_owner.as_slice())
                .bind(read_attempt)
                .fetch_optional(exec)
                .await
                .map_err(error::to_store)?;
            match replaced {
                Some(row) => Some(Reservation::Acquired(Lease {
                    owner: req.owner,
                    attempt: 1,
                    locked_until: ms_column(&row, "locked_until_ms")?,
                })),
                None => None,
            }
        }
        ExistingDecision::TakeOver => {
            let taken = sqlx::query(schema::TAKE_OVER)
                .bind(tenant)
                .bind(operation)
                .bind(key)
                .bind(owner.as_slice())
                .bind(lease_ms)
                .bind(read_owner.as_slice())
                .bind(read_attempt)
                .fetch_optional(exec)
                .await
                .map_err(error::to_store)?;
            match taken {
                Some(row) => {
                    let attempt: i32 = row.try_get("attempt").map_err(error::to_store)?;
                    Some(Reservation::Acquired(Lease {
                        owner: req.owner,
                        attempt: u32::try_from(attempt).map_err(|_| {
                            pg(PgError::Corrupt(format!("attempt {attempt} is negative")))
                        })?,
                        locked_until: ms_column(&row, "locked_until_ms")?,
                    }))
                }
                None => None,
            }
        }
        ExistingDecision::Replay => Some(Reservation::Existing(Box::new(existing))),
        ExistingDecision::InProgress {
            retry_after,
            outcome_unknown,
        } => Some(Reservation::InProgress {
            retry_after,
            outcome_unknown,
        }),
        ExistingDecision::Mismatch => Some(Reservation::Mismatch {
            state: existing.state,
        }),
    })
}

/// A reservation as a batch carries it: owned, in the statement's types.
#[derive(Debug)]
struct ReserveItem {
    record: batch::RecordId,
    fingerprint: [u8; 32],
    owner: [u8; 16],
    lease_ms: i64,
    retention_ms: i64,
}

impl ReserveItem {
    fn new(req: &ReserveRequest<'_>) -> Self {
        Self {
            record: (
                req.scope.tenant().to_owned(),
                req.scope.operation().to_owned(),
                req.key.as_str().to_owned(),
            ),
            fingerprint: *req.fingerprint.digest(),
            owner: req.owner.to_bytes(),
            lease_ms: millis(req.lease),
            retention_ms: millis(req.retention),
        }
    }
}

impl batch::Batched for ReserveItem {
    fn record(&self) -> &batch::RecordId {
        &self.record
    }
}

/// Runs reserve_batch.sql: per item, its insert-or-read row, or `None`
/// when its conflicting row was not visible to the statement.
async fn reserve_batch(
    pool: PgPool,
    items: Vec<ReserveItem>,
) -> Result<Vec<Option<PgRow>>, sqlx::Error> {
    let column = |f: fn(&ReserveItem) -> &str| items.iter().map(f).collect::<Vec<_>>();
    let rows = sqlx::query(schema::RESERVE_BATCH)
        .bind(column(|i| &i.record.0))
        .bind(column(|i| &i.record.1))
        .bind(column(|i| &i.record.2))
        .bind(items.iter().map(|i| &i.fingerprint[..]).collect::<Vec<_>>())
        .bind(items.iter().map(|i| &i.owner[..]).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.lease_ms).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.retention_ms).collect::<Vec<_>>())
        .fetch_all(&pool)
        .await?;
    let mut answers: Vec<Option<PgRow>> = items.iter().map(|_| None).collect();
    for row in rows {
        let at = batch_position(&row, answers.len())?;
        answers[at] = Some(row);
    }
    Ok(answers)
}

/// The 0-based item a batch's result row answers (its column `n` counts
/// from 1).
fn batch_position(row: &PgRow, items: usize) -> Result<usize, sqlx::Error> {
    let n: i64 = row.try_get("n")?;
    usize::try_from(n - 1)
        .ok()
        .filter(|at| *at < items)
        .ok_or_else(|| sqlx::Error::Protocol(format!("batch position {n} out of range")))
}

/// A resolution as a batch carries it.
#[derive(Debug)]
struct ResolveItem {
    record: batch::RecordId,
    owner: [u8; 16],
    attempt: i32,
    state: &'static str,
    retention_ms: i64,
    status: i32,
    headers: Vec<u8>,
    body: bytes::Bytes,
    resource_id: Option<String>,
    error_code: Option<String>,
}

impl ResolveItem {
    fn new(scope: &Scope, key: &IdempotencyKey, lease: &Lease, outcome: &FinalOutcome) -> Self {
        let state: idem::RecordState = outcome.verdict.into();
        Self {
            record: (
                scope.tenant().to_owned(),
                scope.operation().to_owned(),
                key.as_str().to_owned(),
            ),
            owner: lease.owner.to_bytes(),
            attempt: attempt_param(lease.attempt),
            state: state.as_str(),
            retention_ms: millis(outcome.retention),
            status: i32::from(outcome.response.status),
            headers: outcome.response.encode_headers(),
            body: outcome.response.body.clone(),
            resource_id: outcome.resource_id.clone(),
            error_code: outcome.error_code.clone(),
        }
    }
}

impl batch::Batched for ResolveItem {
    fn record(&self) -> &batch::RecordId {
        &self.record
    }
}

/// Runs resolve_batch.sql: per item, whether it matched its owner and
/// attempt.
async fn resolve_batch(pool: PgPool, items: Vec<ResolveItem>) -> Result<Vec<bool>, sqlx::Error> {
    let column = |f: fn(&ResolveItem) -> &str| items.iter().map(f).collect::<Vec<_>>();
    let optional = |f: fn(&ResolveItem) -> Option<&str>| items.iter().map(f).collect::<Vec<_>>();
    let rows = sqlx::query(schema::RESOLVE_BATCH)
        .bind(column(|i| &i.record.0))
        .bind(column(|i| &i.record.1))
        .bind(column(|i| &i.record.2))
        .bind(items.iter().map(|i| &i.owner[..]).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.attempt).collect::<Vec<_>>())
        .bind(column(|i| i.state))
        .bind(items.iter().map(|i| i.retention_ms).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.status).collect::<Vec<_>>())
        .bind(items.iter().map(|i| &i.headers[..]).collect::<Vec<_>>())
        .bind(items.iter().map(|i| &i.body[..]).collect::<Vec<_>>())
        .bind(optional(|i| i.resource_id.as_deref()))
        .bind(optional(|i| i.error_code.as_deref()))
        .fetch_all(&pool)
        .await?;
    let mut matched = vec![false; items.len()];
    for row in rows {
        matched[batch_position(&row, items.len())?] = true;
    }
    Ok(matched)
}

async fn resolve_on<'e, E: Executor<'e, Database = Postgres>>(
    exec: E,
    scope: &Scope,
    key: &IdempotencyKey,
    lease: &Lease,
    outcome: &FinalOutcome,
) -> Result<(), StoreError> {
    let state: idem::RecordState = outcome.verdict.into();
    let owner = lease.owner.to_bytes();
    let headers = outcome.response.encode_headers();
    let done = fenced_query(schema::RESOLVE, scope, key, &owner, lease.attempt)
        .bind(state.as_str())
        .bind(millis(outcome.retention))
        .bind(i32::from(outcome.response.status))
        .bind(headers)
        .bind(&outcome.response.body[..])
        .bind(outcome.resource_id.as_deref())
        .bind(outcome.error_code.as_deref())
        .execute(exec)
        .await
        .map_err(error::to_store)?;
    fenced(done.rows_affected())
}

async fn release_on<'e, E: Executor<'e, Database = Postgres>>(
    exec: E,
    scope: &Scope,
    key: &IdempotencyKey,
    lease: &Lease,
) -> Result<(), StoreError> {
    let owner = lease.owner.to_bytes();
    let done = fenced_query(schema::RELEASE, scope, key, &owner, lease.attempt)
        .execute(exec)
        .await
        .map_err(error::to_store)?;
    fenced(done.rows_affected())
}

impl Store for PgStore {
    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        let slot = match self.batches() {
            Some(batches) => match batches.reserve.turn(|| ReserveItem::new(&req)).await? {
                batch::Answer::Done(Some(row)) => {
                    if let Some(reservation) = settle(&self.pool, &req, &row).await? {
                        return Ok(reservation);
                    }
                    // Changed since the batch read it: the single
                    // statement decides.
                    None
                }
                // Not visible to the batch's snapshot.
                batch::Answer::Done(None) => None,
                batch::Answer::Alone(slot) => slot,
            },
            None => None,
        };
        let mut conn = self.pool.acquire().await.map_err(error::to_store)?;
        let reserved = reserve_on(&mut conn, &req).await;
        drop(slot);
        reserved
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        let row = sqlx::query(schema::GET)
            .bind(scope.tenant())
            .bind(scope.operation())
            .bind(key.as_str())
            .fetch_optional(&self.pool)
            .await
            .map_err(error::to_store)?;
        row.as_ref()
            .map(schema::record_from_row)
            .transpose()
            .map_err(pg)
    }

    async fn resolve(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        outcome: &FinalOutcome,
    ) -> Result<(), StoreError> {
        let slot = match self.batches() {
            Some(batches) => {
                let item = || ResolveItem::new(scope, key, lease, outcome);
                match batches.resolve.turn(item).await? {
                    batch::Answer::Done(matched) => return fenced(u64::from(matched)),
                    batch::Answer::Alone(slot) => slot,
                }
            }
            None => None,
        };
        let resolved = resolve_on(&self.pool, scope, key, lease, outcome).await;
        drop(slot);
        resolved
    }

    async fn release(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        release_on(&self.pool, scope, key, lease).await
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        _reason: &str,
    ) -> Result<(), StoreError> {
        let owner = lease.owner.to_bytes();
        let done = fenced_query(schema::MARK_UNKNOWN, scope, key, &owner, lease.attempt)
            .execute(&self.pool)
            .await
            .map_err(error::to_store)?;
        fenced(done.rows_affected())
    }

    async fn renew(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        duration: Duration,
    ) -> Result<Timestamp, StoreError> {
        let owner = lease.owner.to_bytes();
        let row = fenced_query(schema::RENEW, scope, key, &owner, lease.attempt)
            .bind(millis(duration))
            .fetch_optional(&self.pool)
            .await
            .map_err(error::to_store)?;
        match row {
            Some(row) => ms_column(&row, "locked_until_ms"),
            None => Err(StoreError::Fenced),
        }
    }
}

impl ListRecords for PgStore {
    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        let limit = filter.limit.clamp(1, MAX_PAGE);
        let after = filter.after.as_ref();
        let mut query = sqlx::QueryBuilder::<Postgres>::new(schema::LIST);
        if let Some(state) = filter.state {
            query.push(schema::LIST_STATE).push_bind(state.as_str());
        }
        if let Some(age) = filter.older_than {
            query
                .push(schema::LIST_OLDER_THAN)
                .push_bind(millis(age))
                .push(schema::LIST_OLDER_THAN_END);
        }
        if let Some(tenant) = &filter.tenant {
            query.push(schema::LIST_TENANT).push_bind(tenant.clone());
        }
        if let Some(c) = after {
            let [a, b, c2, d, e] = schema::LIST_AFTER;
            query
                .push(a)
                .push_bind(c.created_at.as_millis())
                .push(b)
                .push_bind(c.tenant.clone())
                .push(c2)
                .push_bind(c.operation.clone())
                .push(d)
                .push_bind(c.key.clone())
                .push(e);
        }
        query
            .push(schema::LIST_TAIL)
            .push_bind(i64::try_from(limit + 1).unwrap_or(i64::MAX));
        let rows = query
            .build()
            .fetch_all(&self.pool)
            .await
            .map_err(error::to_store)?;
        let mut records = rows
            .iter()
            .map(schema::record_from_row)
            .collect::<Result<Vec<_>, _>>()
            .map_err(pg)?;
        let next = if records.len() > limit {
            records.truncate(limit);
            records.last().map(Cursor::after)
        } else {
            None
        };
        Ok(Page { records, next })
    }
}

impl Purge for PgStore {
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        if batch == 0 {
            return Ok(0);
        }
        let done = sqlx::query(schema::PURGE_EXPIRED)
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .execute(&self.pool)
            .await
            .map_err(error::to_store)?;
        Ok(done.rows_affected())
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let done = sqlx::query(schema::DELETE)
            .bind(scope.tenant())
            .bind(scope.operation())
            .bind(key.as_str())
            .execute(&self.pool)
            .await
            .map_err(error::to_store)?;
        Ok(done.rows_affected() > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_parsing() {
        let o = PgOptions::from_url("postgres://app:pw@db:5433/idem").expect("valid");
        assert_eq!(o.connect.get_host(), "db");
        assert_eq!(o.connect.get_port(), 5433);
        assert_eq!(o.connect.get_database(), Some("idem"));
        assert_eq!(o.display_url, "postgres://app:***@db:5433/idem");
        assert!(!format!("{o:?}").contains("pw"), "Debug redacts");
        assert!(o.migrate);
        let o = PgOptions::from_url(
            "postgresql://db/idem?max_connections=4&acquire_timeout_ms=250&connect_timeout_ms=100&schema=idem_x&migrate=false&test_before_acquire=false&application_name=gw",
        )
        .expect("valid");
        assert_eq!(o.max_connections, 4);
        assert_eq!(o.acquire_timeout, Duration::from_millis(250));
        assert_eq!(o.connect_timeout, Duration::from_millis(100));
        assert_eq!(o.schema.as_deref(), Some("idem_x"));
        assert!(!o.migrate);
        assert!(!o.test_before_acquire);
        assert_eq!(o.connect.get_application_name(), Some("gw"));
        assert_eq!(o.ping_after_idle, Duration::from_secs(1), "default");
        let o = PgOptions::from_url("postgres://db/idem?ping_after_idle_ms=0").expect("valid");
        assert_eq!(o.ping_after_idle, Duration::ZERO);
        assert!(o.group_commit, "default");
        assert_eq!((o.group_commit_max, o.group_commit_in_flight), (64, 2));
        let o = PgOptions::from_url(
            "postgres://db/idem?group_commit=false&group_commit_max=8&group_commit_in_flight=3",
        )
        .expect("valid");
        assert!(!o.group_commit);
        assert_eq!((o.group_commit_max, o.group_commit_in_flight), (8, 3));
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
        ] {
            let err = PgOptions::from_url(url).expect_err(url).to_string();
            assert!(err.contains(needle), "{url}: {err}");
            assert!(!err.contains("s3cret"), "{err}");
        }
    }

    #[test]
    fn durations_are_capped() {
        assert_eq!(millis(Duration::from_millis(1_500)), 1_500);
        assert_eq!(millis(Duration::MAX), MAX_DURATION_MS);
        assert_eq!(attempt_param(u32::MAX), -1);
    }
}

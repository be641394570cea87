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
//!   the connections record operations used stay with the store between
//!   them, so each operation costs its statement's round trip and no test
//!   of the connection (the pool would add one to every release);
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
mod conns;
mod error;
pub mod guard;
pub mod inbox;
mod options;
pub mod outbox;
mod schema;
pub mod trace_context;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idem::store::{Cursor, ExistingDecision, decide_existing};
use idem::{
    FinalOutcome, IdempotencyKey, Lease, ListFilter, ListRecords, Page, Purge, Record, Reservation,
    ReserveRequest, Scope, Store, StoreError, Timestamp,
};
use sqlx::postgres::{PgPoolOptions, PgRow};
use sqlx::{Connection, Executor, PgConnection, PgPool, Postgres, Row, Transaction};

pub use error::{MessagingError, PgError};
pub use options::PgOptions;
/// The driver, re-exported so users never mismatch versions.
pub use sqlx;

/// How many times a reservation re-reads a record that changed under it
/// before giving up with [`PgError::Contention`]. Each round follows a
/// change someone else committed, so this is never reached in practice.
const MAX_ROUNDS: u32 = 32;

/// Longest lease or retention stored (100 years); longer ones are capped so
/// that time arithmetic in the database cannot overflow.
const MAX_DURATION_MS: i64 = 100 * 365 * 86_400 * 1_000;

/// The PostgreSQL [`Store`]; see the [crate docs](crate). Cheap to clone:
/// clones share the pool.
#[derive(Debug, Clone)]
pub struct PgStore {
    /// The pool, and the connections kept between record operations.
    conns: conns::Conns,
    schema: Option<String>,
    /// How operations are grouped; `None`: group commit is off.
    group: Option<batch::GroupCommit>,
    /// The collectors, started by the first operation (inside a runtime).
    batches: Arc<OnceLock<Batches>>,
    /// Whether statements keep their plans, and when the records table is
    /// analyzed ([`Plans`]).
    plans: Arc<Plans>,
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
    /// Grouped statements parsed and planned when they ran, rather than on
    /// a plan kept from earlier runs: those run while the records table is
    /// small on a server without autovacuum (see `docs/STORES.md`).
    pub planned: u64,
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
            url: opts.display_url().to_owned(),
            reason,
        })?;
        let mut connect = opts.connect_options().clone();
        if let Some(schema) = opts.schema() {
            connect = connect.options([("search_path", schema)]);
        }
        // The first connection, made directly and bounded, so that a wrong
        // host, port, database or password shows up at once as one clear
        // line (the pool would keep retrying until its acquire timeout).
        match tokio::time::timeout(opts.connect_timeout(), PgConnection::connect_with(&connect))
            .await
        {
            Ok(Ok(conn)) => {
                if let Err(err) = conn.close().await {
                    tracing::debug!(%err, "closing the probe connection failed");
                }
            }
            Ok(Err(err)) => return Err(PgError::connect(opts.display_url(), err)),
            Err(_) => {
                return Err(PgError::connect_timeout(
                    opts.display_url(),
                    opts.connect_timeout(),
                ));
            }
        }
        let (ping, ping_after_idle) = (opts.test_before_acquire(), opts.ping_after_idle());
        let pool = PgPoolOptions::new()
            .max_connections(opts.pool_connections())
            .min_connections(opts.min_connections())
            .acquire_timeout(opts.acquire_timeout())
            .idle_timeout(opts.idle_timeout())
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
            conns: conns::Conns::new(
                pool,
                ping.then_some(ping_after_idle),
                opts.thread_connections(),
            ),
            schema: opts.schema().map(str::to_owned),
            group,
            batches: Arc::default(),
            plans: Arc::new(Plans::ask_later()),
            counts: Arc::default(),
        };
        if opts.migrate() {
            store.migrate().await?;
        }
        store.plans.ask(store.pool()).await?;
        Ok(store)
    }

    /// Uses an existing pool (whose connections must already see the idem
    /// tables on their `search_path`), with group commit at its defaults.
    /// Applies no migration: call [`migrate`](Self::migrate) if needed.
    /// Whether autovacuum runs is asked of the server at the first
    /// operation, and statements keep their plans or not as with
    /// [`connect_with`](Self::connect_with). Connections kept between
    /// operations are tested after an idle second, as with [`PgOptions`]'
    /// defaults.
    pub fn from_pool(pool: PgPool) -> Self {
        let defaults = PgOptions::new(pool.connect_options().as_ref().clone());
        let test_after = defaults
            .test_before_acquire()
            .then_some(defaults.ping_after_idle());
        Self {
            conns: conns::Conns::new(pool, test_after, 0),
            schema: None,
            group: Some(batch::GroupCommit::DEFAULT),
            batches: Arc::default(),
            plans: Arc::new(Plans::ask_later()),
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
            planned: self
                .plans
                .planned
                .load(std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// The grouped-operation collectors, when group commit is on; started
    /// on first use, from inside the runtime.
    fn batches(&self) -> Option<&Batches> {
        let group = self.group?;
        Some(self.batches.get_or_init(|| {
            let reserve_plans = Arc::clone(&self.plans);
            let resolve_plans = Arc::clone(&self.plans);
            Batches {
                reserve: batch::Batcher::start(
                    self.conns.clone(),
                    group,
                    Arc::clone(&self.counts),
                    move |conns, items| reserve_batch(conns, items, Arc::clone(&reserve_plans)),
                ),
                resolve: batch::Batcher::start(
                    self.conns.clone(),
                    group,
                    Arc::clone(&self.counts),
                    move |conns, items| resolve_batch(conns, items, Arc::clone(&resolve_plans)),
                ),
            }
        }))
    }

    /// Brings the schema to the version this build writes. Safe to run from
    /// many processes at once (they take turns on an advisory lock), and a
    /// no-op when the schema is current. Fails with
    /// [`PgError::SchemaTooNew`] if a newer idem migrated the database.
    pub fn migrate(
        &self,
    ) -> impl Future<Output = Result<idem::store::Migrated, PgError>> + Send + '_ {
        // Boxed as `dyn Send` so the compiler checks `Send` here, with
        // concrete lifetimes: callers can spawn it (rust-lang/rust#102211).
        let fut: Pin<Box<dyn Future<Output = Result<idem::store::Migrated, PgError>> + Send + '_>> =
            Box::pin(async move {
                let conn = self.pool().acquire().await?;
                schema::migrate(conn, self.schema.clone()).await
            });
        fut
    }

    /// The schema version this build writes.
    pub const fn schema_version() -> i64 {
        schema::SCHEMA_VERSION
    }

    /// The connection pool, for the caller's own transactions
    /// (`store.pool().begin()`). Close it with [`close`](Self::close): the
    /// store keeps connections between its operations, and hands them
    /// back when it closes (a bare `pool().close()` waits for the kept
    /// ones, under half a second).
    pub fn pool(&self) -> &PgPool {
        self.conns.pool()
    }

    /// A connection for one record operation ([`conns::Conns::lend`]); the
    /// records table's size is read on it first when that is due
    /// ([`Plans::look`]).
    async fn lend(&self) -> Result<conns::Lent, StoreError> {
        let mut conn = self.conns.lend().await.map_err(error::to_store)?;
        self.plans.look(&mut conn).await;
        Ok(conn)
    }

    /// Closes the pool: hands back the connections the store keeps, closes
    /// the threads' own, waits for connections in use to be returned, then
    /// closes them all.
    pub async fn close(&self) {
        // Marked closed at once: from here no operation takes a connection
        // or opens a thread's own.
        let closed = self.pool().close();
        self.conns.give_back();
        for own in self.conns.drain_own() {
            // On a serving thread's event loop, which may be stopping too.
            match tokio::time::timeout(Duration::from_secs(1), own.close()).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => tracing::debug!(%err, "closing a thread's connection failed"),
                Err(_elapsed) => tracing::debug!("closing a thread's connection timed out"),
            }
        }
        closed.await;
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

/// Whether the group-commit statements keep their plan or are planned
/// each time they run, and when the records table is analyzed for every
/// statement's sake.
///
/// PostgreSQL keeps one generic plan for a prepared statement after its
/// fifth run, and plans it again only when the table's statistics change
/// (autovacuum's `ANALYZE`). A plan made while the table is empty joins the
/// batch's keys to the table by reading all of it (a hash join over a
/// sequential scan). With autovacuum off nothing replaces that plan, and
/// every batch reads every record: at 30,000 records the gateway at 64
/// connections falls from about 5,000 req/s to 700–900
/// (docs/bench-log/2026-12-03.md). Planned each time, a batch looks its
/// keys up in the primary key, but parsing and planning each batch costs a
/// quarter of the rate on a grown table (docs/bench-log/2026-12-05.md).
///
/// So plans are kept where autovacuum runs. Where it does not, they are
/// made each time while the table is small, and kept once it has
/// [`KEEP_PLANS_FROM_PAGES`]: from some fifty pages on, PostgreSQL's
/// generic plans look every key up in the primary key. The size is read
/// again every [`LOOK_AT_SIZE_EVERY`] on a connection about to run a record
/// operation. Each time the table is found grown past the bound again
/// (after a `TRUNCATE`, say), the statements get a new text, so PostgreSQL
/// prepares and plans them anew instead of keeping a plan made on the
/// small table.
///
/// The single-key statements are prepared from the first operation on,
/// and on an empty table their generic plans find a key through
/// `idem_records_tenant_created` (tenant, created_at, …): a walk over all of
/// the tenant's records, which grows with them (45–80 ms per resolution at
/// 300,000 records of one tenant: docs/bench-log/2026-12-05.md).
/// So at each crossing of the bound it saw (small at one look, large at a
/// later one) the store also analyzes the table: the new statistics make
/// PostgreSQL plan every statement on every connection again, by the
/// primary key. A store started on a large table prepares its statements
/// there and analyzes nothing. Where the store's role may not analyze the
/// table, it says so once.
#[derive(Debug)]
struct Plans {
    /// Autovacuum runs: PostgreSQL plans again as the statistics change.
    /// Unset until the server is asked (a store made from the caller's
    /// pool asks at its first look).
    autovacuum: std::sync::OnceLock<bool>,
    sized: std::sync::Mutex<SizedPlans>,
    /// Grouped statements run without a kept plan.
    planned: std::sync::atomic::AtomicU64,
    /// Told the operator that the table could not be analyzed.
    warned: std::sync::atomic::AtomicBool,
}

/// Pages of the records table from which grouped statements keep their
/// plans on a server without autovacuum (2 MiB).
const KEEP_PLANS_FROM_PAGES: i64 = 256;

/// How often the records table's size is read while autovacuum is off.
/// A second: a store started on an empty table keeps its plans within a
/// second of the table's reaching the bound, for one small query a second.
const LOOK_AT_SIZE_EVERY: Duration = Duration::from_secs(1);

/// What the last look at the table's size decided.
#[derive(Debug)]
struct SizedPlans {
    looked: Option<std::time::Instant>,
    large: bool,
    /// A look found the table small: statements may have been prepared
    /// on it since.
    seen_small: bool,
    /// The statements' texts for the current run of kept plans.
    reserve: Arc<str>,
    resolve: Arc<str>,
    runs: u64,
}

/// Which grouped statement.
#[derive(Debug, Clone, Copy)]
enum Grouped {
    Reserve,
    Resolve,
}

impl Plans {
    /// Plans for a server known to run autovacuum or not (tests).
    #[cfg(test)]
    fn new(autovacuum: bool) -> Self {
        let plans = Self::ask_later();
        let _ = plans.autovacuum.set(autovacuum);
        plans
    }

    /// Asks the server whether autovacuum runs at the first look, on the
    /// connection of the store's first operation.
    fn ask_later() -> Self {
        Self {
            autovacuum: std::sync::OnceLock::new(),
            sized: std::sync::Mutex::new(SizedPlans {
                looked: None,
                large: false,
                seen_small: false,
                reserve: schema::RESERVE_BATCH.into(),
                resolve: schema::RESOLVE_BATCH.into(),
                runs: 0,
            }),
            planned: std::sync::atomic::AtomicU64::new(0),
            warned: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Plans kept from the start, as on a server that runs autovacuum.
    #[cfg(test)]
    fn kept() -> Self {
        Self::new(true)
    }

    /// Whether autovacuum runs, for the records table too: asked of the
    /// server on `exec` unless known.
    async fn ask<'e, E: Executor<'e, Database = Postgres>>(
        &self,
        exec: E,
    ) -> Result<bool, sqlx::Error> {
        if let Some(known) = self.autovacuum.get() {
            return Ok(*known);
        }
        let analyzed: bool = sqlx::query_scalar(schema::AUTOVACUUM_ON)
            .fetch_one(exec)
            .await?;
        if self.autovacuum.set(analyzed).is_ok() && !analyzed {
            // Debug, not a warning: `idem migrate` and the tools print
            // nothing on success. docs/STORES.md tells operators what
            // autovacuum off asks of them.
            tracing::debug!(
                "postgres: autovacuum is off for idem_records; its grouped statements are planned at each run until the table has grown"
            );
        }
        Ok(analyzed)
    }

    /// Whether autovacuum runs, as far as known: until the server is
    /// asked, it is taken to run, so plans are kept.
    fn autovacuum(&self) -> bool {
        self.autovacuum.get().copied().unwrap_or(true)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SizedPlans> {
        self.sized
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The text of the `which` statement and sqlx's `persistent` flag for
    /// it; reads the table's size on `conn` first when that is due.
    async fn statement(&self, which: Grouped, conn: &mut PgConnection) -> (Arc<str>, bool) {
        self.look(conn).await;
        self.current(which)
    }

    /// Reads the table's size on `conn` when a look is due (once per
    /// [`LOOK_AT_SIZE_EVERY`], by one caller; never where autovacuum runs),
    /// and analyzes the table when it has just crossed the bound.
    async fn look(&self, conn: &mut PgConnection) {
        let autovacuum = match self.ask(&mut *conn).await {
            Ok(autovacuum) => autovacuum,
            Err(err) => {
                tracing::debug!(%err, "postgres: whether autovacuum runs could not be read");
                return;
            }
        };
        let due = !autovacuum && {
            let mut sized = self.lock();
            let due = sized
                .looked
                .is_none_or(|at| at.elapsed() >= LOOK_AT_SIZE_EVERY);
            if due {
                // Claimed: one caller looks per interval.
                sized.looked = Some(std::time::Instant::now());
            }
            due
        };
        if !due {
            return;
        }
        match sqlx::query_scalar::<_, Option<i64>>(schema::RECORD_PAGES)
            .fetch_one(&mut *conn)
            .await
        {
            Ok(pages) => {
                if self.record_size(pages.unwrap_or(0)) {
                    self.analyze(conn).await;
                }
            }
            Err(err) => {
                tracing::debug!(%err, "postgres: the records table's size could not be read")
            }
        }
    }

    /// `ANALYZE idem_records` on `conn`; says once when the role may not.
    async fn analyze(&self, conn: &mut PgConnection) {
        let analyzed = match sqlx::query(schema::ANALYZE_RECORDS)
            .persistent(false)
            .execute(&mut *conn)
            .await
        {
            // A role that does not own the table gets a warning from the
            // server, not an error: the statistics say whether it ran.
            Ok(_) => sqlx::query_scalar::<_, Option<bool>>(schema::RECORDS_ANALYZED)
                .fetch_optional(&mut *conn)
                .await
                .map(|analyzed| analyzed.flatten().unwrap_or(true)),
            Err(err) => Err(err),
        };
        let err = match analyzed {
            Ok(true) => {
                tracing::debug!(
                    "postgres: idem_records analyzed at its crossing of the plan bound"
                );
                return;
            }
            Ok(false) => String::new(),
            Err(err) => err.to_string(),
        };
        if !self.warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
            tracing::warn!(%err, "postgres: autovacuum is off and idem_records could not be analyzed by this role: statements prepared while the table was small may read all of a tenant's records for each key; run ANALYZE idem_records as its owner, or turn autovacuum on");
        }
    }

    /// The text of the `which` statement and whether its plan is kept, as
    /// the last look at the table's size decided; counts it in `planned`
    /// when it is not.
    fn current(&self, which: Grouped) -> (Arc<str>, bool) {
        let sized = self.lock();
        let sql = match which {
            Grouped::Reserve => &sized.reserve,
            Grouped::Resolve => &sized.resolve,
        };
        let kept = self.autovacuum() || sized.large;
        if !kept {
            self.planned
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        (Arc::clone(sql), kept)
    }

    /// Records that the table has `pages`: plans are kept from
    /// [`KEEP_PLANS_FROM_PAGES`] on, under new texts each time the table
    /// crosses that bound. True when this store saw it small before, so
    /// that statements prepared on the small table need the table
    /// analyzed; a store started on a large table prepares them there and
    /// analyzes nothing (an `ANALYZE` at every start would hold up the
    /// first operation, the longer the larger the table).
    fn record_size(&self, pages: i64) -> bool {
        let mut sized = self.lock();
        let large = pages >= KEEP_PLANS_FROM_PAGES;
        let crossed = large && !sized.large;
        if crossed {
            sized.runs += 1;
            let tag = format!("\n-- plans kept from run {}\n", sized.runs);
            sized.reserve = format!("{}{tag}", schema::RESERVE_BATCH).into();
            sized.resolve = format!("{}{tag}", schema::RESOLVE_BATCH).into();
        }
        let analyze = crossed && sized.seen_small;
        sized.large = large;
        sized.seen_small = !large;
        analyze
    }
}

/// Runs reserve_batch.sql: per item, its insert-or-read row, or `None`
/// when its conflicting row was not visible to the statement.
async fn reserve_batch(
    conns: conns::Conns,
    items: Vec<ReserveItem>,
    plans: Arc<Plans>,
) -> Result<Vec<Option<PgRow>>, sqlx::Error> {
    let column = |f: fn(&ReserveItem) -> &str| items.iter().map(f).collect::<Vec<_>>();
    let mut conn = conns.lend().await?;
    let (sql, persistent) = plans.statement(Grouped::Reserve, &mut conn).await;
    let rows = sqlx::query(&sql)
        .persistent(persistent)
        .bind(column(|i| &i.record.0))
        .bind(column(|i| &i.record.1))
        .bind(column(|i| &i.record.2))
        .bind(items.iter().map(|i| &i.fingerprint[..]).collect::<Vec<_>>())
        .bind(items.iter().map(|i| &i.owner[..]).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.lease_ms).collect::<Vec<_>>())
        .bind(items.iter().map(|i| i.retention_ms).collect::<Vec<_>>());
    let rows = rows.fetch_all(&mut *conn).await?;
    conn.done();
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
async fn resolve_batch(
    conns: conns::Conns,
    items: Vec<ResolveItem>,
    plans: Arc<Plans>,
) -> Result<Vec<bool>, sqlx::Error> {
    let column = |f: fn(&ResolveItem) -> &str| items.iter().map(f).collect::<Vec<_>>();
    let optional = |f: fn(&ResolveItem) -> Option<&str>| items.iter().map(f).collect::<Vec<_>>();
    let mut conn = conns.lend().await?;
    let (sql, persistent) = plans.statement(Grouped::Resolve, &mut conn).await;
    let rows = sqlx::query(&sql)
        .persistent(persistent)
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
        .bind(optional(|i| i.error_code.as_deref()));
    let rows = rows.fetch_all(&mut *conn).await?;
    conn.done();
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

/// Keeps a lent connection whose fenced statement completed, matched or
/// not ([`StoreError::Fenced`] is an answer, not a failed statement).
fn kept_if_done(conn: conns::Lent, result: &Result<(), StoreError>) {
    if matches!(result, Ok(()) | Err(StoreError::Fenced)) {
        conn.done();
    }
}

impl Store for PgStore {
    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        let slot = match self.batches() {
            Some(batches) => match batches.reserve.turn(|| ReserveItem::new(&req)).await? {
                batch::Answer::Done(Some(row)) => {
                    if let Some(reservation) = settle(self.pool(), &req, &row).await? {
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
        let mut conn = self.lend().await?;
        let reserved = reserve_on(&mut conn, &req).await;
        // Kept before the slot frees, for the batch waiting on the slot.
        if reserved.is_ok() {
            conn.done();
        }
        drop(slot);
        reserved
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        let row = sqlx::query(schema::GET)
            .bind(scope.tenant())
            .bind(scope.operation())
            .bind(key.as_str());
        let mut conn = self.lend().await?;
        let row = row
            .fetch_optional(&mut *conn)
            .await
            .map_err(error::to_store)?;
        conn.done();
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
        let mut conn = self.lend().await?;
        let resolved = resolve_on(&mut *conn, scope, key, lease, outcome).await;
        kept_if_done(conn, &resolved);
        drop(slot);
        resolved
    }

    async fn release(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        let mut conn = self.lend().await?;
        let released = release_on(&mut *conn, scope, key, lease).await;
        kept_if_done(conn, &released);
        released
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        _reason: &str,
    ) -> Result<(), StoreError> {
        let owner = lease.owner.to_bytes();
        let mut conn = self.lend().await?;
        let done = fenced_query(schema::MARK_UNKNOWN, scope, key, &owner, lease.attempt)
            .execute(&mut *conn)
            .await
            .map_err(error::to_store)?;
        conn.done();
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
        let row =
            fenced_query(schema::RENEW, scope, key, &owner, lease.attempt).bind(millis(duration));
        let mut conn = self.lend().await?;
        let row = row
            .fetch_optional(&mut *conn)
            .await
            .map_err(error::to_store)?;
        conn.done();
        match row {
            Some(row) => ms_column(&row, "locked_until_ms"),
            None => Err(StoreError::Fenced),
        }
    }
}

impl ListRecords for PgStore {
    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        let limit = filter.page_size();
        let after = filter.after.as_ref();
        let mut query = sqlx::QueryBuilder::<Postgres>::new(schema::LIST);
        if let Some(state) = filter.state {
            // A literal, not a bind (the state is one of three fixed words):
            // a generic plan can then prove idem_records_processing's
            // predicate and read only the processing records, which the
            // stuck-record monitor lists every 30 s. With a bind, the plan
            // made while the table was small walked the creation index over
            // every record once it had grown.
            query
                .push(schema::LIST_STATE)
                .push("'")
                .push(state.as_str())
                .push("'");
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
            .fetch_all(self.pool())
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
            .execute(self.pool())
            .await
            .map_err(error::to_store)?;
        Ok(done.rows_affected())
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let done = sqlx::query(schema::DELETE)
            .bind(scope.tenant())
            .bind(scope.operation())
            .bind(key.as_str())
            .execute(self.pool())
            .await
            .map_err(error::to_store)?;
        Ok(done.rows_affected() > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A table that shrinks back below the bound (a `TRUNCATE`) has its
    /// grouped statements planned at each run again, and when it grows past
    /// the bound once more they get texts of their own, so no connection
    /// runs a plan it prepared for the table as it was before.
    #[test]
    fn grouped_plans_follow_the_table_across_the_bound() {
        let planned = |plans: &Plans| plans.planned.load(std::sync::atomic::Ordering::Relaxed);
        let plans = Plans::new(false);
        let (small, kept) = plans.current(Grouped::Reserve);
        assert!(!kept, "a table not yet looked at is planned each run");
        assert_eq!(&*small, schema::RESERVE_BATCH);
        assert_eq!(planned(&plans), 1);

        assert!(!plans.record_size(KEEP_PLANS_FROM_PAGES - 1));
        assert!(!plans.current(Grouped::Resolve).1);
        assert_eq!(planned(&plans), 2);

        assert!(plans.record_size(KEEP_PLANS_FROM_PAGES), "crossed: analyze");
        let (first, kept) = plans.current(Grouped::Reserve);
        let (first_resolve, _) = plans.current(Grouped::Resolve);
        assert!(kept, "a grown table keeps its plans");
        assert!(first.starts_with(schema::RESERVE_BATCH) && first.ends_with("run 1\n"));
        assert!(first_resolve.starts_with(schema::RESOLVE_BATCH));
        assert!(first_resolve.ends_with("run 1\n"));
        assert_eq!(planned(&plans), 2, "kept plans are not counted");

        // Still large: the same texts, so the prepared statements stay.
        assert!(!plans.record_size(KEEP_PLANS_FROM_PAGES * 10));
        assert_eq!(plans.current(Grouped::Reserve), (Arc::clone(&first), true));

        // Truncated: planned each run (unprepared, so whatever its text,
        // no plan is kept from it).
        assert!(!plans.record_size(0));
        assert!(!plans.current(Grouped::Reserve).1);
        assert_eq!(planned(&plans), 3);

        // Grown again: kept, under texts no connection has prepared yet.
        assert!(plans.record_size(KEEP_PLANS_FROM_PAGES), "crossed again");
        let (second, kept) = plans.current(Grouped::Reserve);
        let (second_resolve, _) = plans.current(Grouped::Resolve);
        assert!(kept);
        assert_ne!(second, first);
        assert_ne!(second_resolve, first_resolve);
        assert!(second.ends_with("run 2\n") && second_resolve.ends_with("run 2\n"));
        assert_eq!(planned(&plans), 3);

        // A store whose first look finds the table large keeps its plans
        // and analyzes nothing: it prepares its statements there.
        let started_large = Plans::new(false);
        assert!(!started_large.record_size(KEEP_PLANS_FROM_PAGES * 100));
        assert!(started_large.current(Grouped::Reserve).1);
        assert!(!started_large.record_size(0));
        assert!(
            started_large.record_size(KEEP_PLANS_FROM_PAGES),
            "then a crossing it saw"
        );

        // Where autovacuum runs, the store's own texts, kept (the size is
        // never read there).
        let analyzed = Plans::kept();
        assert_eq!(
            analyzed.current(Grouped::Resolve),
            (Arc::from(schema::RESOLVE_BATCH), true)
        );
        assert_eq!(planned(&analyzed), 0);
    }

    #[test]
    fn durations_are_capped() {
        assert_eq!(millis(Duration::from_millis(1_500)), 1_500);
        assert_eq!(millis(Duration::MAX), MAX_DURATION_MS);
        assert_eq!(attempt_param(u32::MAX), -1);
    }
}

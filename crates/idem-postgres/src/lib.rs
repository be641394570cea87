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
mod batched;
mod conns;
mod error;
pub mod guard;
pub mod inbox;
mod ops;
mod options;
pub mod outbox;
mod plans;
mod schema;
pub mod trace_context;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idem::store::{ExistingDecision, decide_existing};
use idem::{
    FinalOutcome, IdempotencyKey, Lease, ListFilter, ListRecords, Page, Purge, Record, Reservation,
    ReserveRequest, Scope, Store, StoreError, Timestamp,
};
use sqlx::postgres::{PgPoolOptions, PgRow};
use sqlx::{Connection, Executor, PgConnection, PgPool, Postgres, Row, Transaction};

use batched::{ReserveItem, ResolveItem, reserve_batch, resolve_batch};
use ops::*;
use plans::Plans;

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
            planned: self.plans.planned(),
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
                    batch::classify,
                ),
                resolve: batch::Batcher::start(
                    self.conns.clone(),
                    group,
                    Arc::clone(&self.counts),
                    move |conns, items| resolve_batch(conns, items, Arc::clone(&resolve_plans)),
                    batch::classify,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_are_capped() {
        assert_eq!(millis(Duration::from_millis(1_500)), 1_500);
        assert_eq!(millis(Duration::MAX), MAX_DURATION_MS);
        assert_eq!(attempt_param(u32::MAX), -1);
    }
}

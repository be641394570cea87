//! # idem-mysql — the MySQL and MariaDB store
//!
//! A [`Store`] shared by any number of gateways or service instances, in
//! one table, `idem_records`, on MySQL 8 or MariaDB 10.11 and later:
//!
//! * **atomic reservation**: one `INSERT` on the primary key creates the
//!   record if absent (of two racers exactly one inserts); the other
//!   reads the existing row with a locking read, and lapsed leases and
//!   expired records are taken over by *conditional* `UPDATE`s on the
//!   exact version read, so two racers never both win;
//! * **fencing**: every resolution, release, mark and renewal matches the
//!   owner token and the attempt, or changes nothing and reports
//!   [`StoreError::Fenced`];
//! * **one clock**: every time is the server's `UTC_TIMESTAMP(3)` (whole
//!   milliseconds, in UTC whatever the session's time zone), never a
//!   client's;
//! * **case-sensitive keys**: tenants, operations and keys are
//!   `VARBINARY`, compared byte by byte (`Key` and `key` are two keys);
//! * **in your transaction**: [`MySqlStore::reserve_in`] and
//!   [`MySqlStore::resolve_in`] take the caller's [`sqlx::Transaction`],
//!   so the reservation, the business change and the answer commit or
//!   roll back together;
//! * **migrations**: versioned, in `migrations/*.sql`, applied under a
//!   named lock (`GET_LOCK`) at connect (or by [`MySqlStore::migrate`]);
//! * a **bounded pool**: maximum size, acquire timeout, connect timeout;
//! * for consumers whose data lives in MySQL, the transactional
//!   [`inbox`] and the ordering [`guard`];
//! * **group commit**: concurrent reservations share one transaction and
//!   one commit, and so do concurrent resolutions (see
//!   [`MySqlOptions::group_commit`]); operations inside a caller's
//!   transaction are never grouped.
//!
//! ```no_run
//! use idem::{Engine, Fingerprint, Scope, StoredResponse};
//! use idem_mysql::MySqlStore;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let store = MySqlStore::connect("mysql://idem@127.0.0.1/idem").await?;
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
//! use idem_mysql::MySqlStore;
//!
//! # async fn f(store: MySqlStore) -> Result<(), Box<dyn std::error::Error>> {
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
//! Inside a caller's transaction the usual InnoDB rules apply: a
//! concurrent duplicate waits on the row until that transaction ends
//! (up to `innodb_lock_wait_timeout`), and InnoDB may break a lock cycle
//! between transactions by rolling one back with a deadlock error
//! ([`StoreError::Unavailable`]): retry the transaction.

mod batch;
mod batched;
mod error;
pub mod guard;
pub mod inbox;
mod ops;
mod options;
mod schema;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idem::store::{ExistingDecision, decide_existing};
use idem::{
    FinalOutcome, IdempotencyKey, Lease, ListFilter, ListRecords, OwnerToken, Page, Purge, Record,
    Reservation, ReserveRequest, Scope, Store, StoreError, Timestamp,
};
use sqlx::mysql::{MySqlConnection, MySqlPool, MySqlPoolOptions, MySqlRow};
use sqlx::pool::PoolConnection;
use sqlx::{Connection, MySql, Transaction};

use batched::{ReserveItem, Reserved, ResolveItem, reserve_batch, resolve_batch};
use ops::*;

pub use error::{MessagingError, MySqlError};
pub use options::MySqlOptions;
/// The driver, re-exported so users never mismatch versions.
pub use sqlx;

/// How many times a reservation re-reads a record that changed under it
/// before giving up with [`MySqlError::Contention`]. Each round follows a
/// change someone else committed, so this is never reached in practice.
const MAX_ROUNDS: u32 = 32;

/// Longest lease or retention stored (100 years); longer ones are capped so
/// that time arithmetic in the database stays inside `DATETIME`'s range.
const MAX_DURATION_MS: i64 = 100 * 365 * 86_400 * 1_000;

/// The MySQL [`Store`]; see the [crate docs](crate). Cheap to clone:
/// clones share the pool.
#[derive(Debug, Clone)]
pub struct MySqlStore {
    pool: MySqlPool,
    /// How operations are grouped; `None`: group commit is off.
    group: Option<batch::GroupCommit>,
    /// The collectors, started by the first operation (inside a runtime).
    batches: Arc<OnceLock<Batches>>,
    /// What the collectors ran.
    counts: Arc<batch::Counts>,
}

/// What group commit did so far ([`MySqlStore::group_commit_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct GroupCommitStats {
    /// Grouped transactions run (of reservations and of resolutions).
    pub transactions: u64,
    /// Operations they carried; over `transactions`, the mean group size.
    pub operations: u64,
    /// Operations that found a slot free and ran alone, as plain
    /// statements.
    pub alone: u64,
}

/// The collector of each kind of grouped operation.
#[derive(Debug)]
struct Batches {
    reserve: batch::Batcher<ReserveItem, Reserved>,
    resolve: batch::Batcher<ResolveItem, bool>,
}

impl MySqlStore {
    /// Connects with default options to the server named by a `mysql://`
    /// URL and applies migrations.
    pub async fn connect(url: &str) -> Result<Self, MySqlError> {
        Self::connect_with(MySqlOptions::from_url(url)?).await
    }

    /// Connects with explicit options: opens the pool, checks that one
    /// connection can be made within `connect_timeout`, and applies
    /// migrations unless `migrate` is false.
    pub async fn connect_with(opts: MySqlOptions) -> Result<Self, MySqlError> {
        opts.validate().map_err(|reason| MySqlError::Url {
            url: opts.display_url().to_owned(),
            reason,
        })?;
        let connect = opts.connect_options().clone();
        // The first connection, made directly and bounded, so that a wrong
        // host, port, database or password shows up at once as one clear
        // line (the pool would keep retrying until its acquire timeout).
        match tokio::time::timeout(
            opts.connect_timeout(),
            MySqlConnection::connect_with(&connect),
        )
        .await
        {
            Ok(Ok(conn)) => {
                if let Err(err) = conn.close().await {
                    tracing::debug!(%err, "closing the probe connection failed");
                }
            }
            Ok(Err(err)) => return Err(MySqlError::connect(opts.display_url(), err)),
            Err(_) => {
                return Err(MySqlError::connect_timeout(
                    opts.display_url(),
                    opts.connect_timeout(),
                ));
            }
        }
        let (ping, ping_after_idle) = (opts.test_before_acquire(), opts.ping_after_idle());
        let pool = MySqlPoolOptions::new()
            .max_connections(opts.max_connections())
            .min_connections(opts.min_connections())
            .acquire_timeout(opts.acquire_timeout())
            .idle_timeout(opts.idle_timeout())
            // sqlx's own test pings before every acquire, a second round
            // trip for each operation; ours only after an idle spell (see
            // `ping_after_idle`).
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
        let store = Self {
            pool,
            group: opts.group(),
            batches: Arc::default(),
            counts: Arc::default(),
        };
        if opts.migrate() {
            store.migrate().await?;
        }
        Ok(store)
    }

    /// Uses an existing pool, whose database must hold the idem tables,
    /// with group commit at its defaults. Applies no migration: call
    /// [`migrate`](Self::migrate) if needed.
    pub fn from_pool(pool: MySqlPool) -> Self {
        Self {
            pool,
            group: Some(batch::GroupCommit::DEFAULT),
            batches: Arc::default(),
            counts: Arc::default(),
        }
    }

    /// How many grouped transactions ran, how many operations they
    /// carried, and how many operations ran alone, since this store (and
    /// its clones) started.
    pub fn group_commit_stats(&self) -> GroupCommitStats {
        let (transactions, operations, alone) = self.counts.read();
        GroupCommitStats {
            transactions,
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
                batch::classify,
            ),
            resolve: batch::Batcher::start(
                self.pool.clone(),
                group,
                Arc::clone(&self.counts),
                resolve_batch,
                batch::classify,
            ),
        }))
    }

    /// Brings the schema to the version this build writes. Safe to run from
    /// many processes at once (they take turns on a named lock), and a
    /// no-op when the schema is current. Fails with
    /// [`MySqlError::SchemaTooNew`] if a newer idem migrated the database.
    pub fn migrate(
        &self,
    ) -> impl Future<Output = Result<idem::store::Migrated, MySqlError>> + Send + '_ {
        // Boxed as `dyn Send` so the compiler checks `Send` here, with
        // concrete lifetimes: callers can spawn it (rust-lang/rust#102211).
        let fut: Pin<
            Box<dyn Future<Output = Result<idem::store::Migrated, MySqlError>> + Send + '_>,
        > = Box::pin(async move {
            let conn = self.pool.acquire().await?;
            schema::migrate(conn).await
        });
        fut
    }

    /// The schema version this build writes.
    pub const fn schema_version() -> i64 {
        schema::SCHEMA_VERSION
    }

    /// The connection pool, for the caller's own transactions
    /// (`store.pool().begin()`).
    pub fn pool(&self) -> &MySqlPool {
        &self.pool
    }

    /// A connection of the pool for one record operation.
    async fn acquire(&self) -> Result<PoolConnection<MySql>, StoreError> {
        self.pool.acquire().await.map_err(error::to_store)
    }

    /// Closes the pool: waits for connections in use to be returned, then
    /// closes them all.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// [`Store::reserve`] inside the caller's transaction: the reservation
    /// becomes visible to others (and lasting) only when `tx` commits, and
    /// vanishes if it rolls back. A concurrent reservation of the same key
    /// waits until `tx` ends. A deadlock error has rolled `tx` back: retry
    /// the transaction.
    pub async fn reserve_in(
        &self,
        tx: &mut Transaction<'_, MySql>,
        req: ReserveRequest<'_>,
    ) -> Result<Reservation, StoreError> {
        reserve_on(tx, &req, Within::CallersTransaction).await
    }

    /// [`Store::resolve`] inside the caller's transaction, so the answer is
    /// recorded exactly when the business change commits.
    pub async fn resolve_in(
        &self,
        tx: &mut Transaction<'_, MySql>,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        outcome: &FinalOutcome,
    ) -> Result<(), StoreError> {
        resolve_on(tx, scope, key, lease, outcome).await
    }

    /// [`Store::release`] inside the caller's transaction.
    pub async fn release_in(
        &self,
        tx: &mut Transaction<'_, MySql>,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        release_on(tx, scope, key, lease).await
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

//! # idem-sqlite — the embedded default store
//!
//! A [`Store`] in one SQLite file: no server to run, durable by default,
//! and fast through group commit.
//!
//! * **WAL mode** so readers never wait behind the writer;
//! * **durable commits** (`synchronous = FULL`): an answered write survives a
//!   crash or power loss;
//! * **group commit**: one writer thread drains a queue and commits whatever
//!   arrived meanwhile in one transaction, answering each caller after the
//!   commit (see `writer.rs`);
//! * **migrations** versioned with `PRAGMA user_version`, applied at open;
//! * reservations are atomic inside the writer's transaction, and every
//!   resolution is fenced by owner token and attempt.
//!
//! ```no_run
//! use idem::Engine;
//! use idem_sqlite::SqliteStore;
//!
//! # fn main() -> Result<(), idem_sqlite::SqliteError> {
//! let store = SqliteStore::open_url("sqlite://idem.db")?;
//! let engine = Engine::new(store);
//! # let _ = engine;
//! # Ok(())
//! # }
//! ```

mod checkpoint;
mod error;
pub mod inbox;
mod options;
mod schema;
mod writer;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use idem::store::{ExistingDecision, decide_existing};
use idem::{
    FinalOutcome, IdempotencyKey, Lease, ListFilter, ListRecords, Page, Purge, Record, Reservation,
    ReserveRequest, Scope, Store, StoreError, Timestamp,
};
use rusqlite::{Connection, OpenFlags, OptionalExtension, params};
use tokio::sync::{Semaphore, mpsc, oneshot};

pub use error::SqliteError;
pub use options::{SqliteOptions, Synchronous};
/// The driver, re-exported so users never mismatch versions.
pub use rusqlite;

use writer::{Batch, Job, Stats, Task};

/// Most expired records one writer job deletes: a purge batch is spread
/// over jobs of this size, so a cleanup run adds little work to any one
/// group commit. Measured with `bench/growth` (1M expired records, unique
/// keys served at 64 connections, cleanup paced to a quarter of the time):
/// serving p99 83 ms with 64-row jobs, 30 ms with 8-row jobs, against
/// 9–10 ms without cleanup (docs/BENCHMARKS.md#current-figures).
pub const PURGE_CHUNK: usize = 8;

/// The embedded SQLite [`Store`]; see the [crate docs](crate).
#[derive(Debug)]
pub struct SqliteStore {
    writer: Option<mpsc::Sender<Box<dyn Job>>>,
    checkpointer: Option<checkpoint::Checkpointer>,
    writer_thread: Option<JoinHandle<()>>,
    readers: Arc<Mutex<Vec<Connection>>>,
    reader_slots: Arc<Semaphore>,
    stats: Arc<Stats>,
    path: PathBuf,
    migrated: idem::store::Migrated,
}

/// Group-commit counters since the store was opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommitStats {
    /// Transactions committed.
    pub commits: u64,
    /// Operations executed in committed or failed batches.
    pub operations: u64,
    /// Batches whose commit failed.
    pub failed_commits: u64,
}

impl SqliteStore {
    /// Opens (creating if needed) the store at `path` with default options.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, SqliteError> {
        Self::open_with(SqliteOptions::new(path.as_ref()))
    }

    /// Opens the store named by a `sqlite://` URL.
    pub fn open_url(url: &str) -> Result<Self, SqliteError> {
        Self::open_with(SqliteOptions::from_url(url)?)
    }

    /// Opens with explicit options. Blocks while the file is opened and
    /// migrated; call it at start-up (or in `spawn_blocking`).
    pub fn open_with(opts: SqliteOptions) -> Result<Self, SqliteError> {
        let opened = |source: SqliteError| SqliteError::Open {
            path: opts.path().to_path_buf(),
            source: Box::new(source),
        };
        create_private(opts.path()).map_err(opened)?;
        let mut conn = open_connection(&opts, true).map_err(opened)?;
        let migrated = schema::migrate(&mut conn).map_err(opened)?;
        // Not query_only: a checkpoint writes to the database file.
        let (checkpointer, kick) = checkpoint::Checkpointer::spawn(
            open_connection(&opts, true).map_err(opened)?,
            checkpoint::MIN_GAP,
        )
        .map_err(|e| opened(SqliteError::Thread("checkpoint", e)))?;
        checkpoint::hook(&mut conn, kick).map_err(|e| opened(e.into()))?;
        let readers = (0..opts.readers().max(1))
            .map(|_| open_connection(&opts, false))
            .collect::<Result<Vec<_>, _>>()
            .map_err(opened)?;
        let stats = Arc::new(Stats::default());
        let (tx, rx) = mpsc::channel(opts.queue().max(1));
        let max_batch = opts.max_batch().max(1);
        let thread_stats = Arc::clone(&stats);
        let writer_thread = std::thread::Builder::new()
            .name("idem-sqlite-writer".to_owned())
            .spawn(move || writer::run(conn, rx, max_batch, thread_stats))
            .map_err(|e| opened(SqliteError::Thread("writer", e)))?;
        Ok(Self {
            writer: Some(tx),
            writer_thread: Some(writer_thread),
            checkpointer: Some(checkpointer),
            reader_slots: Arc::new(Semaphore::new(readers.len())),
            readers: Arc::new(Mutex::new(readers)),
            stats,
            path: opts.path().to_path_buf(),
            migrated,
        })
    }

    /// What opening did to the schema (opening migrates it).
    pub fn migrated(&self) -> idem::store::Migrated {
        self.migrated
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Group-commit counters: `operations / commits` is the mean batch size.
    pub fn commit_stats(&self) -> CommitStats {
        use std::sync::atomic::Ordering::Relaxed;
        CommitStats {
            commits: self.stats.commits.load(Relaxed),
            operations: self.stats.operations.load(Relaxed),
            failed_commits: self.stats.failed_commits.load(Relaxed),
        }
    }

    /// Queues `work` for the writer and waits for its batch to commit.
    async fn write<T, F>(&self, work: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection, &mut Batch) -> Result<T, StoreError> + Send + 'static,
    {
        let stopped = || StoreError::from(SqliteError::WriterStopped);
        let writer = self.writer.as_ref().ok_or_else(stopped)?;
        let (reply, answer) = oneshot::channel();
        writer
            .send(Box::new(Task { work, reply }))
            .await
            .map_err(|_| stopped())?;
        answer.await.map_err(|_| stopped())?
    }

    /// Runs `work` on a reader connection, off the async threads.
    async fn read<T, F>(&self, work: F) -> Result<T, StoreError>
    where
        T: Send + 'static,
        F: FnOnce(&Connection) -> Result<T, SqliteError> + Send + 'static,
    {
        let permit = Arc::clone(&self.reader_slots)
            .acquire_owned()
            .await
            .map_err(|_| StoreError::from(SqliteError::WriterStopped))?;
        let readers = Arc::clone(&self.readers);
        let joined = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            let conn = lock(&readers)
                .pop()
                .expect("a permit guarantees a free reader");
            let result = work(&conn);
            lock(&readers).push(conn);
            result
        })
        .await;
        match joined {
            Ok(result) => result.map_err(StoreError::from),
            Err(e) => Err(StoreError::Backend(Box::new(e))),
        }
    }
}

fn lock(m: &Mutex<Vec<Connection>>) -> std::sync::MutexGuard<'_, Vec<Connection>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Drop for SqliteStore {
    /// Closes the queue and waits for the writer to finish what was queued,
    /// so a store reopened right after sees every answered write.
    fn drop(&mut self) {
        self.checkpointer.take();
        self.writer.take();
        if let Some(handle) = self.writer_thread.take() {
            let _ = handle.join();
        }
    }
}

/// Creates the database file, readable and writable by its owner only
/// (mode 0600), when it does not exist yet: it holds every stored answer.
/// SQLite gives its `-wal` and `-shm` files the database file's mode.
fn create_private(path: &Path) -> Result<(), SqliteError> {
    let name = path.to_string_lossy();
    if name == ":memory:" || name.starts_with("file:") || path.exists() {
        return Ok(());
    }
    let mut file = std::fs::OpenOptions::new();
    file.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut file, 0o600);
    match file.open(path) {
        Ok(_) => Ok(()),
        // Made meanwhile by another opener: theirs.
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(SqliteError::Create(e)),
    }
}

fn open_connection(opts: &SqliteOptions, writer: bool) -> Result<Connection, SqliteError> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX
        | OpenFlags::SQLITE_OPEN_URI;
    let conn = Connection::open_with_flags(opts.path(), flags)?;
    conn.busy_timeout(opts.busy_timeout())?;
    // The first statement that reads the file: a non-database fails here.
    let mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(SqliteError::Sqlite(rusqlite::Error::InvalidParameterName(
            format!("could not switch journal_mode to WAL (got {mode})"),
        )));
    }
    conn.pragma_update(
        None,
        "synchronous",
        match opts.synchronous() {
            Synchronous::Full => "FULL",
            Synchronous::Normal => "NORMAL",
        },
    )?;
    conn.set_prepared_statement_cache_capacity(32);
    if !writer {
        conn.pragma_update(None, "query_only", true)?;
    }
    Ok(conn)
}

fn to_store(err: rusqlite::Error) -> StoreError {
    SqliteError::from(err).into()
}

/// Runs a fenced update/delete; zero rows touched means "not the owner".
fn fenced(changed: rusqlite::Result<usize>) -> Result<(), StoreError> {
    match changed.map_err(to_store)? {
        0 => Err(StoreError::Fenced),
        _ => Ok(()),
    }
}

/// Reads one record as stored (expired or not).
fn select_record(
    conn: &Connection,
    scope: &Scope,
    key: &IdempotencyKey,
) -> Result<Option<Record>, SqliteError> {
    Ok(conn
        .prepare_cached(&schema::select_one())?
        .query_row(
            params![scope.tenant(), scope.operation(), key.as_str()],
            schema::record_from_row,
        )
        .optional()?)
}

/// An owned copy of a [`ReserveRequest`], to cross to the writer thread.
struct OwnedReserve {
    scope: Scope,
    key: IdempotencyKey,
    fingerprint: idem::Fingerprint,
    owner: idem::OwnerToken,
    lease: Duration,
    retention: Duration,
    on_lease_expiry: idem::LeaseExpiry,
}

impl OwnedReserve {
    fn borrow(&self) -> ReserveRequest<'_> {
        ReserveRequest {
            scope: &self.scope,
            key: &self.key,
            fingerprint: self.fingerprint,
            owner: self.owner,
            lease: self.lease,
            retention: self.retention,
            on_lease_expiry: self.on_lease_expiry,
        }
    }
}

/// The reservation, inside the writer's transaction: insert if absent;
/// otherwise decide on the existing row with the rules all stores share.
fn reserve_in_tx(
    conn: &Connection,
    batch: &mut Batch,
    req: &OwnedReserve,
) -> Result<Reservation, StoreError> {
    let now = batch.now;
    let id = record_id(&req.scope, &req.key);
    let (tenant, operation, key) = (req.scope.tenant(), req.scope.operation(), req.key.as_str());
    let locked_until = now.plus(req.lease);
    let fingerprint = req.fingerprint.digest().as_slice();
    let owner = req.owner.to_bytes();
    let inserted = conn
        .prepare_cached(schema::INSERT_NEW)
        .and_then(|mut s| {
            s.execute(params![
                tenant,
                operation,
                key,
                fingerprint,
                now.as_millis(),
                now.plus(req.retention).as_millis(),
                locked_until.as_millis(),
                owner.as_slice(),
            ])
        })
        .map_err(to_store)?;
    let fresh = Lease {
        owner: req.owner,
        attempt: 1,
        locked_until,
    };
    if inserted == 1 {
        batch.touch(id);
        return Ok(Reservation::Acquired(fresh));
    }
    let existing = conn
        .prepare_cached(&schema::select_one())
        .and_then(|mut s| s.query_row(params![tenant, operation, key], schema::record_from_row))
        .map_err(to_store)?;
    let decision = decide_existing(&existing, &req.borrow(), now);
    match decision {
        ExistingDecision::Replace | ExistingDecision::TakeOver => batch.touch(id),
        // Nothing written: if no earlier operation of this batch wrote the
        // record either, the answer rests on committed state.
        _ if !batch.is_touched(id) => batch.settle(),
        _ => {}
    }
    Ok(match decision {
        ExistingDecision::Replace => {
            conn.prepare_cached(schema::REPLACE_EXPIRED)
                .and_then(|mut s| {
                    s.execute(params![
                        tenant,
                        operation,
                        key,
                        fingerprint,
                        now.as_millis(),
                        now.plus(req.retention).as_millis(),
                        locked_until.as_millis(),
                        owner.as_slice(),
                    ])
                })
                .map_err(to_store)?;
            Reservation::Acquired(fresh)
        }
        ExistingDecision::TakeOver => {
            let attempt: u32 = conn
                .prepare_cached(schema::TAKE_OVER)
                .and_then(|mut s| {
                    s.query_row(
                        params![
                            tenant,
                            operation,
                            key,
                            owner.as_slice(),
                            locked_until.as_millis(),
                            now.as_millis(),
                            existing.lease.attempt,
                        ],
                        |r| r.get(0),
                    )
                })
                .map_err(to_store)?;
            Reservation::Acquired(Lease { attempt, ..fresh })
        }
        ExistingDecision::Replay => Reservation::Existing(Box::new(existing)),
        ExistingDecision::InProgress {
            retry_after,
            outcome_unknown,
        } => Reservation::InProgress {
            retry_after,
            outcome_unknown,
        },
        ExistingDecision::Mismatch => Reservation::Mismatch {
            state: existing.state,
        },
    })
}

/// A short identity of a record within a batch (a collision only makes an
/// answer wait for the commit).
fn record_id(scope: &Scope, key: &IdempotencyKey) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (scope.tenant(), scope.operation(), key.as_str()).hash(&mut h);
    h.finish()
}

/// Parameters 1–5 of every fenced statement: the record and its lease.
fn lease_params<'a>(
    scope: &'a Scope,
    key: &'a IdempotencyKey,
    owner: &'a [u8; 16],
    lease: &Lease,
) -> (&'a str, &'a str, &'a str, &'a [u8], u32) {
    (
        scope.tenant(),
        scope.operation(),
        key.as_str(),
        owner.as_slice(),
        lease.attempt,
    )
}

impl Store for SqliteStore {
    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        let req = OwnedReserve {
            scope: req.scope.clone(),
            key: req.key.clone(),
            fingerprint: req.fingerprint,
            owner: req.owner,
            lease: req.lease,
            retention: req.retention,
            on_lease_expiry: req.on_lease_expiry,
        };
        self.write(move |conn, batch| reserve_in_tx(conn, batch, &req))
            .await
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        let (scope, key) = (scope.clone(), key.clone());
        let now = Timestamp::now();
        self.read(move |conn| Ok(select_record(conn, &scope, &key)?.filter(|r| !r.is_expired(now))))
            .await
    }

    async fn resolve(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        outcome: &FinalOutcome,
    ) -> Result<(), StoreError> {
        let (scope, key, lease, outcome) = (scope.clone(), key.clone(), *lease, outcome.clone());
        self.write(move |conn, batch| {
            let now = batch.now;
            batch.touch(record_id(&scope, &key));
            let owner = lease.owner.to_bytes();
            let (t, o, k, w, a) = lease_params(&scope, &key, &owner, &lease);
            let state: idem::RecordState = outcome.verdict.into();
            let headers = outcome.response.encode_headers();
            fenced(conn.prepare_cached(schema::RESOLVE).and_then(|mut s| {
                s.execute(params![
                    t,
                    o,
                    k,
                    w,
                    a,
                    state.as_str(),
                    now.as_millis(),
                    now.plus(outcome.retention).as_millis(),
                    outcome.response.status,
                    headers,
                    &outcome.response.body[..],
                    outcome.resource_id,
                    outcome.error_code,
                ])
            }))
        })
        .await
    }

    async fn release(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        let (scope, key, lease) = (scope.clone(), key.clone(), *lease);
        self.write(move |conn, batch| {
            batch.touch(record_id(&scope, &key));
            let owner = lease.owner.to_bytes();
            let (t, o, k, w, a) = lease_params(&scope, &key, &owner, &lease);
            fenced(
                conn.prepare_cached(schema::RELEASE)
                    .and_then(|mut s| s.execute(params![t, o, k, w, a])),
            )
        })
        .await
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        _reason: &str,
    ) -> Result<(), StoreError> {
        let (scope, key, lease) = (scope.clone(), key.clone(), *lease);
        self.write(move |conn, batch| {
            let now = batch.now;
            batch.touch(record_id(&scope, &key));
            let owner = lease.owner.to_bytes();
            let (t, o, k, w, a) = lease_params(&scope, &key, &owner, &lease);
            fenced(
                conn.prepare_cached(schema::MARK_UNKNOWN)
                    .and_then(|mut s| s.execute(params![t, o, k, w, a, now.as_millis()])),
            )
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
        let (scope, key, lease) = (scope.clone(), key.clone(), *lease);
        self.write(move |conn, batch| {
            let now = batch.now;
            batch.touch(record_id(&scope, &key));
            let owner = lease.owner.to_bytes();
            let (t, o, k, w, a) = lease_params(&scope, &key, &owner, &lease);
            let until = now.plus(duration);
            fenced(conn.prepare_cached(schema::RENEW).and_then(|mut s| {
                s.execute(params![t, o, k, w, a, until.as_millis(), now.as_millis()])
            }))?;
            Ok(until)
        })
        .await
    }
}

impl ListRecords for SqliteStore {
    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        let filter = filter.clone();
        let now = Timestamp::now();
        let limit = filter.page_size();
        self.read(move |conn| {
            let after = filter.after.as_ref();
            let mut stmt = conn.prepare_cached(&schema::list_query(filter.state))?;
            let rows = stmt.query_map(
                params![
                    filter.state.map(|s| s.as_str()),
                    filter.older_than.map(|age| now.minus(age).as_millis()),
                    filter.tenant,
                    now.as_millis(),
                    after.map(|c| c.created_at.as_millis()),
                    after.map(|c| c.tenant.as_str()),
                    after.map(|c| c.operation.as_str()),
                    after.map(|c| c.key.as_str()),
                    i64::try_from(limit + 1).unwrap_or(i64::MAX),
                ],
                schema::record_from_row,
            )?;
            let records = rows.collect::<Result<Vec<_>, _>>()?;
            Ok(Page::from_read_ahead(records, limit))
        })
        .await
    }
}

impl Purge for SqliteStore {
    /// Deletes up to `batch` expired records in writer jobs of at most
    /// [`PURGE_CHUNK`] rows, each committed with whatever serving operations
    /// are queued at the time: a large batch never holds the single writer
    /// (and every caller queued behind it) for one long transaction.
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        let mut deleted = 0;
        let mut left = batch;
        while left > 0 {
            let chunk = left.min(PURGE_CHUNK);
            let limit = i64::try_from(chunk).unwrap_or(i64::MAX);
            let n = self
                .write(move |conn, b| {
                    conn.prepare_cached(schema::PURGE_EXPIRED)
                        .and_then(|mut s| s.execute(params![b.now.as_millis(), limit]))
                        .map(|n| n as u64)
                        .map_err(to_store)
                })
                .await?;
            deleted += n;
            left -= chunk;
            if n < chunk as u64 {
                break;
            }
        }
        Ok(deleted)
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        let (scope, key) = (scope.clone(), key.clone());
        self.write(move |conn, batch| {
            batch.touch(record_id(&scope, &key));
            conn.prepare_cached(schema::DELETE)
                .and_then(|mut s| {
                    s.execute(params![scope.tenant(), scope.operation(), key.as_str()])
                })
                .map(|n| n > 0)
                .map_err(to_store)
        })
        .await
    }
}

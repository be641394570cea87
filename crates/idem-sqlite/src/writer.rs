//! The single writer thread and its group commit.
//!
//! SQLite allows one writer at a time, and a durable commit costs an fsync.
//! Instead of one transaction per operation, one thread owns the write
//! connection and drains a queue: whatever operations arrived while the
//! previous commit was being synced are executed together in one
//! transaction and made durable by one commit. Each caller is answered only
//! after *its* batch committed; if the commit fails, every caller in the
//! batch gets the error, and earlier batches are untouched.
//!
//! Under load the batch grows by itself (up to `max_batch`), so the fsync
//! cost is shared by many operations; with a single caller the latency is
//! that of one plain transaction.
//!
//! An operation that changed nothing and read only committed state (a
//! duplicate told "in progress", a replay, a mismatch, on a record no
//! earlier operation of the same batch touched) is answered at once: its
//! answer cannot depend on this batch's commit.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use idem::{StoreError, Timestamp};
use rusqlite::Connection;
use tokio::sync::{mpsc, oneshot};

use crate::error::shared;

/// What a job leaves behind until its batch commits: the answer to send,
/// given the commit's error (if any).
type Pending = Box<dyn FnOnce(Option<StoreError>) + Send>;

/// What an operation knows about its batch.
#[derive(Debug)]
pub(crate) struct Batch {
    /// The batch's time, from the process clock.
    pub(crate) now: Timestamp,
    touched: HashSet<u64>,
    settled: bool,
}

impl Batch {
    fn new() -> Self {
        Self {
            now: Timestamp::now(),
            touched: HashSet::new(),
            settled: false,
        }
    }

    /// Records that this batch writes the record `id`.
    pub(crate) fn touch(&mut self, id: u64) {
        self.touched.insert(id);
    }

    /// Whether an earlier operation of this batch wrote the record `id`.
    pub(crate) fn is_touched(&self, id: u64) -> bool {
        self.touched.contains(&id)
    }

    /// Says the current operation's answer rests on committed state only
    /// and may be sent before the commit.
    pub(crate) fn settle(&mut self) {
        self.settled = true;
    }
}

/// One queued write operation.
pub(crate) trait Job: Send {
    /// Executes the operation inside the batch's open transaction; `None`
    /// when it was answered already.
    fn run(self: Box<Self>, conn: &Connection, batch: &mut Batch) -> Option<Pending>;
    /// Answers the caller with `err` without executing.
    fn abort(self: Box<Self>, err: StoreError);
}

/// A job: some work on the connection and where to send its result.
pub(crate) struct Task<T, F> {
    pub(crate) work: F,
    pub(crate) reply: oneshot::Sender<Result<T, StoreError>>,
}

impl<T, F> Job for Task<T, F>
where
    T: Send + 'static,
    F: FnOnce(&Connection, &mut Batch) -> Result<T, StoreError> + Send,
{
    fn run(self: Box<Self>, conn: &Connection, batch: &mut Batch) -> Option<Pending> {
        let Task { work, reply } = *self;
        batch.settled = false;
        let result = work(conn, batch);
        if batch.settled && result.is_ok() {
            let _ = reply.send(result);
            return None;
        }
        Some(Box::new(move |commit_error| {
            // A caller that stopped waiting (cancelled) is not an error here.
            let _ = reply.send(match commit_error {
                Some(err) => Err(err),
                None => result,
            });
        }))
    }

    fn abort(self: Box<Self>, err: StoreError) {
        let _ = self.reply.send(Err(err));
    }
}

/// Counters that show how well group commit works.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    pub(crate) commits: AtomicU64,
    pub(crate) operations: AtomicU64,
    pub(crate) failed_commits: AtomicU64,
}

/// Runs the writer until every sender is dropped, then finishes the queue.
pub(crate) fn run(
    mut conn: Connection,
    mut queue: mpsc::Receiver<Box<dyn Job>>,
    max_batch: usize,
    stats: Arc<Stats>,
) {
    let mut jobs: Vec<Box<dyn Job>> = Vec::with_capacity(max_batch);
    let mut pending: Vec<Pending> = Vec::with_capacity(max_batch);
    while let Some(first) = next_job(&mut queue) {
        jobs.push(first);
        while jobs.len() < max_batch {
            match queue.try_recv() {
                Ok(job) => jobs.push(job),
                Err(_) => break,
            }
        }
        run_batch(&mut conn, &mut jobs, &mut pending, &stats);
    }
    // Leave the WAL small for the next opener.
    let _ = conn.execute_batch("PRAGMA wal_checkpoint(PASSIVE)");
}

/// How long the writer polls its queue after a batch before it parks.
///
/// A caller that finds the writer parked must wake it (a futex wake), and
/// on a VM waking an idle vCPU costs more than the statements it runs: at
/// one connection the profile put most of the writer's time in such
/// wake-ups. A request's resolution, and the next request's reservation,
/// usually arrive within this window, so the writer is still awake to
/// take them. Under load the queue is never empty and the window is never
/// used; idle, it costs at most this much CPU per batch.
const POLL_BEFORE_PARKING: Duration = Duration::from_micros(200);

/// The next job: polled for [`POLL_BEFORE_PARKING`], then waited for.
/// `None` once every sender is gone.
fn next_job(queue: &mut mpsc::Receiver<Box<dyn Job>>) -> Option<Box<dyn Job>> {
    let until = Instant::now() + POLL_BEFORE_PARKING;
    loop {
        match queue.try_recv() {
            Ok(job) => return Some(job),
            Err(mpsc::error::TryRecvError::Disconnected) => return None,
            Err(mpsc::error::TryRecvError::Empty) if Instant::now() < until => {
                std::hint::spin_loop();
            }
            Err(mpsc::error::TryRecvError::Empty) => return queue.blocking_recv(),
        }
    }
}

fn run_batch(
    conn: &mut Connection,
    jobs: &mut Vec<Box<dyn Job>>,
    pending: &mut Vec<Pending>,
    stats: &Stats,
) {
    let mut jobs = jobs.drain(..);
    'transaction: loop {
        let mut batch = Batch::new();
        if let Err(err) = conn.execute_batch("BEGIN IMMEDIATE") {
            let err = Arc::new(err);
            for job in jobs.by_ref() {
                job.abort(shared(&err));
            }
            return;
        }
        for job in jobs.by_ref() {
            pending.extend(job.run(conn, &mut batch));
            if conn.is_autocommit() {
                // SQLite rolled the whole transaction back (I/O error, disk
                // full, out of memory): everything in it so far is lost, so
                // those callers hear it, and the rest of the queue starts a
                // new transaction.
                stats.failed_commits.fetch_add(1, Ordering::Relaxed);
                for answer in pending.drain(..) {
                    answer(Some(StoreError::unavailable(
                        "SQLite rolled the batch transaction back after an error; nothing in it was stored",
                    )));
                }
                continue 'transaction;
            }
        }
        break;
    }
    stats
        .operations
        .fetch_add(pending.len() as u64, Ordering::Relaxed);
    match conn.execute_batch("COMMIT") {
        Ok(()) => {
            stats.commits.fetch_add(1, Ordering::Relaxed);
            for answer in pending.drain(..) {
                answer(None);
            }
        }
        Err(err) => {
            stats.failed_commits.fetch_add(1, Ordering::Relaxed);
            tracing::error!(%err, batch = pending.len(), "sqlite: batch commit failed");
            let _ = conn.execute_batch("ROLLBACK");
            let err = Arc::new(err);
            for answer in pending.drain(..) {
                answer(Some(shared(&err)));
            }
        }
    }
}

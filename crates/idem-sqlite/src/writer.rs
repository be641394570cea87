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

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use idem::{StoreError, Timestamp};
use rusqlite::Connection;
use tokio::sync::{mpsc, oneshot};

use crate::error::shared;

/// What a job leaves behind until its batch commits: the answer to send,
/// given the commit's error (if any).
type Pending = Box<dyn FnOnce(Option<StoreError>) + Send>;

/// One queued write operation.
pub(crate) trait Job: Send {
    /// Executes the operation inside the batch's open transaction.
    fn run(self: Box<Self>, conn: &Connection, now: Timestamp) -> Pending;
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
    F: FnOnce(&Connection, Timestamp) -> Result<T, StoreError> + Send,
{
    fn run(self: Box<Self>, conn: &Connection, now: Timestamp) -> Pending {
        let Task { work, reply } = *self;
        let result = work(conn, now);
        Box::new(move |commit_error| {
            // A caller that stopped waiting (cancelled) is not an error here.
            let _ = reply.send(match commit_error {
                Some(err) => Err(err),
                None => result,
            });
        })
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
    while let Some(first) = queue.blocking_recv() {
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

fn run_batch(
    conn: &mut Connection,
    jobs: &mut Vec<Box<dyn Job>>,
    pending: &mut Vec<Pending>,
    stats: &Stats,
) {
    let now = Timestamp::now();
    let mut jobs = jobs.drain(..);
    'transaction: loop {
        if let Err(err) = conn.execute_batch("BEGIN IMMEDIATE") {
            let err = Arc::new(err);
            for job in jobs.by_ref() {
                job.abort(shared(&err));
            }
            return;
        }
        for job in jobs.by_ref() {
            pending.push(job.run(conn, now));
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

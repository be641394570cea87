//! Group commit, for stores whose cost is per statement and per commit
//! rather than per row (PostgreSQL, MySQL): concurrent operations of one
//! kind share one statement or transaction, and one commit.
//!
//! A [`Batcher`] lets at most [`GroupCommit::in_flight`] groups of its kind
//! run at once. While one of those slots is free, an operation takes it and
//! runs as its plain statement(s), with no hand-off: an idle store answers
//! as fast as without grouping. When every slot is busy, operations queue;
//! as soon as a slot frees, the collector runs whatever queued by then (up
//! to [`GroupCommit::max_batch`]) as one group. So a busy store pays one
//! commit for many requests.
//!
//! What a group keeps from the statements it replaces:
//!
//! * **one key once per group**: a second operation on a key already in
//!   the group waits for the next one, so a group never races itself;
//! * **one lock order**: a group is sorted by `(tenant, operation, key)`,
//!   so two groups touching the same keys wait on each other in one
//!   order, never in a cycle. Should the store still report a conflict
//!   (its store classifies it as [`Failure::Conflict`]), the group rolled
//!   back whole and each of its callers runs its operation on its own;
//! * **nothing for a caller that left**: an operation whose caller stopped
//!   waiting (a store time-out) before its group was formed is dropped, not
//!   run; one already running finishes, like a single statement would;
//! * **errors for everyone**: a group that fails (connection lost, server
//!   down) fails every operation in it, with the same classification
//!   (transient or not) as a single statement's error.

use std::collections::{HashSet, VecDeque};
use std::future::Future;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};

use crate::StoreError;

/// How operations are grouped: the store options' `group_commit_max` and
/// `group_commit_in_flight`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupCommit {
    /// Most operations one group carries.
    pub max_batch: u32,
    /// Most groups of one kind running at once (each holds a
    /// connection).
    pub in_flight: u32,
}

impl GroupCommit {
    /// 64 operations a group, 2 groups of a kind at once.
    pub const DEFAULT: Self = Self {
        max_batch: 64,
        in_flight: 2,
    };
}

/// How many groups ran, how many operations they carried,
/// and how many operations ran alone in a free slot.
#[derive(Debug, Default)]
pub struct Counts {
    groups: AtomicU64,
    operations: AtomicU64,
    alone: AtomicU64,
}

impl Counts {
    /// `(groups, operations, alone)` so far.
    pub fn read(&self) -> (u64, u64, u64) {
        (
            self.groups.load(Ordering::Relaxed),
            self.operations.load(Ordering::Relaxed),
            self.alone.load(Ordering::Relaxed),
        )
    }
}

/// A `(tenant, operation, key)`: what a batch may hold only once.
pub type RecordId = (String, String, String);

/// An operation a batch can carry.
pub trait Batched: Send + 'static {
    /// The record it touches.
    fn record(&self) -> &RecordId;
}

/// How an operation ran, or is to run.
#[derive(Debug)]
pub enum Answer<O> {
    /// A batch ran it; this is its part of the batch's result.
    Done(O),
    /// Run the plain statement(s): in a free slot (held until the permit is
    /// dropped), or without one when its batch rolled back on a conflict
    /// with another transaction (deadlock, lock wait timeout) or the
    /// collector is gone.
    Alone(Option<OwnedSemaphorePermit>),
}

struct Job<I, O> {
    item: I,
    reply: oneshot::Sender<Result<Answer<O>, StoreError>>,
}

/// Queues operations of one kind for the collector task.
pub struct Batcher<I, O> {
    jobs: mpsc::UnboundedSender<Job<I, O>>,
    /// The slots: one per group of this kind running.
    slots: Arc<Semaphore>,
    counts: Arc<Counts>,
}

impl<I, O> std::fmt::Debug for Batcher<I, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher").finish_non_exhaustive()
    }
}

impl<I: Batched, O: Send + 'static> Batcher<I, O> {
    /// Spawns the collector. `run` executes one batch on `conn` (the
    /// store's pool, cloned for each batch): it gets the operations sorted
    /// by record and answers one output per operation, in their order;
    /// `classify` says whether its error is a conflict with another
    /// transaction (the callers then run alone) or a failure of them all.
    /// The collector stops when the batcher is dropped.
    pub fn start<C, E, F, Fut>(
        conn: C,
        settings: GroupCommit,
        counts: Arc<Counts>,
        run: F,
        classify: fn(E) -> Failure,
    ) -> Self
    where
        C: Clone + Send + Sync + 'static,
        E: Send + 'static,
        F: Fn(C, Vec<I>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Vec<O>, E>> + Send + 'static,
    {
        let (jobs, queue) = mpsc::unbounded_channel();
        let slots = Arc::new(Semaphore::new(settings.in_flight.max(1) as usize));
        tokio::spawn(collect(
            conn,
            settings.max_batch as usize,
            Arc::clone(&slots),
            Arc::clone(&counts),
            queue,
            Arc::new(run),
            classify,
        ));
        Self {
            jobs,
            slots,
            counts,
        }
    }

    /// An operation's turn: a free slot, if there is one and nothing
    /// waits for it (the caller runs the plain statement(s) while it holds
    /// it); otherwise `item()` goes into the next batch with room for it.
    ///
    /// The collector runs on the Tokio runtime of the store's first
    /// operation. Should it be gone (that runtime shutting down), or a
    /// batch be dropped with it, the answer is to run alone: safe, as a
    /// reservation that did commit reads back as in progress, and a
    /// resolution is the same fenced update again.
    pub async fn turn(&self, item: impl FnOnce() -> I) -> Result<Answer<O>, StoreError> {
        if let Ok(slot) = Arc::clone(&self.slots).try_acquire_owned() {
            self.counts.alone.fetch_add(1, Ordering::Relaxed);
            return Ok(Answer::Alone(Some(slot)));
        }
        let (reply, answer) = oneshot::channel();
        if self
            .jobs
            .send(Job {
                item: item(),
                reply,
            })
            .is_err()
        {
            return Ok(Answer::Alone(None));
        }
        answer.await.unwrap_or(Ok(Answer::Alone(None)))
    }
}

#[allow(clippy::too_many_arguments)]
async fn collect<C, E, I, O, F, Fut>(
    conn: C,
    max: usize,
    slots: Arc<Semaphore>,
    counts: Arc<Counts>,
    mut queue: mpsc::UnboundedReceiver<Job<I, O>>,
    run: Arc<F>,
    classify: fn(E) -> Failure,
) where
    C: Clone + Send + Sync + 'static,
    E: Send + 'static,
    I: Batched,
    O: Send + 'static,
    F: Fn(C, Vec<I>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Vec<O>, E>> + Send + 'static,
{
    let max = max.max(1);
    // Operations on a key that was already in the batch being formed.
    let mut deferred: VecDeque<Job<I, O>> = VecDeque::new();
    // Records are told apart by hash: a collision only defers an operation
    // to the next batch.
    let hasher = RandomState::new();
    loop {
        let first = match deferred.pop_front() {
            Some(job) => job,
            None => match queue.recv().await {
                Some(job) => job,
                None => return,
            },
        };
        // Whatever queues while the slots are busy joins this batch.
        let Ok(permit) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let mut batch = Vec::with_capacity(max.min(64));
        let mut records = HashSet::new();
        let mut later = Vec::new();
        let mut take = |job: Job<I, O>, batch: &mut Vec<Job<I, O>>| {
            if job.reply.is_closed() {
                // Its caller gave up before anything was sent.
            } else if records.insert(hasher.hash_one(job.item.record())) {
                batch.push(job);
            } else {
                later.push(job);
            }
        };
        take(first, &mut batch);
        for _ in 0..deferred.len() {
            if batch.len() >= max {
                break;
            }
            if let Some(job) = deferred.pop_front() {
                take(job, &mut batch);
            }
        }
        while batch.len() < max {
            match queue.try_recv() {
                Ok(job) => take(job, &mut batch),
                Err(_) => break,
            }
        }
        // Deferred operations keep their turn ahead of newer ones.
        for job in later.into_iter().rev() {
            deferred.push_front(job);
        }
        if batch.is_empty() {
            continue;
        }
        batch.sort_by(|a, b| a.item.record().cmp(b.item.record()));
        counts.groups.fetch_add(1, Ordering::Relaxed);
        counts
            .operations
            .fetch_add(batch.len() as u64, Ordering::Relaxed);
        tokio::spawn(run_batch(
            conn.clone(),
            batch,
            Arc::clone(&run),
            classify,
            permit,
        ));
    }
}

async fn run_batch<C, E, I, O, F, Fut>(
    conn: C,
    batch: Vec<Job<I, O>>,
    run: Arc<F>,
    classify: fn(E) -> Failure,
    _permit: OwnedSemaphorePermit,
) where
    F: Fn(C, Vec<I>) -> Fut,
    Fut: Future<Output = Result<Vec<O>, E>>,
{
    let (items, replies): (Vec<I>, Vec<_>) = batch.into_iter().map(|j| (j.item, j.reply)).unzip();
    let expected = items.len();
    match run(conn, items).await.map_err(classify) {
        Ok(outputs) if outputs.len() == expected => {
            for (reply, output) in replies.into_iter().zip(outputs) {
                let _ = reply.send(Ok(Answer::Done(output)));
            }
        }
        Ok(outputs) => {
            let err = StoreError::corrupt(format!(
                "a batch of {expected} answered {} results",
                outputs.len()
            ));
            answer_all(replies, &err);
        }
        Err(Failure::Conflict) => {
            for reply in replies {
                let _ = reply.send(Ok(Answer::Alone(None)));
            }
        }
        Err(Failure::Store(err)) => answer_all(replies, &err),
    }
}

/// Why a batch failed, as its store reads its error.
#[derive(Debug)]
pub enum Failure {
    /// A conflict with another transaction (a deadlock, a serialization
    /// failure, a lock wait time-out): the batch rolled back whole, and
    /// each of its callers runs its operation on its own.
    Conflict,
    /// Anything else: every operation of the batch fails with it.
    Store(StoreError),
}

/// Gives every caller the batch's error, classified as it was.
fn answer_all<O>(replies: Vec<oneshot::Sender<Result<Answer<O>, StoreError>>>, err: &StoreError) {
    let shared = Arc::new(match err {
        StoreError::Unavailable(inner)
        | StoreError::Corrupt(inner)
        | StoreError::Backend(inner) => inner.to_string(),
        other => other.to_string(),
    });
    for reply in replies {
        let text = SharedText(Arc::clone(&shared));
        let each = match err {
            StoreError::Fenced => StoreError::Fenced,
            StoreError::Unavailable(_) => StoreError::Unavailable(Box::new(text)),
            StoreError::Corrupt(_) => StoreError::Corrupt(Box::new(text)),
            _ => StoreError::Backend(Box::new(text)),
        };
        let _ = reply.send(Err(each));
    }
}

/// One error's text, shared by every operation of the batch it failed.
#[derive(Debug)]
struct SharedText(Arc<String>);

impl std::fmt::Display for SharedText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "a grouped store operation failed: {}", self.0)
    }
}

impl std::error::Error for SharedText {}

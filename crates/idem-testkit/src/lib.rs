//! Test support for idem (not published).
//!
//! * [`conformance`]: the store conformance suite every backend runs, and
//!   the [`store_conformance!`] macro that instantiates it;
//! * [`FaultyStore`]: wraps a real store and fails chosen operations on
//!   demand, to test what the engine does when the store breaks mid-flight;
//! * [`mod@bench`]: the shared harness of the store benchmarks;
//! * [`client`]: one-call HTTP requests with the answer fully read;
//! * [`isolated`]: a PostgreSQL schema, a MySQL database, a DynamoDB
//!   table and a Redis key prefix of a test's own, removed when dropped;
//! * [`fault`]: a TCP proxy that cuts, black-holes, resets, slows or
//!   throttles the line to a server;
//! * [`kafka`]: a plain Kafka client (topics, produce, read back);
//! * [`otlp`]: an OTLP/HTTP trace receiver that keeps what it decodes;
//! * [`servers`]: a private Redis, Redis Cluster, PostgreSQL and Kafka
//!   (Tansu) broker a test may crash and restart;
//! * [`upstream`]: a counting HTTP upstream on loopback for gateway tests;
//! * [`wait`]: polling for a state the product reaches on its own time;
//! * [`services`]: finds the loopback servers (PostgreSQL, MySQL, Redis,
//!   NATS, RabbitMQ, Kafka, a DynamoDB emulator); skips loudly when one is absent, or fails under
//!   `IDEM_REQUIRE_SERVICES=1`.

pub mod bench;
pub mod client;
pub mod conformance;
pub mod fault;
pub mod gateway;
pub mod isolated;
pub mod kafka;
pub mod ledger;
pub mod otlp;
pub mod peers;
pub mod servers;
pub mod services;
pub mod upstream;
pub mod wait;

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use std::future::Future;

use idem::store::{Around, Hook};
use idem::{Store, StoreError};

pub use idem::store::Op;

/// A store that fails the next N calls of chosen operations with
/// [`StoreError::Unavailable`] (before or after they took effect) or
/// [`StoreError::Backend`], and
/// otherwise delegates to a real store: [`Faults`] around it. Make one
/// with [`faulty`]; set its faults through [`Around::hook`].
pub type FaultyStore<S> = Around<Faults<S>>;

/// `inner` with no faults until [`Faults::fail_next`] and the like.
pub fn faulty<S: Store>(inner: S) -> FaultyStore<S> {
    Around::new(Faults::new(inner))
}

/// The faults a [`FaultyStore`] injects, per operation.
#[derive(Debug)]
pub struct Faults<S> {
    inner: S,
    failures: [AtomicU32; Op::COUNT],
    broken: [AtomicU32; Op::COUNT],
    broken_answers: [AtomicU32; Op::COUNT],
    lost_answers: [AtomicU32; Op::COUNT],
    calls: [AtomicU32; Op::COUNT],
    delays_ms: [AtomicU32; Op::COUNT],
}

impl<S> Faults<S> {
    /// Wraps `inner`; no faults until [`fail_next`](Self::fail_next).
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            failures: Default::default(),
            broken: Default::default(),
            broken_answers: Default::default(),
            lost_answers: Default::default(),
            calls: Default::default(),
            delays_ms: Default::default(),
        }
    }

    /// Makes the next `n` calls of `op` fail.
    pub fn fail_next(&self, op: Op, n: u32) {
        self.failures[op as usize].store(n, Ordering::SeqCst);
    }

    /// Makes the next `n` calls of `op` fail with [`StoreError::Backend`]:
    /// an error the store gives no reason to expect will pass (a driver's
    /// protocol error, a statement the server refused).
    pub fn break_next(&self, op: Op, n: u32) {
        self.broken[op as usize].store(n, Ordering::SeqCst);
    }

    /// Makes the next `n` calls of `op` take effect in the store and then
    /// fail, as when the connection drops after the commit and before its
    /// acknowledgement reached the caller.
    pub fn lose_answer_next(&self, op: Op, n: u32) {
        self.lost_answers[op as usize].store(n, Ordering::SeqCst);
    }

    /// Makes the next `n` calls of `op` take effect in the store and then
    /// fail with [`StoreError::Backend`], as when a durable commit is
    /// reported as failed.
    pub fn break_answer_next(&self, op: Op, n: u32) {
        self.broken_answers[op as usize].store(n, Ordering::SeqCst);
    }

    /// Makes every call of `op` answer `delay` late, after the operation
    /// took effect (a slow store).
    pub fn delay(&self, op: Op, delay: Duration) {
        self.delays_ms[op as usize].store(
            u32::try_from(delay.as_millis()).unwrap_or(u32::MAX),
            Ordering::SeqCst,
        );
    }

    /// How many times `op` was called (failed or not).
    pub fn calls(&self, op: Op) -> u32 {
        self.calls[op as usize].load(Ordering::SeqCst)
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// The configured delay, applied *after* the real operation: the
    /// store did the work but answers late (like a slow commit).
    async fn pause(&self, op: Op) {
        let delay = self.delays_ms[op as usize].load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(u64::from(delay))).await;
        }
    }

    fn check(&self, op: Op) -> Result<(), StoreError> {
        self.calls[op as usize].fetch_add(1, Ordering::SeqCst);
        take_one(&self.failures[op as usize], op, "injected fault")?;
        take_backend(&self.broken[op as usize], op, "in")
    }

    /// After the real operation: its delay, then a lost answer if one is
    /// due, else its result.
    async fn answer<T>(&self, op: Op, result: Result<T, StoreError>) -> Result<T, StoreError> {
        self.pause(op).await;
        take_one(&self.lost_answers[op as usize], op, "answer lost after")?;
        take_backend(&self.broken_answers[op as usize], op, "after the effect of")?;
        result
    }
}

/// Counts one injected fault down; an error while any was left.
fn take_one(left: &AtomicU32, op: Op, what: &str) -> Result<(), StoreError> {
    match left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)) {
        Ok(_) => Err(StoreError::unavailable(format!("{what} in {op:?}"))),
        Err(_) => Ok(()),
    }
}

/// Counts one injected [`StoreError::Backend`] down; the error while any
/// was left.
fn take_backend(left: &AtomicU32, op: Op, when: &str) -> Result<(), StoreError> {
    match left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1)) {
        Ok(_) => Err(StoreError::Backend(
            format!("injected backend error {when} {op:?}").into(),
        )),
        Err(_) => Ok(()),
    }
}

impl<S: Store> Hook for Faults<S> {
    type Inner = S;

    async fn around<'a, T, Fut>(
        &'a self,
        op: Op,
        call: impl FnOnce(&'a S) -> Fut + Send + 'a,
    ) -> Result<T, StoreError>
    where
        T: Send + 'a,
        Fut: Future<Output = Result<T, StoreError>> + Send + 'a,
    {
        self.check(op)?;
        let result = call(&self.inner).await;
        self.answer(op, result).await
    }
}

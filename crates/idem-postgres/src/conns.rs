//! Connections kept by the store between its own operations.
//!
//! sqlx tests every connection it takes back into its pool with a round
//! trip (a `Sync` and the server's `ReadyForQuery`), whatever the
//! connection just did. Through the pool, a reservation and a resolution
//! would each pay that round trip on top of their one statement, and the
//! release of the resolution's connection would run before the answer
//! goes out: four round trips per request where the two statements need
//! two (strace of one request through the gateway,
//! docs/BENCHMARKS.md#current-figures). So the store keeps the connections its
//! record operations used, checked out of the pool, and lends them again:
//!
//! * only a connection whose statement **completed** is kept: the driver
//!   read the server's answer to the end, so the connection is idle and
//!   in no transaction. One whose operation failed or was cancelled goes
//!   back to the pool, which tests it on its way back;
//! * a connection stays kept for at most [`KEEP`] without use: a sweep
//!   hands the others back to the pool, where its idle timeout applies
//!   and the caller's own transactions (`store.pool().begin()`) find
//!   them. One kept for
//!   [`PgOptions::ping_after_idle`](crate::PgOptions::ping_after_idle) or
//!   longer is tested before it is lent, as the pool tests one after an
//!   idle spell;
//! * the most recently used connection is lent first, so a quiet store
//!   keeps few of them;
//! * kept connections count as checked out: the pool's maximum still
//!   bounds them all. So the store's operations queue for a connection
//!   here, not in the pool, where a kept one would never reach them: at
//!   most the pool's maximum are lent at once, each waiting at most the
//!   pool's acquire time-out for its turn.
//!
//! * on a thread [dedicated](idem::store::local::dedicate_current_thread)
//!   to one single-threaded runtime (the gateway's serving threads), an
//!   operation first asks for that thread's own connection
//!   ([`idem::store::local::PerThread`]), opened outside the pool by that
//!   thread, so the thread's own event loop hears the server's answers;
//!   the kept and pooled connections serve while it is busy, opening, or
//!   failed. Such connections are set aside out of `max_connections`
//!   ([`PgOptions::thread_connections`](crate::PgOptions::thread_connections)):
//!   each holds a seat for its life, the pool opens at most the rest, so
//!   the server sees no more than `max_connections` in all. An operation
//!   on a thread's own connection takes no turn: it is that thread's alone.
//!
//! With `ping_after_idle` zero (a test before every operation) nothing is
//! kept, and no thread has a connection of its own.

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use idem::store::local::{PerThread, Taken};
use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgConnection, PgPool, Postgres};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Longest a connection stays kept without use.
pub(crate) const KEEP: Duration = Duration::from_millis(250);

/// The store's kept connections; cheap to clone (clones share them).
#[derive(Debug, Clone)]
pub(crate) struct Conns {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    pool: PgPool,
    /// One per connection the pool may open: the store's turns.
    turns: Arc<Semaphore>,
    state: Mutex<State>,
    /// The dedicated threads' own connections; `None` when no connection
    /// is set aside for them (nothing is ever opened or looked up).
    own: Option<Arc<PerThread<Own>>>,
    /// One per connection a thread may have of its own.
    seats: Arc<Semaphore>,
    /// Operations whose connection was dropped before they completed
    /// (failed or cancelled).
    failures: AtomicU64,
    /// How long a connection stays kept without use (zero: none is kept).
    keep: Duration,
    /// How long one may have been kept before it is tested when lent;
    /// `None`: never.
    test_after: Option<Duration>,
}

#[derive(Debug, Default)]
struct State {
    /// The most recently used last.
    kept: Vec<Kept>,
    /// Whether the sweep runs (it stops when nothing is kept).
    sweeping: bool,
}

#[derive(Debug)]
struct Kept {
    conn: PoolConnection<Postgres>,
    since: Instant,
}

/// A connection lent to one operation. Dropped, it goes back to the pool
/// (which tests it); [`done`](Self::done) keeps it for the next operation.
#[derive(Debug)]
pub(crate) struct Lent {
    /// Declared first: dropped (back to the pool, or closed) before the
    /// turn ends. `None` once [`done`](Self::done).
    conn: Option<Conn>,
    home: Conns,
    /// Held for a pool's connection; a thread's own needs none.
    _turn: Option<OwnedSemaphorePermit>,
}

/// A thread's own connection and the seat it holds.
#[derive(Debug)]
pub(crate) struct Own {
    conn: PgConnection,
    /// The store's count of failed operations when it was last kept.
    failures_seen: u64,
    _seat: OwnedSemaphorePermit,
}

impl Own {
    /// Closes the connection, then gives up its seat.
    pub(crate) async fn close(self) -> Result<(), sqlx::Error> {
        let Self { conn, _seat, .. } = self;
        conn.close().await
    }
}

/// Where a lent connection comes from.
#[derive(Debug)]
enum Conn {
    /// The pool (kept or just acquired).
    Pool(PoolConnection<Postgres>),
    /// The calling thread's own.
    Own(Taken<Own>),
}

impl Conns {
    /// Keeps connections of `pool` between operations; one kept for
    /// `test_after` or longer is tested before it is lent (`None`: never
    /// tested; zero: nothing is kept). Up to `seats` dedicated threads
    /// open a connection of their own besides.
    pub(crate) fn new(pool: PgPool, test_after: Option<Duration>, seats: u32) -> Self {
        let keep = test_after.map_or(KEEP, |after| after.min(KEEP));
        let turns = pool.options().get_max_connections() as usize;
        Self {
            inner: Arc::new(Inner {
                turns: Arc::new(Semaphore::new(turns.max(1))),
                pool,
                state: Mutex::default(),
                own: (seats > 0).then(Arc::default),
                seats: Arc::new(Semaphore::new(seats as usize)),
                failures: AtomicU64::new(0),
                keep,
                test_after,
            }),
        }
    }

    /// The pool the connections come from.
    pub(crate) fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// A connection, once it is this caller's turn: the most recently
    /// kept one, else one from the pool. A turn not come within the pool's
    /// acquire time-out fails as the pool's own wait would.
    pub(crate) async fn lend(&self) -> Result<Lent, sqlx::Error> {
        if let Some(own) = self.own().await {
            return Ok(self.lent(Conn::Own(own), None));
        }
        let wait = self.inner.pool.options().get_acquire_timeout();
        let turn = Arc::clone(&self.inner.turns).acquire_owned();
        let turn = match tokio::time::timeout(wait, turn).await {
            Ok(Ok(turn)) => turn,
            Ok(Err(_closed)) => return Err(sqlx::Error::PoolClosed),
            Err(_elapsed) => return Err(sqlx::Error::PoolTimedOut),
        };
        let turn = Some(turn);
        while let Some(kept) = self.inner.take() {
            let mut conn = kept.conn;
            if let Some(after) = self.inner.test_after
                && kept.since.elapsed() >= after
                && let Err(err) = conn.ping().await
            {
                // Dropped: the pool tests it again and closes it.
                tracing::debug!(%err, "a kept connection failed its test");
                continue;
            }
            return Ok(self.lent(Conn::Pool(conn), turn));
        }
        let conn = self.inner.pool.acquire().await?;
        Ok(self.lent(Conn::Pool(conn), turn))
    }

    /// The calling thread's own connection, tested first after an idle
    /// spell as a kept one is; `None` when it has none ready (one is
    /// being opened) or nothing is kept.
    async fn own(&self) -> Option<Taken<Own>> {
        let table = self.inner.own.as_ref()?;
        if self.inner.keep.is_zero() || self.inner.pool.is_closed() {
            return None;
        }
        let mut own = table.take(|| {
            let seat = Arc::clone(&self.inner.seats).try_acquire_owned();
            let failures_seen = self.inner.failures.load(Ordering::Relaxed);
            let options = self.inner.pool.connect_options();
            let wait = self.inner.pool.options().get_acquire_timeout();
            async move {
                let Ok(seat) = seat else {
                    return Err(
                        "every connection set aside for threads (thread_connections) is taken"
                            .to_owned(),
                    );
                };
                match tokio::time::timeout(wait, PgConnection::connect_with(&options)).await {
                    Ok(Ok(conn)) => Ok(Own {
                        conn,
                        failures_seen,
                        _seat: seat,
                    }),
                    Ok(Err(err)) => Err(err.to_string()),
                    Err(_elapsed) => Err(format!("not connected within {wait:?}")),
                }
            }
        })?;
        // Tested after an idle spell, as a kept one is, and after any
        // operation of the store failed since it was kept: a server
        // restart or a broken link ends every thread's connection, and a
        // thread should not fail a request to learn it.
        let failures = self.inner.failures.load(Ordering::Relaxed);
        let suspect = own.failures_seen != failures;
        if let Some(after) = self.inner.test_after
            && (own.idle_for() >= after || suspect)
            && let Err(err) = own.conn.ping().await
        {
            // Dropped: closed, and the thread opens a new one.
            tracing::debug!(%err, "this thread's connection failed its test");
            return None;
        }
        Some(own)
    }

    /// Takes out the dedicated threads' own connections not in use, to
    /// close them with the store (those in use close when their
    /// operations end).
    pub(crate) fn drain_own(&self) -> Vec<Own> {
        self.inner
            .own
            .as_ref()
            .map(|t| t.drain())
            .unwrap_or_default()
    }

    fn lent(&self, conn: Conn, turn: Option<OwnedSemaphorePermit>) -> Lent {
        Lent {
            conn: Some(conn),
            home: self.clone(),
            _turn: turn,
        }
    }

    /// Hands every kept connection back to the pool (before it closes).
    pub(crate) fn give_back(&self) {
        let all = std::mem::take(&mut self.inner.lock().kept);
        drop(all);
    }

    fn keep(&self, conn: PoolConnection<Postgres>) {
        if self.inner.keep.is_zero() || self.inner.pool.is_closed() {
            return;
        }
        let mut state = self.inner.lock();
        state.kept.push(Kept {
            conn,
            since: Instant::now(),
        });
        if !state.sweeping {
            state.sweeping = true;
            tokio::spawn(sweep(Arc::downgrade(&self.inner), self.inner.keep));
        }
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while the state was held cannot leave it half-changed
        // (push, pop and drain only).
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The most recently kept connection (the lock is not held after).
    fn take(&self) -> Option<Kept> {
        self.lock().kept.pop()
    }

    /// Hands back to the pool the connections kept `keep` or longer;
    /// `false` when nothing is kept any more (the sweep stops).
    fn sweep(&self) -> bool {
        let stale: Vec<Kept>;
        let more = {
            let mut state = self.lock();
            let fresh = state
                .kept
                .iter()
                .position(|k| k.since.elapsed() < self.keep);
            let fresh = fresh.unwrap_or(state.kept.len());
            stale = state.kept.drain(..fresh).collect();
            state.sweeping = !state.kept.is_empty();
            state.sweeping
        };
        drop(stale);
        more
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        let kept = std::mem::take(&mut state.kept);
        if kept.is_empty() {
            return;
        }
        if tokio::runtime::Handle::try_current().is_ok() {
            // Back to the pool, which tests and keeps or closes them.
            drop(kept);
        } else if self.pool.options().get_min_connections() == 0 {
            // The pool hands a returned connection to a task, and there is
            // no runtime to run one: close the sockets here instead.
            for kept in kept {
                drop(kept.conn.detach());
            }
        } else {
            // Detached, each would still ask for a task (to open its
            // replacement); with no runtime left, the sockets close with
            // the process.
            std::mem::forget(kept);
        }
    }
}

/// Every `keep`, hands stale kept connections back to the pool, while any
/// is kept and the store is there.
async fn sweep(inner: Weak<Inner>, keep: Duration) {
    loop {
        tokio::time::sleep(keep).await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        if !inner.sweep() {
            return;
        }
    }
}

impl Lent {
    /// The operation completed: keep the connection for the next one
    /// (whose turn starts once it is kept).
    pub(crate) fn done(mut self) {
        match self.conn.take() {
            Some(Conn::Pool(conn)) => self.home.keep(conn),
            Some(Conn::Own(mut own)) => {
                own.failures_seen = self.home.inner.failures.load(Ordering::Relaxed);
                own.keep();
            }
            None => {}
        }
    }

    fn conn(&self) -> &PgConnection {
        match self.conn.as_ref().expect("present until done") {
            Conn::Pool(conn) => conn,
            Conn::Own(own) => &own.conn,
        }
    }

    fn conn_mut(&mut self) -> &mut PgConnection {
        match self.conn.as_mut().expect("present until done") {
            Conn::Pool(conn) => conn,
            Conn::Own(own) => &mut own.conn,
        }
    }
}

impl Drop for Lent {
    fn drop(&mut self) {
        if self.conn.is_some() {
            // Its operation failed or was cancelled: the threads' own
            // connections are tested before their next use.
            self.home.inner.failures.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Deref for Lent {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        self.conn()
    }
}

impl DerefMut for Lent {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.conn_mut()
    }
}

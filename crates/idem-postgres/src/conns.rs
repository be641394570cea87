//! Connections kept by the store between its own operations.
//!
//! sqlx tests every connection it takes back into its pool with a round
//! trip (a `Sync` and the server's `ReadyForQuery`), whatever the
//! connection just did. A reservation and a resolution each paid that
//! round trip on top of their one statement, and the release of the
//! resolution's connection ran before the answer went out (strace of one
//! request through the gateway, docs/BENCHMARKS.md). So the store keeps
//! the connections its record operations used, checked out of the pool,
//! and lends them again:
//!
//! * only a connection whose statement **completed** is kept: the driver
//!   read the server's answer to the end, so the connection is idle and
//!   in no transaction. One whose operation failed or was cancelled goes
//!   back to the pool, which tests it as before;
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
//! With `ping_after_idle` zero (a test before every operation) nothing is
//! kept.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

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
    /// Declared first: dropped (back to the pool) before the turn ends.
    conn: PoolConnection<Postgres>,
    home: Conns,
    _turn: OwnedSemaphorePermit,
}

impl Conns {
    /// Keeps connections of `pool` between operations; one kept for
    /// `test_after` or longer is tested before it is lent (`None`: never
    /// tested; zero: nothing is kept).
    pub(crate) fn new(pool: PgPool, test_after: Option<Duration>) -> Self {
        let keep = test_after.map_or(KEEP, |after| after.min(KEEP));
        let turns = pool.options().get_max_connections() as usize;
        Self {
            inner: Arc::new(Inner {
                turns: Arc::new(Semaphore::new(turns.max(1))),
                pool,
                state: Mutex::default(),
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
        let wait = self.inner.pool.options().get_acquire_timeout();
        let turn = Arc::clone(&self.inner.turns).acquire_owned();
        let turn = match tokio::time::timeout(wait, turn).await {
            Ok(Ok(turn)) => turn,
            Ok(Err(_closed)) => return Err(sqlx::Error::PoolClosed),
            Err(_elapsed) => return Err(sqlx::Error::PoolTimedOut),
        };
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
            return Ok(self.lent(conn, turn));
        }
        let conn = self.inner.pool.acquire().await?;
        Ok(self.lent(conn, turn))
    }

    fn lent(&self, conn: PoolConnection<Postgres>, turn: OwnedSemaphorePermit) -> Lent {
        Lent {
            conn,
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
    pub(crate) fn done(self) {
        let Self { conn, home, _turn } = self;
        home.keep(conn);
    }
}

impl Deref for Lent {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.conn
    }
}

impl DerefMut for Lent {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.conn
    }
}

//! Connections of a serving thread's own, for stores used from threads that
//! each run one single-threaded Tokio runtime (the gateway's serving
//! threads).
//!
//! A socket belongs to the event loop of the runtime that opened it: that
//! runtime's reactor hears when an answer arrives and wakes the task
//! waiting for it. A store connection opened on a shared runtime and used
//! from a serving thread therefore costs two thread hand-offs per round
//! trip: the shared runtime wakes up to hear the answer, then wakes the
//! serving thread (an `eventfd` write). A connection opened on the serving
//! thread itself keeps the whole round trip there.
//!
//! * [`dedicate_current_thread`] marks a thread that runs one
//!   single-threaded runtime for the rest of its life. Only such threads
//!   get connections of their own: a multi-threaded runtime moves tasks
//!   between threads, and a thread that drives two runtimes in turn could
//!   poll a connection from the one not running now.
//! * [`PerThread`] holds a store's connections, one per dedicated thread,
//!   keyed by the runtime that opened it. The store owns it, so closing the
//!   store can close them all ([`PerThread::drain`]).
//! * [`PerThread::take`] lends the calling thread's connection. The first
//!   call on a thread finds none, starts opening one in the background on
//!   that thread's runtime, and returns `None`: the caller uses its shared
//!   connection meanwhile. An open that fails is tried again after
//!   [`RETRY_OPEN`].
//! * A lent connection comes back with [`Taken::keep`]. One dropped without
//!   it (its operation failed or was cancelled, so its state is unknown) is
//!   closed, and the thread opens a new one on its next call.
//! * A connection lives as long as its store and the runtime that drives
//!   it: a thread that runs one runtime after another opens a new one on
//!   each, and those of a runtime that is gone are dropped.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use tokio::runtime::{Handle, RuntimeFlavor};

/// How long after a failed open a thread opens again.
pub const RETRY_OPEN: Duration = Duration::from_secs(1);

thread_local! {
    /// Whether this thread runs one single-threaded runtime for good.
    static DEDICATED: Cell<bool> = const { Cell::new(false) };
    /// The token of the runtime this thread runs now (see `runtime`).
    static RUNTIME: RefCell<Weak<()>> = const { RefCell::new(Weak::new()) };
}

/// Declares that the calling thread runs one single-threaded Tokio runtime
/// for the rest of its life, as the gateway's serving threads do. Stores
/// called from it then open connections of this thread's own (in the
/// background, on first use) and keep each round trip on this thread,
/// instead of waking the runtime that opened their shared connections and
/// being woken back by it.
///
/// Call it on such a thread before it serves; elsewhere stores use their
/// shared connections. A thread that drives two runtimes in turn must not
/// call it: a connection belongs to the runtime that opened it.
pub fn dedicate_current_thread() {
    DEDICATED.set(true);
}

/// The token of the runtime the calling thread drives, when the thread is
/// dedicated and runs a single-threaded runtime; made on first use, and
/// held by a task on that runtime, so it dies with the runtime.
fn current_runtime() -> Option<(Handle, Weak<()>)> {
    if !DEDICATED.get() {
        return None;
    }
    let handle = Handle::try_current().ok()?;
    if handle.runtime_flavor() != RuntimeFlavor::CurrentThread {
        return None;
    }
    let token = RUNTIME.with_borrow_mut(|current| {
        if current.strong_count() == 0 {
            let token = Arc::new(());
            *current = Arc::downgrade(&token);
            handle.spawn(async move {
                let _held = token;
                std::future::pending::<()>().await;
            });
        }
        current.clone()
    });
    Some((handle, token))
}

/// A store's connections of type `C`, one per dedicated thread; see the
/// [module](self).
pub struct PerThread<C> {
    slots: Mutex<Vec<Slot<C>>>,
}

struct Slot<C> {
    /// Alive as long as the runtime the connection belongs to.
    runtime: Weak<()>,
    state: State<C>,
}

enum State<C> {
    /// Ready to lend; kept since then.
    Ready(C, Instant),
    /// Lent to an operation.
    Lent,
    Opening,
    Failed(Instant),
}

impl<C> std::fmt::Debug for PerThread<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerThread")
            .field("threads", &self.lock().len())
            .finish()
    }
}

impl<C> Default for PerThread<C> {
    fn default() -> Self {
        Self {
            slots: Mutex::new(Vec::new()),
        }
    }
}

impl<C: Send + 'static> PerThread<C> {
    /// The calling thread's connection, lent until [`Taken::keep`] or
    /// drop; `None` on a thread not [dedicated](dedicate_current_thread),
    /// and while this thread's connection is lent, opening, or failed to
    /// open less than [`RETRY_OPEN`] ago. When the thread has none (or its
    /// last one was dropped), starts `open` on this thread's runtime.
    pub fn take<F, Fut, E>(self: &Arc<Self>, open: F) -> Option<Taken<C>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<C, E>> + Send + 'static,
        E: std::fmt::Display,
    {
        let (handle, runtime) = current_runtime()?;
        let mut slots = self.lock();
        // Forget the connections of runtimes that are gone.
        slots.retain(|s| s.runtime.strong_count() > 0);
        let found = slots.iter_mut().find(|s| s.runtime.ptr_eq(&runtime));
        match found.map(|s| &mut s.state) {
            Some(state @ State::Ready(..)) => {
                let State::Ready(conn, since) = std::mem::replace(state, State::Lent) else {
                    unreachable!("matched as ready")
                };
                return Some(Taken {
                    conn: Some(conn),
                    since,
                    home: Arc::downgrade(self),
                    runtime,
                });
            }
            Some(State::Lent | State::Opening) => return None,
            Some(State::Failed(at)) if at.elapsed() < RETRY_OPEN => return None,
            Some(state) => *state = State::Opening,
            None => slots.push(Slot {
                runtime: runtime.clone(),
                state: State::Opening,
            }),
        }
        drop(slots);
        let opening = open();
        let home = Arc::downgrade(self);
        handle.spawn(async move {
            let opened = opening.await;
            let Some(home) = home.upgrade() else {
                return;
            };
            let state = match opened {
                Ok(conn) => State::Ready(conn, Instant::now()),
                Err(err) => {
                    tracing::debug!(%err, "opening this thread's store connection failed; the shared ones serve");
                    State::Failed(Instant::now())
                }
            };
            home.set(&runtime, state);
        });
        None
    }

    /// Takes out every connection not lent now (to close them with the
    /// store); those lent are dropped when their operations end.
    pub fn drain(&self) -> Vec<C> {
        let slots = std::mem::take(&mut *self.lock());
        slots
            .into_iter()
            .filter_map(|s| match s.state {
                State::Ready(conn, _) => Some(conn),
                State::Lent | State::Opening | State::Failed(_) => None,
            })
            .collect()
    }

    /// Sets the state of `runtime`'s slot, if it still has one.
    fn set(&self, runtime: &Weak<()>, state: State<C>) {
        if let Some(slot) = self.lock().iter_mut().find(|s| s.runtime.ptr_eq(runtime)) {
            slot.state = state;
        }
    }
}

impl<C> PerThread<C> {
    fn lock(&self) -> MutexGuard<'_, Vec<Slot<C>>> {
        // A panic while the slots were held cannot leave them half-changed
        // (each change is one assignment, push or retain).
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A thread's connection lent by [`PerThread::take`]. [`keep`](Self::keep)
/// gives it back for the next operation; dropped without it, it is closed
/// and the thread opens a new one.
pub struct Taken<C: Send + 'static> {
    conn: Option<C>,
    since: Instant,
    home: Weak<PerThread<C>>,
    runtime: Weak<()>,
}

impl<C: Send + 'static> Taken<C> {
    /// How long the connection was kept unused before it was lent.
    pub fn idle_for(&self) -> Duration {
        self.since.elapsed()
    }

    /// The operation completed, leaving the connection ready for the next
    /// one: gives it back to its thread.
    pub fn keep(mut self) {
        if let (Some(conn), Some(home)) = (self.conn.take(), self.home.upgrade()) {
            home.set(&self.runtime, State::Ready(conn, Instant::now()));
        }
    }
}

impl<C: Send + 'static> Drop for Taken<C> {
    fn drop(&mut self) {
        if self.conn.take().is_none() {
            return;
        }
        // Not kept: closed (dropped here), and the slot is emptied so the
        // thread's next call opens a new one.
        if let Some(home) = self.home.upgrade() {
            home.lock().retain(|s| !s.runtime.ptr_eq(&self.runtime));
        }
    }
}

impl<C: Send + 'static> Deref for Taken<C> {
    type Target = C;

    fn deref(&self) -> &C {
        self.conn.as_ref().expect("present until kept or dropped")
    }
}

impl<C: Send + 'static> DerefMut for Taken<C> {
    fn deref_mut(&mut self) -> &mut C {
        self.conn.as_mut().expect("present until kept or dropped")
    }
}

impl<C: Send + 'static> std::fmt::Debug for Taken<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Taken")
            .field("idle_for", &self.idle_for())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` on a new thread driving a single-threaded runtime,
    /// dedicated when `dedicated`.
    fn on_thread<T: Send + 'static>(
        dedicated: bool,
        f: impl AsyncFnOnce() -> T + Send + 'static,
    ) -> T {
        std::thread::spawn(move || {
            if dedicated {
                dedicate_current_thread();
            }
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime")
                .block_on(f())
        })
        .join()
        .expect("thread")
    }

    async fn settle() {
        for _ in 0..4 {
            tokio::task::yield_now().await;
        }
    }

    fn ok(n: u32) -> impl Future<Output = Result<u32, String>> + Send + 'static {
        std::future::ready(Ok(n))
    }

    #[test]
    fn a_dedicated_thread_opens_once_then_lends_its_own() {
        let slots = Arc::new(PerThread::<u32>::default());
        let s = Arc::clone(&slots);
        let (first, second, while_lent, after) = on_thread(true, async move || {
            let first = s.take(|| ok(7)).map(|t| *t);
            settle().await;
            let second = s.take(|| ok(8));
            let while_lent = s.take(|| ok(9)).map(|t| *t);
            let value = second.as_deref().copied();
            second.expect("ready").keep();
            let after = s.take(|| ok(10)).map(|t| *t);
            (first, value, while_lent, after)
        });
        assert_eq!(first, None, "the first call opens in the background");
        assert_eq!(second, Some(7));
        assert_eq!(while_lent, None, "one operation at a time");
        assert_eq!(after, Some(7), "kept, then lent again");
    }

    #[test]
    fn one_dropped_without_keep_is_replaced() {
        let slots = Arc::new(PerThread::<u32>::default());
        let s = Arc::clone(&slots);
        let (reopened, drained) = on_thread(true, async move || {
            let _ = s.take(|| ok(1));
            settle().await;
            drop(s.take(|| ok(2)).expect("ready"));
            assert!(s.take(|| ok(3)).is_none(), "opening a new one");
            settle().await;
            let taken = s.take(|| ok(4)).expect("reopened");
            let reopened = *taken;
            taken.keep();
            (reopened, s.drain())
        });
        assert_eq!(reopened, 3);
        assert_eq!(drained, vec![3], "the new one, kept, closes with the store");
    }

    #[test]
    fn a_failed_open_waits_before_the_next() {
        let slots = Arc::new(PerThread::<u32>::default());
        let s = Arc::clone(&slots);
        let again = on_thread(true, async move || {
            let _ = s.take(|| std::future::ready(Err::<u32, _>("refused")));
            settle().await;
            s.take(|| ok(5)).map(|t| *t)
        });
        assert_eq!(again, None, "no new open within RETRY_OPEN of a failure");
    }

    #[test]
    fn other_threads_get_nothing_and_open_nothing() {
        let slots = Arc::new(PerThread::<u32>::default());
        let s = Arc::clone(&slots);
        let lent = on_thread(false, async move || {
            let first = s.take(|| ok(1)).is_some();
            settle().await;
            first || s.take(|| ok(1)).is_some()
        });
        assert!(!lent);
        assert!(slots.drain().is_empty());
        let multi = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .expect("runtime");
        // The test's own thread, which ends with the test.
        dedicate_current_thread();
        assert!(multi.block_on(async { slots.take(|| ok(1)).is_none() }));
        assert!(
            slots.lock().is_empty(),
            "a multi-threaded runtime opens none"
        );
    }

    #[test]
    fn each_runtime_of_a_thread_has_its_own_and_a_gone_one_is_forgotten() {
        let slots = Arc::new(PerThread::<u32>::default());
        let s = Arc::clone(&slots);
        std::thread::spawn(move || {
            dedicate_current_thread();
            let run = |n: u32| {
                let s = Arc::clone(&s);
                tokio::runtime::Builder::new_current_thread()
                    .build()
                    .expect("runtime")
                    .block_on(async move {
                        let _ = s.take(move || ok(n));
                        settle().await;
                        let taken = s.take(move || ok(n + 100))?;
                        let value = *taken;
                        taken.keep();
                        Some(value)
                    })
            };
            assert_eq!(run(1), Some(1));
            assert_eq!(run(2), Some(2), "a new runtime opens its own");
            assert_eq!(s.lock().len(), 1, "the first runtime's slot was dropped");
        })
        .join()
        .expect("thread");
    }
}

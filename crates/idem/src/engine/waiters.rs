//! Callers that wait on a key another attempt of this engine holds, woken
//! when it decides.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::{IdempotencyKey, Scope};

/// The most callers that wait on one key under [`InFlight::Wait`](crate::InFlight::Wait); more
/// are answered "in progress" at once.
pub const MAX_WAITERS_PER_KEY: usize = 64;

/// The most times a caller under [`InFlight::Wait`](crate::InFlight::Wait) asks the store, from
/// its first look to its last, however long the wait.
pub const MAX_LOOKS: u32 = 8;

/// The first pause of a waiter that no decision here woke; each next one
/// is four times longer.
pub(super) const FIRST_LOOK: Duration = Duration::from_millis(25);

type WaitKey = (String, String, String);

/// Callers waiting for an attempt of this engine to decide, per key: the
/// key's notification and how many wait on it.
#[derive(Debug, Default)]
pub(super) struct Waiters {
    keys: std::sync::Mutex<std::collections::HashMap<WaitKey, (Arc<tokio::sync::Notify>, usize)>>,
    /// How many wait, on any key: a decision with nobody waiting (nearly
    /// all of them) takes no lock.
    waiting: std::sync::atomic::AtomicUsize,
}

fn wait_key(scope: &Scope, key: &IdempotencyKey) -> WaitKey {
    (
        scope.tenant().to_owned(),
        scope.operation().to_owned(),
        key.as_str().to_owned(),
    )
}

impl Waiters {
    fn lock(
        &self,
    ) -> std::sync::MutexGuard<
        '_,
        std::collections::HashMap<WaitKey, (Arc<tokio::sync::Notify>, usize)>,
    > {
        self.keys.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Joins the waiters of `key`, unless there are too many.
    pub(super) fn join(self: &Arc<Self>, scope: &Scope, key: &IdempotencyKey) -> Option<Waiter> {
        let id = wait_key(scope, key);
        let mut keys = self.lock();
        let (notify, count) = keys.entry(id.clone()).or_default();
        if *count >= MAX_WAITERS_PER_KEY {
            drop(keys);
            tracing::debug!(tenant = scope.tenant(), operation = scope.operation(), %key, "too many callers wait on this key; answering in progress");
            return None;
        }
        *count += 1;
        self.waiting.fetch_add(1, Ordering::SeqCst);
        Some(Waiter {
            notify: Arc::clone(notify),
            waiters: Arc::clone(self),
            id,
        })
    }

    /// An attempt on `key` decided: its waiters look again.
    pub(super) fn wake(&self, scope: &Scope, key: &IdempotencyKey) {
        // A waiter joins before it looks at the store, and the decision
        // was made there before this: one that joins after this load
        // sees the decision.
        if self.waiting.load(Ordering::SeqCst) == 0 {
            return;
        }
        let keys = self.lock();
        if let Some((notify, _)) = keys.get(&wait_key(scope, key)) {
            notify.notify_waiters();
        }
    }
}

/// One caller's place among the waiters of a key; leaving drops the key's
/// entry with its last waiter.
pub(super) struct Waiter {
    pub(super) notify: Arc<tokio::sync::Notify>,
    waiters: Arc<Waiters>,
    id: WaitKey,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.waiters.waiting.fetch_sub(1, Ordering::SeqCst);
        let mut keys = self.waiters.lock();
        if let Some((_, count)) = keys.get_mut(&self.id) {
            *count -= 1;
            if *count == 0 {
                keys.remove(&self.id);
            }
        }
    }
}

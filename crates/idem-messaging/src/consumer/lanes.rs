//! One lane per aggregate: its messages one at a time, in order, while
//! other aggregates' run beside them.

use super::message::Message;
use std::sync::Arc;

/// Frees a lane whose task ended without emptying it (its handler
/// panicked): what waited there is dropped unsettled, as the panicking
/// delivery is, and the broker delivers it again.
pub(super) struct LaneGuard<D> {
    pub(super) lanes: Arc<std::sync::Mutex<Lanes<D>>>,
    pub(super) lane: Lane,
}

impl<D> Drop for LaneGuard<D> {
    fn drop(&mut self) {
        if std::thread::panicking()
            && let Ok(mut lanes) = self.lanes.lock()
            && let Some(dropped) = lanes.busy.remove(&self.lane)
        {
            tracing::error!(reason = "consumer_task_failed", aggregate = %self.lane.1, waiting = dropped.len(), "a handler panicked; the deliveries waiting behind it are dropped unsettled and come again");
        }
    }
}

/// With ordering on, how many deliveries per unit of concurrency may be
/// held (handled, or waiting behind their aggregate's): a Kafka partition
/// or a stream hands over runs of one aggregate, and without a look-ahead
/// the slots would fill with one aggregate's waiting events.
pub(super) const LOOK_AHEAD: usize = 4;

/// An aggregate: its type and id.
pub(super) type Lane = (String, String);

/// One aggregate's deliveries run one after another, in the order the
/// source gave them, while other aggregates' run beside them. Brokers
/// deliver an aggregate's events in order (a Kafka partition holds long
/// runs of one key); handled at once, a later event would find its
/// predecessor uncommitted and come back after `gap_delay` (a gap), so
/// an in-order stream of one aggregate would move at one event per gap
/// delay. A waiting delivery keeps its place among the held ones (at most
/// [`LOOK_AHEAD`] × `concurrency`), not a running slot.
pub(super) struct Lanes<D> {
    /// The aggregates with a delivery in hand, and what waits behind it.
    pub(super) busy: std::collections::HashMap<Lane, std::collections::VecDeque<Waiting<D>>>,
}

/// A delivery waiting for its lane, with its slot.
pub(super) type Waiting<D> = (D, tokio::sync::OwnedSemaphorePermit);

impl<D> Default for Lanes<D> {
    fn default() -> Self {
        Self {
            busy: std::collections::HashMap::new(),
        }
    }
}

impl<D> Lanes<D> {
    /// The lane of `msg`: its ordering headers' aggregate (none without
    /// them, or with broken ones, which the handling reports).
    pub(super) fn of(msg: &Message) -> Option<Lane> {
        msg.aggregate()
            .ok()
            .flatten()
            .map(|(kind, id, _)| (kind.to_owned(), id.to_owned()))
    }

    /// What to start now: `delivery` itself, unless its lane is busy (it
    /// then waits its turn).
    pub(super) fn admit(
        &mut self,
        lane: Option<Lane>,
        delivery: D,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> Option<Waiting<D>> {
        let Some(lane) = lane else {
            return Some((delivery, permit));
        };
        match self.busy.entry(lane) {
            std::collections::hash_map::Entry::Occupied(mut queue) => {
                queue.get_mut().push_back((delivery, permit));
                None
            }
            std::collections::hash_map::Entry::Vacant(free) => {
                free.insert(std::collections::VecDeque::new());
                Some((delivery, permit))
            }
        }
    }

    /// The next delivery of `lane`, whose last one is done; the lane is
    /// free when none waits.
    pub(super) fn release(&mut self, lane: &Lane) -> Option<Waiting<D>> {
        let queue = self.busy.get_mut(lane)?;
        let next = queue.pop_front();
        if next.is_none() {
            self.busy.remove(lane);
        }
        next
    }
}

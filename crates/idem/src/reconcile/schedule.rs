//! When a held record is asked about, when asking stops, and how it was
//! left.

use std::time::Duration;

/// When and for how long a [`Reconciliation`](super::Reconciliation) asks about a held record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Schedule {
    /// The first lookup comes this long after the record is held; each
    /// lookup that settles nothing doubles the pause, up to
    /// [`max_pause`](Self::max_pause). Default 1 s.
    pub first: Duration,
    /// The longest pause between two lookups. Default 60 s.
    pub max_pause: Duration,
    /// "It never happened" is believed only once the record has been
    /// quiet this long (since it was marked unknown or last renewed):
    /// long enough that no request of the abandoned attempt can still be
    /// on its way to taking effect. Until then the record stays held and
    /// is asked about again. Default 30 s.
    pub settle: Duration,
    /// How long to keep asking; then the record is left held for an
    /// operator (and counts as stuck). Default 1 h.
    pub give_up: Duration,
}

impl Default for Schedule {
    fn default() -> Self {
        Self {
            first: Duration::from_secs(1),
            max_pause: Duration::from_secs(60),
            settle: Duration::from_secs(30),
            give_up: Duration::from_secs(3600),
        }
    }
}

impl Schedule {
    /// Sets the delay before the first lookup.
    pub fn with_first(mut self, first: Duration) -> Self {
        self.first = first;
        self
    }

    /// Sets the longest pause between lookups.
    pub fn with_max_pause(mut self, max_pause: Duration) -> Self {
        self.max_pause = max_pause;
        self
    }

    /// Sets how long a record must be quiet before "never happened" is
    /// believed.
    pub fn with_settle(mut self, settle: Duration) -> Self {
        self.settle = settle;
        self
    }

    /// Sets how long to keep asking.
    pub fn with_give_up(mut self, give_up: Duration) -> Self {
        self.give_up = give_up;
        self
    }
}

/// How a [`Reconciliation`](super::Reconciliation) left a record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Settled {
    /// Recorded with the answer the reconciler found (a retry replays it).
    Completed,
    /// Released: the work never happened, a retry runs it.
    Released,
    /// Asked for [`Schedule::give_up`] without an answer: left held for an
    /// operator.
    GaveUp,
}

impl Settled {
    /// The metric label and log value.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::Released => "released",
            Self::GaveUp => "gave_up",
        }
    }
}

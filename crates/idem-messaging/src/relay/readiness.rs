//! Whether a relay can do its work now, as `/readyz` reports it.

use std::sync::Mutex;

/// Why a relay cannot do its work right now: which side failed, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum NotReady {
    /// No round has run yet.
    Starting,
    /// The outbox's database failed (the error).
    Database(String),
    /// The broker is unreachable or refused (the error).
    Broker(String),
}

impl std::fmt::Display for NotReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Starting => f.write_str("starting: no round has run yet"),
            Self::Database(why) => write!(f, "the database is unreachable or failing: {why}"),
            Self::Broker(why) => write!(f, "the broker is unreachable: {why}"),
        }
    }
}

/// What `/readyz` says while the broker's client has no connection.
pub(super) const BROKER_NOT_CONNECTED: &str = "not connected; the client keeps trying to reconnect";

/// A relay's readiness, shared with its `/readyz`: ready after a round
/// that reached both the database and the broker, and while the broker's
/// client is connected now, else why not.
///
/// The client's link is read when asked, not only after a round: a round
/// waiting on a lost broker can take the client's whole delivery time-out
/// to fail, and `/readyz` must not say ready meanwhile.
pub struct Readiness {
    /// What the last round found (`None`: both sides answered).
    last: Mutex<Option<NotReady>>,
    /// Whether the broker's client is connected now.
    connected: Box<dyn Fn() -> bool + Send + Sync>,
}

impl std::fmt::Debug for Readiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Readiness")
            .field("last", &self.last)
            .field("connected", &(self.connected)())
            .finish()
    }
}

impl Readiness {
    /// Not ready until a round has run; `connected` reads the link.
    pub(super) fn new(connected: impl Fn() -> bool + Send + Sync + 'static) -> Self {
        Self {
            last: Mutex::new(Some(NotReady::Starting)),
            connected: Box::new(connected),
        }
    }

    /// `Ok` when ready, else which side failed.
    pub fn check(&self) -> Result<(), NotReady> {
        match &*self.last.lock().unwrap_or_else(|p| p.into_inner()) {
            None if !(self.connected)() => Err(NotReady::Broker(BROKER_NOT_CONNECTED.to_owned())),
            None => Ok(()),
            Some(why) => Err(why.clone()),
        }
    }

    pub(super) fn set(&self, state: Option<NotReady>) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = state;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn readiness_reads_the_link_when_asked() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let up = Arc::new(AtomicBool::new(true));
        let link = Arc::clone(&up);
        let ready = Readiness::new(move || link.load(Ordering::Relaxed));
        assert_eq!(ready.check(), Err(NotReady::Starting));
        ready.set(None);
        assert_eq!(ready.check(), Ok(()));
        // Lost between rounds: not ready at once, without a round.
        up.store(false, Ordering::Relaxed);
        assert_eq!(
            ready.check(),
            Err(NotReady::Broker(BROKER_NOT_CONNECTED.to_owned()))
        );
        up.store(true, Ordering::Relaxed);
        assert_eq!(ready.check(), Ok(()));
        // What a round found stays until the next round, link or not.
        ready.set(Some(NotReady::Database("gone".to_owned())));
        assert_eq!(ready.check(), Err(NotReady::Database("gone".to_owned())));
    }
}

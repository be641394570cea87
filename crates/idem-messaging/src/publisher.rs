//! Where the relay publishes: a broker that acknowledges each message and
//! drops a re-published id inside its de-duplication window.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;

/// One message on its way to the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    /// `<prefix>.<aggregate_type>.<message_type>`.
    pub subject: String,
    /// The de-duplication id (the outbox row id).
    pub id: String,
    /// The JSON payload.
    pub payload: Bytes,
    /// Headers: the row's own, plus `Idem-Aggregate-Id` and `Idem-Sequence`.
    pub headers: Vec<(String, String)>,
}

/// What the broker said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    /// The broker had this id already (a re-publish it dropped).
    pub duplicate: bool,
}

/// Why a publish failed. Every failure leaves the row pending.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PublishError {
    /// What happened, in one line.
    pub message: String,
    /// The broker could not be reached or did not answer: nothing is wrong
    /// with the message, so the attempt does not count towards `dead`;
    /// the relay waits for the broker.
    pub broker_down: bool,
}

impl PublishError {
    /// The broker is unreachable or did not answer in time.
    pub fn broker_down(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            broker_down: true,
        }
    }

    /// The broker answered and refused this message (no stream for its
    /// subject, too large…): the attempt counts.
    pub fn refused(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            broker_down: false,
        }
    }
}

/// A broker with publish acknowledgements and id-based de-duplication.
pub trait Publisher: Send + Sync + 'static {
    /// Publishes and waits for the broker's acknowledgement.
    fn publish(
        &self,
        msg: &Outgoing,
    ) -> impl Future<Output = Result<Published, PublishError>> + Send;

    /// How long the broker remembers ids for de-duplication, if it can say.
    fn duplicate_window(
        &self,
    ) -> impl Future<Output = Result<Option<Duration>, PublishError>> + Send;

    /// Whether the broker is reachable now (readiness).
    fn is_connected(&self) -> bool;
}

/// A shared publisher publishes like the one it shares.
impl<P: Publisher> Publisher for std::sync::Arc<P> {
    fn publish(
        &self,
        msg: &Outgoing,
    ) -> impl Future<Output = Result<Published, PublishError>> + Send {
        (**self).publish(msg)
    }

    fn duplicate_window(
        &self,
    ) -> impl Future<Output = Result<Option<Duration>, PublishError>> + Send {
        (**self).duplicate_window()
    }

    fn is_connected(&self) -> bool {
        (**self).is_connected()
    }
}

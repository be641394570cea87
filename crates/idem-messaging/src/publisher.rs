//! Where the relay publishes: a broker that acknowledges each message and
//! drops a re-published id inside its de-duplication window.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use idem::store::BoxError;

use crate::cause::caused;

/// One message on its way to the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    /// `<prefix>.<aggregate_type>.<message_type>`.
    pub subject: String,
    /// The de-duplication id (the outbox row's event id).
    pub id: String,
    /// The JSON payload.
    pub payload: Bytes,
    /// Headers: the row's own (its W3C `traceparent` and `tracestate`
    /// among them, the relay's publish span's when traces are exported),
    /// plus `Idem-Aggregate-Type`, `Idem-Aggregate-Id` and `Idem-Sequence`.
    pub headers: Vec<(String, String)>,
}

/// What the broker said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    /// The broker had this id already (a re-publish it dropped).
    pub duplicate: bool,
}

/// Why a publish failed. Every failure leaves the row pending.
///
/// Each kind holds what went wrong: a message, or a message and the
/// broker client's error behind it (made with the `*_with` constructors),
/// which stays reachable as the error's [`source`](std::error::Error::source).
/// It shows as `message` or `message: cause`; the relay stores that text
/// as the row's `last_error`.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The broker could not be reached or did not answer: nothing is wrong
    /// with the message, so the attempt does not count towards `dead`;
    /// the relay waits for the broker.
    #[error(transparent)]
    BrokerDown(BoxError),
    /// The broker answered and refused this message (no stream for its
    /// subject, too large…): the attempt counts.
    #[error(transparent)]
    Refused(BoxError),
}

impl PublishError {
    /// The broker is unreachable or did not answer in time.
    pub fn broker_down(message: impl Into<String>) -> Self {
        Self::BrokerDown(message.into().into())
    }

    /// The broker answered and refused this message (no stream for its
    /// subject, too large…): the attempt counts.
    pub fn refused(message: impl Into<String>) -> Self {
        Self::Refused(message.into().into())
    }

    /// [`broker_down`](Self::broker_down) because of `source` (the client's
    /// error): shows as `message: source`.
    pub fn broker_down_with(message: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self::BrokerDown(caused(message, source))
    }

    /// [`refused`](Self::refused) because of `source` (the broker's
    /// answer): shows as `message: source`.
    pub fn refused_with(message: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self::Refused(caused(message, source))
    }

    /// Whether the broker was unreachable (rather than refusing the
    /// message).
    pub fn is_broker_down(&self) -> bool {
        matches!(self, Self::BrokerDown(_))
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

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn errors_read_as_one_line_and_keep_their_cause() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        let err = PublishError::broker_down_with("cannot connect to NATS at nats://h:4222", io);
        assert!(err.is_broker_down());
        assert_eq!(
            err.to_string(),
            "cannot connect to NATS at nats://h:4222: refused"
        );
        let cause = err.source().expect("the cause is kept");
        assert!(
            cause.downcast_ref::<std::io::Error>().is_some(),
            "{cause:?}"
        );

        let err = PublishError::refused_with("stream IDEM", "no such stream");
        assert!(!err.is_broker_down());
        assert_eq!(err.to_string(), "stream IDEM: no such stream");

        let err = PublishError::broker_down("NATS is not connected");
        assert!(matches!(err, PublishError::BrokerDown(_)));
        assert_eq!(err.to_string(), "NATS is not connected");
        assert!(err.source().is_none());
        let err = PublishError::refused("no queue is bound");
        assert!(matches!(err, PublishError::Refused(_)));
        assert_eq!(err.to_string(), "no queue is bound");
    }
}

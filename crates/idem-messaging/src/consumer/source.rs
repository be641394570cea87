//! What a broker gives the runner: a source of deliveries, and how each
//! is settled.

use super::message::Message;
use crate::cause::caused;
use idem::store::BoxError;
use std::future::Future;
use std::time::Duration;

/// Why settling a delivery with the broker failed (the broker will
/// redeliver the message after its acknowledgement timeout), or why a
/// [`Source`] could not deliver. It shows as `message` or
/// `message: cause`; the broker client's error stays its
/// [`source`](std::error::Error::source).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct SettleError(BoxError);

impl SettleError {
    /// A failure described by `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Self(message.into().into())
    }

    /// A failure described by `message`, because of `source` (the broker
    /// client's error): shows as `message: source`.
    pub fn with_source(message: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self(caused(message, source))
    }

    /// `err` as it is (same text, same source), e.g. a failed publish to
    /// a retry or dead-letter queue.
    #[cfg_attr(not(feature = "rabbitmq"), allow(dead_code))]
    pub(crate) fn from_error(err: impl Into<BoxError>) -> Self {
        Self(err.into())
    }
}

/// One delivery, and how to settle it with its broker.
pub trait Delivery: Send + 'static {
    /// The message.
    fn message(&self) -> &Message;

    /// Done with it: the broker may forget it.
    fn ack(self) -> impl Future<Output = Result<(), SettleError>> + Send;

    /// Deliver it again after `delay`.
    fn retry(self, delay: Duration) -> impl Future<Output = Result<(), SettleError>> + Send;

    /// Move it to the dead-letter subject or queue, with `reason`, and
    /// stop delivering it.
    fn park(self, reason: &str) -> impl Future<Output = Result<(), SettleError>> + Send;
}

/// Where deliveries come from: a JetStream pull consumer
/// (`JetStreamSource`, feature `nats`), a RabbitMQ queue (`RabbitSource`,
/// feature `rabbitmq`), or your own.
pub trait Source: Send + 'static {
    /// The source's deliveries.
    type Delivery: Delivery;

    /// The next delivery; `None` when the source is closed for good. A
    /// transient failure (the broker restarting) is an `Err`: the runner
    /// logs it, waits a little and asks again.
    fn next(&mut self) -> impl Future<Output = Option<Result<Self::Delivery, SettleError>>> + Send;

    /// Lets go of the broker once the runner is done, so messages it
    /// received but did not start go back to other consumers at once.
    fn close(self) -> impl Future<Output = ()> + Send
    where
        Self: Sized,
    {
        async {}
    }
}

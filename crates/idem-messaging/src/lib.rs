//! # idem-messaging — the outbox relay and the consumer runner
//!
//! Events written with `idem_postgres::outbox::Outbox::enqueue` in the
//! same transaction as the change they announce are published by a
//! [`Relay`] to a broker that acknowledges each message (a [`Publisher`]:
//! `NatsPublisher` for NATS JetStream, `RabbitPublisher` for RabbitMQ): in
//! order per aggregate, with several relays running at once. See [`relay`]
//! for how; the relay schedules and publishes, and every statement it runs
//! on the outbox is `idem_postgres::outbox`'s.
//!
//! On the receiving side, a [`Consumer`] takes deliveries from a
//! [`Source`] (`JetStreamSource`, `RabbitSource`) and handles each one
//! once: inbox check, ordering guard and handler in one PostgreSQL
//! transaction, acknowledged after the commit. See [`consumer`].
//!
//! ## Features
//!
//! The broker adapters are opt-in; none is on by default:
//!
//! * `nats`: NATS JetStream (`NatsPublisher`, `JetStreamSource`);
//! * `rabbitmq`: RabbitMQ (`RabbitPublisher`, `RabbitSource`);
//! * `kafka`: Kafka (`KafkaPublisher`, `KafkaSource`), through librdkafka
//!   built from its bundled source;
//! * `otel`: traces continue across the broker through OpenTelemetry (see
//!   [`trace`]).
//!
//! ## Traces across the broker
//!
//! An outbox row carries the W3C trace context of the transaction that
//! wrote it (`traceparent`, `tracestate`; see
//! `idem_postgres::trace_context`). The relay publishes such a row inside
//! an `idem.publish` span, child of the row's context, and sends that
//! span's context as the message's `traceparent`; the consumer runner
//! handles each message inside an `idem.consume` span, child of the
//! message's `traceparent`. What the handler enqueues in its outbox
//! carries the handler's context in turn, so one trace reads: request →
//! outbox row → relay publish → handler → its outbox row… The spans are
//! of the `tracing` target [`trace::TARGET`].

mod cause;
pub mod consumer;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
pub mod publisher;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
pub mod relay;

/// The spans of the relay and the consumer runner, and the trace context
/// they continue.
///
/// Both are `tracing` spans of the target [`TARGET`](trace::TARGET) (the `idem` binary
/// exports that target's spans over OTLP and never logs them):
///
/// * `idem.publish` (kind producer): one publish of an outbox row that
///   carries a trace context, child of that context; fields
///   `messaging.destination.name` (the subject), `messaging.message.id`,
///   `idem.outbox.id`, `idem.sequence`, `trace_id`;
/// * `idem.consume` (kind consumer): one delivery handled by the runner,
///   child of the message's `traceparent` when it has a valid one; fields
///   `messaging.consumer.group.name` (the consumer), `messaging.message.id`,
///   `messaging.destination.name`, `idem.outcome` (an
///   [`Outcome`]), `trace_id`.
///
/// Without the `otel` feature the spans are plain `tracing` spans whose
/// `trace_id` field names the trace; with it, and a `tracing-opentelemetry`
/// 0.34 layer in the subscriber, they are OpenTelemetry spans in that
/// trace, and the relay sends its own span's context on.
pub mod trace {
    pub use idem_postgres::trace_context::TraceContext;

    /// The `tracing` target of the relay's and the runner's spans: the
    /// same as the gateway's request spans (`idem_http::trace::TARGET`),
    /// so one exporter filter takes them all.
    pub const TARGET: &str = "idem_trace";
}

pub use consumer::{
    Consumer, ConsumerOptions, ConsumerStats, Delivery, Handler, HandlerError, Message, Outcome,
    SettleError, Source,
};
#[cfg(feature = "kafka")]
pub use kafka::{
    KafkaDelivery, KafkaPublisher, KafkaPublisherOptions, KafkaSource, KafkaSourceOptions,
    KafkaTopics, TopicSpec,
};
#[cfg(feature = "nats")]
pub use nats::{JetStreamDelivery, JetStreamSource, JetStreamSourceOptions, NatsPublisher};
pub use publisher::{Outgoing, PublishError, Published, Publisher};
#[cfg(feature = "rabbitmq")]
pub use rabbitmq::{RabbitDelivery, RabbitPublisher, RabbitSource, RabbitSourceOptions};
pub use relay::{NotReady, OnDead, Readiness, Relay, RelayError, RelayOptions, RelayStats};

use std::time::Duration;

/// Header names the relay writes and the runner reads.
pub mod headers {
    /// The aggregate type of an outbox event.
    pub const AGGREGATE_TYPE: &str = "Idem-Aggregate-Type";
    /// The aggregate id of an outbox event.
    pub const AGGREGATE_ID: &str = "Idem-Aggregate-Id";
    /// The event's number in its aggregate's sequence (1, 2, 3…): the
    /// version the ordering guard checks.
    pub const SEQUENCE: &str = "Idem-Sequence";
    /// On a parked message: why it was parked.
    pub const PARKED_REASON: &str = "Idem-Parked-Reason";
    /// On a parked or delayed message: the subject or routing key it came
    /// on.
    pub const ORIGINAL_SUBJECT: &str = "Idem-Original-Subject";
    /// On a RabbitMQ message sent back through the retry queue: the
    /// deliveries so far.
    pub const DELIVERIES: &str = "Idem-Deliveries";
    /// On a Kafka record: the message id (the outbox event id), which
    /// Kafka has no field for.
    pub const MESSAGE_ID: &str = "Idem-Message-Id";
    /// On a Kafka record: the event's type (`PaymentAuthorized`), the last
    /// part of the subject NATS and RabbitMQ carry it in.
    pub const MESSAGE_TYPE: &str = "Idem-Message-Type";
    /// The W3C `traceparent` of the trace the event belongs to (on a
    /// published message: the relay's publish span, when traces are
    /// exported, else the row's own).
    pub use idem_postgres::trace_context::TRACEPARENT;
    /// The W3C `tracestate` that goes with [`TRACEPARENT`].
    pub use idem_postgres::trace_context::TRACESTATE;
}

/// Exponential backoff from `base` (doubled per attempt, capped at `max`)
/// with up to 50 % jitter below it.
pub(crate) fn backoff(base: Duration, max: Duration, attempt: u32) -> Duration {
    let exp = base.saturating_mul(1u32 << attempt.min(20));
    let capped = exp.min(max);
    let jitter = (idem::OwnerToken::random().as_u128() % 1000) as u32;
    capped.mul_f64(0.5 + f64::from(jitter) / 2000.0)
}

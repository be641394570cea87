//! # idem-messaging — the outbox relay
//!
//! Events written with `idem_postgres::outbox::Outbox::enqueue` in the
//! same transaction as the change they announce are published by a
//! [`Relay`] to a broker that acknowledges and de-duplicates
//! ([`NatsPublisher`] for NATS JetStream): in order per aggregate, with
//! several relays running at once, each row reaching the stream once
//! within the broker's duplicate window. See [`relay`] for how.
//!
//! The consumer side (inbox, ordering guard) lives in `idem-postgres`
//! because it runs inside the consumer's own database transaction.

pub mod publisher;
pub mod relay;

pub use publisher::{NatsPublisher, Outgoing, PublishError, Published, Publisher};
pub use relay::{OnDead, Relay, RelayError, RelayOptions, RelayStats};

//! Kafka: the relay's [`KafkaPublisher`] and the runner's [`KafkaSource`]
//! (librdkafka, through `rdkafka`).
//!
//! ## Publishing
//!
//! Events go to one topic per aggregate type, `<prefix>.<aggregate_type>`
//! (or to one topic for everything, [`KafkaTopics::One`]), keyed by the
//! aggregate id: one aggregate's events share a partition and keep their
//! order there. The headers are the row's own, the relay's `Idem-*`
//! ordering headers, [`headers::MESSAGE_ID`] (the outbox event id) and
//! [`headers::MESSAGE_TYPE`]; the payload is the row's JSON.
//!
//! The producer is idempotent (`enable.idempotence`, `acks=all`, at most 5
//! requests in flight per connection, which idempotence keeps in order
//! across retries); the relay marks a row published only after the
//! broker's acknowledgement. Kafka has no id-based de-duplication across
//! producers: a row re-published after a relay crash (between the
//! acknowledgement and the mark) is a second record with the same
//! `Idem-Message-Id`, which the consumer's inbox drops.
//!
//! A send that times out, or that the broker answers with a producer id or
//! sequence it no longer knows (it restarted empty, or a link went silent
//! and librdkafka's epoch bump never completes), replaces the producer
//! with a new one: without that, an idempotent producer can wait for good
//! and every later send time out. Such a failure is the broker's, never
//! the row's: no attempt is spent.
//!
//! ## Consuming
//!
//! A [`KafkaSource`] is a member of a consumer group. Offsets are stored
//! only for messages the runner has settled (applied and committed,
//! acknowledged as duplicates, or parked), and only up to the first one
//! still in hand: a committed offset is never ahead of a message not yet
//! applied. librdkafka commits the stored offsets every
//! [`KafkaSourceOptions::commit_interval`] and when partitions are revoked;
//! a consumer that dies in between leaves its last messages uncommitted,
//! and their redelivery is an inbox duplicate.
//!
//! Kafka cannot redeliver one message later, so a retry is kept here: the
//! message comes back from [`Source::next`] after its delay, with its
//! delivery count raised, while the rest of the partition goes on (its
//! offset, and so every offset after it, stays uncommitted until it is
//! settled). After `max_deliveries` the runner parks it to
//! `<topic>.parked` with [`headers::PARKED_REASON`] and
//! [`headers::ORIGINAL_SUBJECT`] (the topic), and the partition's offset
//! moves past it. A rebalance that takes a partition away drops its
//! retries and its uncommitted messages: the new owner reads them again
//! from the committed offset, and the inbox catches what was applied.

use std::collections::{BTreeSet, BinaryHeap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::client::{ClientContext, DefaultClientContext};
use rdkafka::config::{ClientConfig, RDKafkaLogLevel};
use rdkafka::consumer::stream_consumer::StreamConsumer;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::statistics::Statistics;
use rdkafka::{Offset, TopicPartitionList};

use crate::consumer::{Delivery, Message, SettleError, Source};
use crate::headers;
use crate::publisher::{Outgoing, PublishError, Published, Publisher};

mod consume;
mod producer;
mod publish;

pub use consume::{KafkaDelivery, KafkaSource, KafkaSourceOptions};
pub use publish::{KafkaPublisher, KafkaPublisherOptions, KafkaTopics, TopicSpec};

/// The scheme of a Kafka broker list.
pub const SCHEME: &str = "kafka://";

/// How long an admin request (topic creation, configuration) may take.
const ADMIN_TIMEOUT: Duration = Duration::from_secs(5);

/// The `bootstrap.servers` of a `kafka://host:port[,host:port…]` URL.
///
/// Refused: another scheme, an empty list, an entry without a port, user
/// information (SASL is not built in) and query strings (TLS is not built
/// in): each would otherwise be ignored or misread by the client.
pub fn bootstrap_servers(url: &str) -> Result<String, String> {
    let Some(list) = url.strip_prefix(SCHEME) else {
        return Err(format!("{url}: a Kafka broker list starts with {SCHEME}"));
    };
    let list = list.trim_end_matches('/');
    if list.contains(['?', '#']) {
        return Err(format!(
            "{SCHEME}{list}: options in the URL are not supported (this build speaks plaintext Kafka, without TLS or SASL)"
        ));
    }
    if list.contains('@') {
        return Err(format!(
            "{}: credentials in the URL are not supported (this build has no SASL)",
            idem::store::redact_broker_url(url)
        ));
    }
    let mut servers = Vec::new();
    for entry in list.split(',') {
        let entry = entry.trim();
        let port = entry
            .rsplit_once(':')
            .map(|(host, port)| (host, port.parse::<u16>()));
        match port {
            Some((host, Ok(port))) if !host.is_empty() && port != 0 && !entry.contains('/') => {
                servers.push(entry.to_owned());
            }
            _ => {
                return Err(format!(
                    "{url}: {entry:?} is not host:port (write {SCHEME}host:port[,host:port…])"
                ));
            }
        }
    }
    Ok(servers.join(","))
}

/// Whether a librdkafka error says the broker could not be reached or did
/// not answer (rather than refusing the message).
fn unreachable(code: RDKafkaErrorCode) -> bool {
    use RDKafkaErrorCode as C;
    matches!(
        code,
        C::MessageTimedOut
            | C::AllBrokersDown
            | C::BrokerTransportFailure
            | C::QueueFull
            | C::RequestTimedOut
            | C::OperationTimedOut
            | C::NotEnoughReplicas
            | C::NotEnoughReplicasAfterAppend
            | C::LeaderNotAvailable
            | C::NotLeaderForPartition
            | C::NotCoordinator
            | C::CoordinatorNotAvailable
            | C::NetworkException
            | C::Resolve
    )
}

/// The client's events as tracing events, and the link's state: whether
/// some broker is up, for readiness.
#[derive(Debug, Clone)]
struct LinkContext {
    /// What the client is for, in its log lines (`relay`, `consumer`).
    role: &'static str,
    /// The broker list, for the log lines.
    servers: String,
    /// Set when every broker is down; cleared when one is up again
    /// (shared by the successive producers of one publisher).
    down: Arc<AtomicBool>,
}

impl LinkContext {
    fn new(role: &'static str, servers: &str, down: Arc<AtomicBool>) -> Self {
        Self {
            role,
            servers: servers.to_owned(),
            down,
        }
    }

    /// One line when the brokers become unreachable, one when they are back.
    fn set_down(&self, down: bool) {
        let servers = self.servers.as_str();
        if self.down.swap(down, Ordering::Relaxed) != down {
            if down {
                tracing::warn!(reason = "kafka_unreachable", role = self.role, %servers, "Kafka at {servers} is unreachable; the client keeps retrying");
            } else {
                tracing::info!(reason = "kafka_connected", role = self.role, %servers, "Kafka reachable again");
            }
        }
    }
}

impl ClientContext for LinkContext {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        let role = self.role;
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => {
                tracing::error!(target: "librdkafka", role, facility, "{message}");
            }
            RDKafkaLogLevel::Warning => {
                tracing::warn!(target: "librdkafka", role, facility, "{message}");
            }
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: "librdkafka", role, facility, "{message}");
            }
            RDKafkaLogLevel::Debug => {
                tracing::debug!(target: "librdkafka", role, facility, "{message}");
            }
        }
    }

    fn stats(&self, statistics: Statistics) {
        // Brokers learnt from metadata have a node id; the bootstrap
        // entries (-1) only until then.
        let up = statistics
            .brokers
            .values()
            .any(|b| b.nodeid >= 0 && b.state == "UP");
        if up {
            self.set_down(false);
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        if error.rdkafka_error_code() == Some(RDKafkaErrorCode::AllBrokersDown) {
            self.set_down(true);
        } else {
            let role = self.role;
            tracing::debug!(target: "librdkafka", role, %error, "{reason}");
        }
    }
}

/// The settings every idem client shares: the brokers, statistics once a
/// second (for readiness), and keep-alive on the sockets.
fn base_config(servers: &str, client_id: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", servers)
        .set("client.id", client_id)
        .set("statistics.interval.ms", "1000")
        .set("socket.keepalive.enable", "true")
        .set("reconnect.backoff.ms", "100")
        .set("reconnect.backoff.max.ms", "2000");
    config
}

/// Makes a client of type `T` from `config` with `context`.
fn client<T, C>(config: &ClientConfig, context: C, what: &str) -> Result<T, String>
where
    T: rdkafka::config::FromClientConfigAndContext<C>,
    C: ClientContext,
{
    config
        .create_with_context(context)
        .map_err(|e| format!("cannot create the Kafka {what}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broker_lists_are_read_strictly() {
        assert_eq!(
            bootstrap_servers("kafka://127.0.0.1:9092").as_deref(),
            Ok("127.0.0.1:9092")
        );
        assert_eq!(
            bootstrap_servers("kafka://a:9092, b:9093/").as_deref(),
            Ok("a:9092,b:9093")
        );
        for bad in [
            "nats://a:4222",
            "kafka://",
            "kafka://a",
            "kafka://a:0",
            "kafka://a:x",
            "kafka://a:9092,",
            "kafka://u:secret@a:9092",
            "kafka://a:9092?security.protocol=ssl",
            "kafka://a:9092/path",
        ] {
            let err = bootstrap_servers(bad).expect_err(bad);
            assert!(!err.contains("secret"), "{err}");
        }
    }
}

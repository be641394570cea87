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

/// The scheme of a Kafka broker list.
pub const SCHEME: &str = "kafka://";

/// How long the producer tries to deliver one message (librdkafka's
/// `message.timeout.ms`) before the publish fails as broker-down.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(10);

/// What fewer than 3 replicas risk, in the durability warnings.
const ONE_BROKER_LOST: &str =
    "one broker lost can lose acknowledged events (3 with min.insync.replicas=2 survive one)";

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

/// Why a producer is replaced by a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Renewal {
    /// librdkafka declared it unusable.
    Fatal,
    /// A send timed out, or the broker no longer knows its producer id or
    /// sequence: the idempotent producer then drains and asks the broker
    /// for a new epoch, and a broker that restarted empty or lacks
    /// KIP-360 can leave it waiting for good, every later send timing out.
    Stalled,
}

/// Whether a send that failed with `code` (the producer in a fatal state
/// or not) calls for a new producer. Replacing one costs a connection and
/// at worst a second copy of the rows that timed out, which the relay
/// re-publishes anyway and consumers drop by id; an aggregate's next row
/// is sent only after the previous one's acknowledgement, so the order
/// holds across the change.
fn renew_after(code: Option<RDKafkaErrorCode>, fatal: bool) -> Option<Renewal> {
    use RDKafkaErrorCode as C;
    if fatal || code == Some(C::Fatal) {
        return Some(Renewal::Fatal);
    }
    matches!(
        code?,
        C::MessageTimedOut
            | C::UnknownProducerId
            | C::OutOfOrderSequenceNumber
            | C::InvalidProducerEpoch
            | C::InvalidProducerIdMapping
            | C::Inconsistent
    )
    .then_some(Renewal::Stalled)
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

/// The idempotent producer both the relay and parking use.
fn producer_config(servers: &str, client_id: &str, linger: Duration) -> ClientConfig {
    let mut config = base_config(servers, client_id);
    config
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("max.in.flight.requests.per.connection", "5")
        .set(
            "message.timeout.ms",
            DELIVERY_TIMEOUT.as_millis().to_string(),
        )
        .set("linger.ms", linger.as_millis().to_string());
    config
}

/// An idempotent producer ([`producer_config`]) that replaces itself with
/// a new one when a send shows it stuck or broken ([`renew_after`]): the
/// relay's and the parking producer.
struct RenewingProducer {
    config: ClientConfig,
    /// The link's state, shared by every producer it makes.
    link: LinkContext,
    /// The producer in use and how many came before it.
    slot: RwLock<(u64, FutureProducer<LinkContext>)>,
}

/// A send that failed, and whether the producer was replaced after it.
struct SendFailure {
    err: KafkaError,
    renewed: bool,
}

impl RenewingProducer {
    fn new(config: ClientConfig, link: LinkContext) -> Result<Self, String> {
        let producer = client(&config, link.clone(), "producer")?;
        Ok(Self {
            config,
            link,
            slot: RwLock::new((0, producer)),
        })
    }

    /// The producer in use (for metadata requests).
    fn current(&self) -> (u64, FutureProducer<LinkContext>) {
        self.slot.read().expect("producer lock").clone()
    }

    /// Sends `record` and waits for its acknowledgement (at most the
    /// delivery time-out, queueing included: a full local queue is the
    /// broker not keeping up).
    async fn send<K, P>(&self, record: FutureRecord<'_, K, P>) -> Result<(), SendFailure>
    where
        K: rdkafka::message::ToBytes + ?Sized,
        P: rdkafka::message::ToBytes + ?Sized,
    {
        let (number, producer) = self.current();
        match producer.send(record, DELIVERY_TIMEOUT).await {
            Ok(_) => Ok(()),
            Err((err, _)) => {
                let why = renew_after(
                    err.rdkafka_error_code(),
                    producer.client().fatal_error().is_some(),
                );
                if let Some(why) = why {
                    self.replace(number, why);
                }
                Err(SendFailure {
                    err,
                    renewed: why.is_some(),
                })
            }
        }
    }

    /// A new producer in place of producer number `broken` (a new one
    /// starts with a new producer id, so no idempotence state of the old
    /// one is carried over).
    fn replace(&self, broken: u64, why: Renewal) {
        let mut slot = self.slot.write().expect("producer lock");
        if slot.0 != broken {
            return; // replaced already, after another send's failure
        }
        let role = self.link.role;
        match client(&self.config, self.link.clone(), "producer") {
            Ok(fresh) => {
                match why {
                    Renewal::Fatal => tracing::warn!(
                        reason = "kafka_producer_replaced",
                        role,
                        "the Kafka producer hit a fatal error; sending goes on with a new one"
                    ),
                    Renewal::Stalled => tracing::info!(
                        reason = "kafka_producer_replaced",
                        role,
                        "a Kafka send timed out or the broker forgot the producer; sending goes on with a new producer"
                    ),
                }
                *slot = (broken + 1, fresh);
            }
            Err(err) => tracing::error!(reason = "kafka_producer_replaced", role, %err),
        }
    }
}

/// Where the relay's events go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KafkaTopics {
    /// `<prefix>.<aggregate_type>`: the subject without its message type.
    PerAggregateType,
    /// Every event in this one topic.
    One(String),
}

impl KafkaTopics {
    /// The topic of `msg` and its message type, from its subject
    /// `<prefix>.<aggregate_type>.<message_type>`.
    fn of<'a>(&'a self, msg: &'a Outgoing) -> (&'a str, &'a str) {
        let (topic, message_type) = msg.subject.rsplit_once('.').unwrap_or((&msg.subject, ""));
        match self {
            Self::PerAggregateType => (topic, message_type),
            Self::One(one) => (one.as_str(), message_type),
        }
    }
}

/// Topics a [`KafkaPublisher`] creates when it first publishes to them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopicSpec {
    /// Partitions of a created topic.
    pub partitions: i32,
    /// Its replication factor.
    pub replication: i32,
}

/// How a [`KafkaPublisher`] publishes.
#[derive(Debug, Clone)]
pub struct KafkaPublisherOptions {
    /// Where events go.
    pub topics: KafkaTopics,
    /// Create a missing topic before the first publish to it (otherwise a
    /// missing topic is the broker's refusal, or its auto-creation).
    pub create: Option<TopicSpec>,
    /// How long the producer waits to batch messages (`linger.ms`).
    pub linger: Duration,
}

impl Default for KafkaPublisherOptions {
    /// A topic per aggregate type, none created, 1 ms linger.
    fn default() -> Self {
        Self {
            topics: KafkaTopics::PerAggregateType,
            create: None,
            linger: Duration::from_millis(1),
        }
    }
}

/// Kafka, through an idempotent producer; see the [module docs](self).
pub struct KafkaPublisher {
    servers: String,
    options: KafkaPublisherOptions,
    producer: RenewingProducer,
    admin: AdminClient<DefaultClientContext>,
    /// Topics known to exist (created or seen).
    known: Mutex<std::collections::HashSet<String>>,
}

impl std::fmt::Debug for KafkaPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaPublisher")
            .field("servers", &self.servers)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
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

impl KafkaPublisher {
    /// A publisher to the brokers of `url` (`kafka://host:port[,…]`).
    /// Nothing is sent yet: the client connects in the background.
    pub fn connect(url: &str, options: KafkaPublisherOptions) -> Result<Self, PublishError> {
        let servers = bootstrap_servers(url).map_err(PublishError::refused)?;
        let producer = RenewingProducer::new(
            producer_config(&servers, "idem-relay", options.linger),
            LinkContext::new("relay", &servers, Arc::new(AtomicBool::new(false))),
        )
        .map_err(PublishError::refused)?;
        let admin = client(
            &base_config(&servers, "idem-relay-admin"),
            DefaultClientContext,
            "admin client",
        )
        .map_err(PublishError::refused)?;
        Ok(Self {
            servers,
            options,
            producer,
            admin,
            known: Mutex::new(std::collections::HashSet::new()),
        })
    }

    /// Creates `topic` with `spec` unless it exists.
    pub async fn create_topic(&self, topic: &str, spec: TopicSpec) -> Result<(), PublishError> {
        let new = NewTopic::new(
            topic,
            spec.partitions,
            TopicReplication::Fixed(spec.replication),
        );
        let options = AdminOptions::new().operation_timeout(Some(ADMIN_TIMEOUT));
        let results = self
            .admin
            .create_topics([&new], &options)
            .await
            .map_err(|e| PublishError::broker_down_with(format!("create topic {topic}"), e))?;
        for result in results {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((_, code)) if unreachable(code) => {
                    return Err(PublishError::broker_down(format!(
                        "create topic {topic}: {code}"
                    )));
                }
                Err((_, code)) => {
                    return Err(PublishError::refused(format!(
                        "create topic {topic}: {code}"
                    )));
                }
            }
        }
        Ok(())
    }

    /// What the brokers' settings cannot promise for an acknowledged
    /// event, one line each: topics (those of this publisher that exist)
    /// with fewer than 3 replicas or `min.insync.replicas` below 2, and
    /// settings the broker did not say. Empty when nothing is amiss.
    pub async fn durability_warnings(&self) -> Result<Vec<String>, PublishError> {
        let metadata = {
            let (_, producer) = self.producer.current();
            tokio::task::spawn_blocking(move || {
                producer.client().fetch_metadata(None, ADMIN_TIMEOUT)
            })
            .await
            .map_err(|e| PublishError::broker_down(format!("metadata: {e}")))?
            .map_err(|e| PublishError::broker_down_with("metadata", e))?
        };
        let ours = |name: &str| match &self.options.topics {
            KafkaTopics::One(one) => name == one,
            KafkaTopics::PerAggregateType => !name.starts_with("__"),
        };
        let mut warnings = Vec::new();
        if let Some(spec) = self.options.create.filter(|s| s.replication < 3) {
            warnings.push(format!(
                "topics this relay creates get {} replica(s): {ONE_BROKER_LOST}",
                spec.replication
            ));
        }
        let mut topics = Vec::new();
        for topic in metadata.topics().iter().filter(|t| ours(t.name())) {
            let replicas = topic
                .partitions()
                .iter()
                .map(|p| p.replicas().len())
                .min()
                .unwrap_or(0);
            if replicas < 3 {
                warnings.push(format!(
                    "topic {} has {replicas} replica(s): {ONE_BROKER_LOST}",
                    topic.name()
                ));
            }
            topics.push(topic.name().to_owned());
        }
        let specifiers: Vec<ResourceSpecifier<'_>> =
            topics.iter().map(|t| ResourceSpecifier::Topic(t)).collect();
        if specifiers.is_empty() {
            return Ok(warnings);
        }
        let options = AdminOptions::new().request_timeout(Some(ADMIN_TIMEOUT));
        let described = self
            .admin
            .describe_configs(specifiers.iter(), &options)
            .await
            .map_err(|e| PublishError::broker_down_with("describe topic configs", e))?;
        for (topic, result) in topics.iter().zip(described) {
            let min_isr = result
                .ok()
                .and_then(|r| r.get("min.insync.replicas").and_then(|e| e.value.clone()));
            match min_isr.as_deref().map(str::parse::<u32>) {
                Some(Ok(n)) if n >= 2 => {}
                Some(Ok(n)) => warnings.push(format!(
                    "topic {topic} has min.insync.replicas={n}: acks=all is then met by {n} broker(s), and losing it loses acknowledged events"
                )),
                _ => warnings.push(format!(
                    "topic {topic}: the broker did not say its min.insync.replicas, so the durability of an acknowledgement is unknown"
                )),
            }
        }
        Ok(warnings)
    }

    async fn ensure_topic(&self, topic: &str) -> Result<(), PublishError> {
        let Some(spec) = self.options.create else {
            return Ok(());
        };
        if self.known.lock().expect("topics").contains(topic) {
            return Ok(());
        }
        self.create_topic(topic, spec).await?;
        self.known.lock().expect("topics").insert(topic.to_owned());
        Ok(())
    }
}

impl Publisher for KafkaPublisher {
    async fn publish(&self, msg: &Outgoing) -> Result<Published, PublishError> {
        let (topic, message_type) = self.options.topics.of(msg);
        let key = msg
            .headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(headers::AGGREGATE_ID))
            .map(|(_, v)| v.as_str())
            .ok_or_else(|| {
                PublishError::refused(format!(
                    "no {} header: Kafka needs the aggregate id as the message key",
                    headers::AGGREGATE_ID
                ))
            })?;
        self.ensure_topic(topic).await?;
        let mut list = OwnedHeaders::new_with_capacity(msg.headers.len() + 2)
            .insert(Header {
                key: headers::MESSAGE_ID,
                value: Some(msg.id.as_str()),
            })
            .insert(Header {
                key: headers::MESSAGE_TYPE,
                value: Some(message_type),
            });
        for (name, value) in &msg.headers {
            list = list.insert(Header {
                key: name.as_str(),
                value: Some(value.as_str()),
            });
        }
        let record = FutureRecord::to(topic)
            .key(key)
            .payload(&msg.payload[..])
            .headers(list);
        match self.producer.send(record).await {
            Ok(()) => {
                self.producer.link.set_down(false);
                Ok(Published { duplicate: false })
            }
            Err(SendFailure { err, renewed }) => {
                let code = err.rdkafka_error_code();
                let message = format!("publish to {topic}");
                if matches!(
                    code,
                    Some(
                        RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic
                    )
                ) {
                    // Deleted, or lost with a broker's storage: create it
                    // again before the next attempt.
                    self.known.lock().expect("topics").remove(topic);
                }
                match code {
                    Some(code) if unreachable(code) => {
                        if matches!(
                            code,
                            RDKafkaErrorCode::AllBrokersDown | RDKafkaErrorCode::MessageTimedOut
                        ) {
                            self.producer.link.set_down(true);
                        }
                        Err(PublishError::broker_down_with(message, err))
                    }
                    // Not the row's fault: the producer's state was lost.
                    _ if renewed => Err(PublishError::broker_down_with(message, err)),
                    _ => Err(PublishError::refused_with(message, err)),
                }
            }
        }
    }

    async fn duplicate_window(&self) -> Result<Option<Duration>, PublishError> {
        // Kafka de-duplicates only a producer's own retries, not a second
        // producer's re-publish: there is no window to check.
        Ok(None)
    }

    fn is_connected(&self) -> bool {
        !self.producer.link.down.load(Ordering::Relaxed)
    }
}

/// How a [`KafkaSource`] joins its group.
#[derive(Debug, Clone)]
pub struct KafkaSourceOptions {
    /// The topics to consume.
    pub topics: Vec<String>,
    /// The consumer group (several runner replicas with one group share
    /// the partitions).
    pub group: String,
    /// Where a message of topic `t` is parked: `t` + this suffix.
    pub parked_suffix: String,
    /// The group's session timeout: a consumer silent this long loses its
    /// partitions (`session.timeout.ms`).
    pub session_timeout: Duration,
    /// How often settled offsets are committed (`auto.commit.interval.ms`).
    pub commit_interval: Duration,
    /// Where a new group starts: `earliest` or `latest`.
    pub start: String,
}

impl KafkaSourceOptions {
    /// Group `group` on `topics`, parking to `<topic>.parked`; session
    /// timeout 10 s, offsets committed every second, a new group starting
    /// from the earliest message.
    pub fn new(group: &str, topics: &[&str]) -> Self {
        Self {
            topics: topics.iter().map(|t| (*t).to_owned()).collect(),
            group: group.to_owned(),
            parked_suffix: ".parked".to_owned(),
            session_timeout: Duration::from_secs(10),
            commit_interval: Duration::from_secs(1),
            start: "earliest".to_owned(),
        }
    }
}

/// One partition's messages in hand.
#[derive(Debug, Default)]
struct InHand {
    /// Changes each time the partition is assigned: settlements and
    /// retries of an earlier assignment are ignored.
    generation: u64,
    /// Offsets delivered and not yet settled.
    open: BTreeSet<i64>,
    /// One past the highest offset delivered.
    next: Option<i64>,
}

/// A message waiting for its retry.
#[derive(Debug)]
struct Due {
    at: Instant,
    order: u64,
    delivery: KafkaDelivery,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.order) == (other.at, other.order)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    /// Earliest first in a max-heap.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.at, other.order).cmp(&(self.at, self.order))
    }
}

/// What the source, its deliveries and the rebalance callback share.
#[derive(Debug, Default)]
struct Ledger {
    partitions: HashMap<(String, i32), InHand>,
    retries: BinaryHeap<Due>,
    generations: u64,
    retries_made: u64,
}

/// The consumer's context: keeps the ledger in step with rebalances.
struct GroupContext {
    link: LinkContext,
    ledger: Arc<Mutex<Ledger>>,
}

impl ClientContext for GroupContext {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        self.link.log(level, facility, message);
    }
    fn stats(&self, statistics: Statistics) {
        self.link.stats(statistics);
    }
    fn error(&self, error: KafkaError, reason: &str) {
        self.link.error(error, reason);
    }
}

impl ConsumerContext for GroupContext {
    fn pre_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            let mut ledger = self.ledger.lock().expect("ledger");
            for tp in list.elements() {
                ledger
                    .partitions
                    .remove(&(tp.topic().to_owned(), tp.partition()));
            }
            // Retries of partitions no longer ours are the new owner's.
            let Ledger {
                partitions,
                retries,
                ..
            } = &mut *ledger;
            retries.retain(|due| {
                partitions
                    .get(&due.delivery.partition_key())
                    .is_some_and(|p| p.generation == due.delivery.generation)
            });
            tracing::info!(
                reason = "kafka_partitions_revoked",
                partitions = list.count()
            );
        }
    }

    fn post_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(list) => {
                let mut ledger = self.ledger.lock().expect("ledger");
                for tp in list.elements() {
                    ledger.generations += 1;
                    let generation = ledger.generations;
                    ledger.partitions.insert(
                        (tp.topic().to_owned(), tp.partition()),
                        InHand {
                            generation,
                            ..InHand::default()
                        },
                    );
                }
                tracing::info!(
                    reason = "kafka_partitions_assigned",
                    partitions = list.count()
                );
            }
            Rebalance::Error(err) => {
                tracing::warn!(reason = "kafka_rebalance_failed", %err);
            }
            Rebalance::Revoke(_) => {}
        }
    }

    fn commit_callback(&self, result: rdkafka::error::KafkaResult<()>, _: &TopicPartitionList) {
        if let Err(err) = result {
            // Nothing is lost: the offsets stay stored and the next commit
            // carries them; a crash meanwhile means inbox duplicates.
            if err.rdkafka_error_code() != Some(RDKafkaErrorCode::NoOffset) {
                tracing::warn!(reason = "kafka_commit_failed", %err);
            }
        }
    }
}

/// A Kafka consumer-group member, as a [`Source`] for
/// [`crate::Consumer`]; see the [module docs](self).
pub struct KafkaSource {
    consumer: Arc<StreamConsumer<GroupContext>>,
    ledger: Arc<Mutex<Ledger>>,
    /// Wakes [`Source::next`] when a retry is scheduled.
    wake: Arc<tokio::sync::Notify>,
    parker: Arc<Parker>,
}

impl std::fmt::Debug for KafkaSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaSource").finish_non_exhaustive()
    }
}

/// Publishes parked messages.
struct Parker {
    producer: RenewingProducer,
    suffix: String,
}

impl KafkaSource {
    /// Joins the group described by `options` on the brokers of `url`
    /// (`kafka://host:port[,…]`) and subscribes to its topics.
    pub fn subscribe(url: &str, options: &KafkaSourceOptions) -> Result<Self, SettleError> {
        let servers = bootstrap_servers(url).map_err(SettleError::new)?;
        if options.topics.is_empty() {
            return Err(SettleError::new("a Kafka source needs at least one topic"));
        }
        let ledger = Arc::new(Mutex::new(Ledger::default()));
        let context = GroupContext {
            link: LinkContext::new("consumer", &servers, Arc::new(AtomicBool::new(false))),
            ledger: Arc::clone(&ledger),
        };
        let mut config = base_config(&servers, &format!("idem-consumer-{}", options.group));
        config
            .set("group.id", &options.group)
            .set("enable.auto.commit", "true")
            // Offsets are stored by the runner, never by the client.
            .set("enable.auto.offset.store", "false")
            .set(
                "auto.commit.interval.ms",
                options.commit_interval.as_millis().max(1).to_string(),
            )
            .set(
                "session.timeout.ms",
                options.session_timeout.as_millis().to_string(),
            )
            .set(
                "heartbeat.interval.ms",
                (options.session_timeout.as_millis() / 4)
                    .max(100)
                    .to_string(),
            )
            .set("auto.offset.reset", &options.start)
            .set("enable.partition.eof", "false");
        let consumer: StreamConsumer<GroupContext> =
            client(&config, context, "consumer").map_err(SettleError::new)?;
        let topics: Vec<&str> = options.topics.iter().map(String::as_str).collect();
        consumer
            .subscribe(&topics)
            .map_err(|e| SettleError::with_source("subscribe", e))?;
        let producer = RenewingProducer::new(
            producer_config(&servers, "idem-consumer-parker", Duration::ZERO),
            LinkContext::new("parker", &servers, Arc::new(AtomicBool::new(false))),
        )
        .map_err(SettleError::new)?;
        Ok(Self {
            consumer: Arc::new(consumer),
            ledger,
            wake: Arc::new(tokio::sync::Notify::new()),
            parker: Arc::new(Parker {
                producer,
                suffix: options.parked_suffix.clone(),
            }),
        })
    }

    /// The partitions this member holds now.
    pub fn assignment(&self) -> Vec<(String, i32)> {
        self.consumer
            .assignment()
            .map(|list| {
                list.elements()
                    .iter()
                    .map(|tp| (tp.topic().to_owned(), tp.partition()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// A retry that is due, if its partition is still ours; or when the
    /// next one is due.
    fn due_retry(&self) -> Result<KafkaDelivery, Option<Instant>> {
        let mut ledger = self.ledger.lock().expect("ledger");
        loop {
            let Some(first) = ledger.retries.peek() else {
                return Err(None);
            };
            if first.at > Instant::now() {
                return Err(Some(first.at));
            }
            let due = ledger.retries.pop().expect("peeked");
            let current = ledger
                .partitions
                .get(&due.delivery.partition_key())
                .is_some_and(|p| p.generation == due.delivery.generation);
            if current {
                return Ok(due.delivery);
            }
        }
    }

    /// Takes a message from the broker into the ledger.
    fn take(&self, raw: &rdkafka::message::BorrowedMessage<'_>) -> KafkaDelivery {
        let (topic, partition, offset) = (raw.topic().to_owned(), raw.partition(), raw.offset());
        let generation = {
            let mut ledger = self.ledger.lock().expect("ledger");
            let in_hand = ledger
                .partitions
                .entry((topic.clone(), partition))
                .or_default();
            in_hand.open.insert(offset);
            in_hand.next = Some(in_hand.next.map_or(offset + 1, |n| n.max(offset + 1)));
            in_hand.generation
        };
        let mut id = String::new();
        let mut message_type = None;
        let mut list = Vec::new();
        if let Some(found) = raw.headers() {
            for header in found.iter() {
                let value = header
                    .value
                    .map(|v| String::from_utf8_lossy(v).into_owned())
                    .unwrap_or_default();
                if header.key.eq_ignore_ascii_case(headers::MESSAGE_ID) {
                    id = value;
                } else {
                    if header.key.eq_ignore_ascii_case(headers::MESSAGE_TYPE) {
                        message_type = Some(value.clone());
                    }
                    list.push((header.key.to_owned(), value));
                }
            }
        }
        // The subject a NATS or RabbitMQ consumer would see:
        // `<topic>.<message_type>`.
        let subject = match message_type {
            Some(kind) if !kind.is_empty() => format!("{topic}.{kind}"),
            _ => topic.clone(),
        };
        KafkaDelivery {
            message: Message {
                id,
                subject,
                headers: list,
                payload: bytes::Bytes::copy_from_slice(raw.payload().unwrap_or_default()),
                deliveries: 1,
            },
            key: raw.key().map(<[u8]>::to_vec),
            topic,
            partition,
            offset,
            generation,
            consumer: Arc::clone(&self.consumer),
            ledger: Arc::clone(&self.ledger),
            wake: Arc::clone(&self.wake),
            parker: Arc::clone(&self.parker),
        }
    }
}

impl Source for KafkaSource {
    type Delivery = KafkaDelivery;

    async fn next(&mut self) -> Option<Result<KafkaDelivery, SettleError>> {
        loop {
            let wake_at = match self.due_retry() {
                Ok(delivery) => return Some(Ok(delivery)),
                Err(at) => at,
            };
            let until = async {
                match wake_at {
                    Some(at) => tokio::time::sleep_until(at.into()).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                received = self.consumer.recv() => {
                    return Some(match received {
                        Ok(raw) => Ok(self.take(&raw)),
                        Err(err) => Err(SettleError::with_source("Kafka", err)),
                    });
                }
                () = until => {}
                () = self.wake.notified() => {}
            }
        }
    }

    async fn close(self) {
        // Store nothing more; commit what is stored, then leave the group
        // so the partitions move at once.
        let consumer = Arc::clone(&self.consumer);
        let _ = tokio::task::spawn_blocking(move || {
            if let Err(err) = consumer.commit_consumer_state(CommitMode::Sync)
                && err.rdkafka_error_code() != Some(RDKafkaErrorCode::NoOffset)
            {
                tracing::warn!(reason = "kafka_commit_failed", %err, "at close");
            }
            consumer.unsubscribe();
        })
        .await;
    }
}

/// A message from a [`KafkaSource`].
pub struct KafkaDelivery {
    message: Message,
    key: Option<Vec<u8>>,
    topic: String,
    partition: i32,
    offset: i64,
    generation: u64,
    consumer: Arc<StreamConsumer<GroupContext>>,
    ledger: Arc<Mutex<Ledger>>,
    wake: Arc<tokio::sync::Notify>,
    parker: Arc<Parker>,
}

impl std::fmt::Debug for KafkaDelivery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaDelivery")
            .field("message", &self.message)
            .field("topic", &self.topic)
            .field("partition", &self.partition)
            .field("offset", &self.offset)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for GroupContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupContext").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Parker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Parker")
            .field("suffix", &self.suffix)
            .finish_non_exhaustive()
    }
}

impl KafkaDelivery {
    fn partition_key(&self) -> (String, i32) {
        (self.topic.clone(), self.partition)
    }

    /// The message's partition and offset.
    pub fn position(&self) -> (&str, i32, i64) {
        (&self.topic, self.partition, self.offset)
    }

    /// Settles the offset: stores, for the next commit, the partition's
    /// first offset still in hand (or one past the last delivered).
    fn settle(&self) -> Result<(), SettleError> {
        let safe = {
            let mut ledger = self.ledger.lock().expect("ledger");
            let Some(in_hand) = ledger.partitions.get_mut(&self.partition_key()) else {
                return Ok(()); // revoked: the new owner reads it again
            };
            if in_hand.generation != self.generation {
                return Ok(());
            }
            in_hand.open.remove(&self.offset);
            match (in_hand.open.first(), in_hand.next) {
                (Some(first), _) => *first,
                (None, Some(next)) => next,
                (None, None) => return Ok(()),
            }
        };
        let mut list = TopicPartitionList::new();
        list.add_partition_offset(&self.topic, self.partition, Offset::Offset(safe))
            .map_err(|e| SettleError::with_source("store offset", e))?;
        match self.consumer.store_offsets(&list) {
            Ok(()) => Ok(()),
            // Revoked meanwhile: not ours to store.
            Err(KafkaError::StoreOffset(RDKafkaErrorCode::State)) => Ok(()),
            Err(err) => Err(SettleError::with_source("store offset", err)),
        }
    }
}

impl Delivery for KafkaDelivery {
    fn message(&self) -> &Message {
        &self.message
    }

    async fn ack(self) -> Result<(), SettleError> {
        self.settle()
    }

    async fn retry(mut self, delay: Duration) -> Result<(), SettleError> {
        self.message.deliveries = self.message.deliveries.saturating_add(1);
        let wake = Arc::clone(&self.wake);
        {
            let ledger = Arc::clone(&self.ledger);
            let mut ledger = ledger.lock().expect("ledger");
            ledger.retries_made += 1;
            let order = ledger.retries_made;
            ledger.retries.push(Due {
                at: Instant::now() + delay,
                order,
                delivery: self,
            });
        }
        wake.notify_one();
        Ok(())
    }

    async fn park(self, reason: &str) -> Result<(), SettleError> {
        let parked = format!("{}{}", self.topic, self.parker.suffix);
        let mut list = OwnedHeaders::new_with_capacity(self.message.headers.len() + 3);
        if !self.message.id.is_empty() {
            list = list.insert(Header {
                key: headers::MESSAGE_ID,
                value: Some(self.message.id.as_str()),
            });
        }
        for (name, value) in &self.message.headers {
            list = list.insert(Header {
                key: name.as_str(),
                value: Some(value.as_str()),
            });
        }
        let reason = reason.replace(['\r', '\n'], " ");
        list = list
            .insert(Header {
                key: headers::PARKED_REASON,
                value: Some(reason.as_str()),
            })
            .insert(Header {
                key: headers::ORIGINAL_SUBJECT,
                value: Some(self.topic.as_str()),
            });
        let mut record = FutureRecord::to(&parked)
            .payload(&self.message.payload[..])
            .headers(list);
        if let Some(key) = &self.key {
            record = record.key(key);
        }
        self.parker
            .producer
            .send(record)
            .await
            .map_err(|f| SettleError::with_source(format!("park to {parked}"), f.err))?;
        self.settle()
    }
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

    #[test]
    fn a_lost_producer_state_or_a_timeout_renews_the_producer() {
        use RDKafkaErrorCode as C;
        assert_eq!(renew_after(Some(C::Fatal), false), Some(Renewal::Fatal));
        assert_eq!(
            renew_after(Some(C::MessageTimedOut), true),
            Some(Renewal::Fatal)
        );
        for stalled in [
            C::MessageTimedOut,
            C::UnknownProducerId,
            C::OutOfOrderSequenceNumber,
            C::InvalidProducerEpoch,
        ] {
            assert_eq!(renew_after(Some(stalled), false), Some(Renewal::Stalled));
        }
        // A refusal of the message, or a broker merely away, keeps it.
        for kept in [C::MessageSizeTooLarge, C::AllBrokersDown, C::UnknownTopic] {
            assert_eq!(renew_after(Some(kept), false), None, "{kept:?}");
        }
        assert_eq!(renew_after(None, false), None);
    }

    #[test]
    fn topics_come_from_the_subject() {
        let msg = Outgoing {
            subject: "idem.v2.payment.PaymentAuthorized".into(),
            id: "e1".into(),
            payload: bytes::Bytes::from_static(b"{}"),
            headers: Vec::new(),
        };
        assert_eq!(
            KafkaTopics::PerAggregateType.of(&msg),
            ("idem.v2.payment", "PaymentAuthorized")
        );
        assert_eq!(
            KafkaTopics::One("events".into()).of(&msg),
            ("events", "PaymentAuthorized")
        );
    }
}

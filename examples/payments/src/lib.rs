//! # payments — idem's reference Payment API and Order service
//!
//! The production pattern idem exists for, built only on idem's public
//! API: a [Payment API](api) that never charges twice (the `idem-http`
//! layer, the PostgreSQL store, the provider called with a stable operation
//! id, payment + outbox event + idempotency record in one transaction, a
//! reconciliation worker for unknown outcomes) in front of a
//! [fake provider](provider) that fails like real ones, and an
//! [Order service](orders) that applies each payment once (outbox → NATS
//! JetStream or Kafka, chosen by the [`Bus`]'s URL → consumer runner with
//! the inbox). Each payment's events carry the W3C trace context of the
//! request that caused them, across both services.

pub mod api;
pub mod orders;
pub mod provider;

use std::time::Duration;

use idem_messaging::trace::TraceContext;
use idem_messaging::{
    JetStreamSource, JetStreamSourceOptions, KafkaPublisher, KafkaPublisherOptions, KafkaSource,
    KafkaSourceOptions, KafkaTopics, NatsPublisher, Relay, TopicSpec,
};
use idem_postgres::outbox::OutboxMessage;

/// How long creating the Kafka topics at start may take: the client would
/// wait for an unreachable broker for ever, and a service that cannot
/// start should say so.
const KAFKA_SETUP_TIMEOUT: Duration = Duration::from_secs(20);

/// The broker a [`Bus`] URL names, by its scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Broker {
    /// `nats://host:port`: NATS with JetStream.
    Nats,
    /// `kafka://host:port[,host:port…]`: Kafka.
    Kafka,
}

impl Broker {
    /// The broker of `url`; an error for any other scheme.
    pub fn of(url: &str) -> Result<Self, String> {
        match url.split_once("://").map(|(scheme, _)| scheme) {
            Some("nats") => Ok(Self::Nats),
            Some("kafka") => Ok(Self::Kafka),
            _ => Err(format!(
                "broker {}: use nats://host:port (NATS JetStream) or kafka://host:port[,host:port…] (Kafka)",
                idem::store::redact_broker_url(url)
            )),
        }
    }
}

/// Where the services' events travel, and everything that depends on the
/// broker: the Payment API's and the Order service's relays publish
/// through it and the Order service consumes from it.
///
/// * **NATS** (`nats://…`): a JetStream stream capturing
///   `<prefix>.>` (subjects `<prefix>.<aggregate_type>.<message_type>`,
///   de-duplicated by message id for 5 minutes), and a second stream for
///   what the Order service parks. The Order service's durable consumer
///   takes only `<prefix>.payment.PaymentAuthorized`.
/// * **Kafka** (`kafka://…`): a topic per aggregate type,
///   `<prefix>.payment` and `<prefix>.order`, keyed by the aggregate id
///   (one aggregate's events keep their order in one partition), each
///   event's type in its `Idem-Message-Type` header. The Order service is
///   the consumer group `<prefix>.orders` on `<prefix>.payment`, and
///   parks to `<prefix>.payment.parked`; it skips (acknowledges) the
///   topic's other payment events (see [`orders::PaymentHandler`]).
#[derive(Debug, Clone)]
pub struct Bus {
    /// The broker: `nats://host:port` (JetStream) or
    /// `kafka://host:port[,host:port…]`.
    pub broker: String,
    /// NATS: the event stream (what is parked goes to `<stream>_PARKED`).
    pub stream: String,
    /// Subject prefix (`<prefix>.<aggregate_type>.<message_type>`); on
    /// Kafka, the topic prefix (`<prefix>.<aggregate_type>`).
    pub prefix: String,
    /// Kafka: partitions and replication factor of the topics created at
    /// start (and by a relay that finds one missing).
    pub topics: TopicSpec,
    /// Kafka: the Order service's consumer-group session timeout (a
    /// consumer silent this long loses its partitions to the others).
    pub session_timeout: Duration,
}

impl Bus {
    /// The broker at `broker`; stream `PAYMENTS`, prefix `idem`; Kafka
    /// topics of 6 partitions with one replica (this single-node
    /// example's; 3 replicas survive losing a broker), a 10 s session
    /// timeout.
    pub fn new(broker: &str) -> Self {
        Self {
            broker: broker.to_owned(),
            stream: "PAYMENTS".to_owned(),
            prefix: "idem".to_owned(),
            topics: TopicSpec {
                partitions: 6,
                replication: 1,
            },
            session_timeout: Duration::from_secs(10),
        }
    }

    /// The broker [`broker`](Self::broker) names.
    pub fn kind(&self) -> Result<Broker, String> {
        Broker::of(&self.broker)
    }

    /// The `payments orders` / `payments relay` flags that give this bus.
    pub fn to_args(&self) -> Vec<String> {
        vec![
            "--broker".to_owned(),
            self.broker.clone(),
            "--stream".to_owned(),
            self.stream.clone(),
            "--prefix".to_owned(),
            self.prefix.clone(),
            "--topic-partitions".to_owned(),
            self.topics.partitions.to_string(),
            "--topic-replication".to_owned(),
            self.topics.replication.to_string(),
            "--session-timeout".to_owned(),
            humantime::format_duration(self.session_timeout).to_string(),
        ]
    }

    /// Where the Order service parks events it refuses, on NATS.
    pub fn parked_subject(&self) -> String {
        format!("{}_parked.orders", self.prefix)
    }

    /// The stream capturing the parked subject, on NATS.
    pub fn parked_stream(&self) -> String {
        format!("{}_PARKED", self.stream)
    }

    /// Kafka: the topic of an aggregate type's events,
    /// `<prefix>.<aggregate_type>` (what [`KafkaTopics::PerAggregateType`]
    /// publishes to).
    pub fn topic(&self, aggregate_type: &str) -> String {
        format!("{}.{aggregate_type}", self.prefix)
    }

    /// Kafka: where the Order service parks events it refuses (the
    /// payment topic's `.parked` twin, which [`KafkaSource`] publishes
    /// to).
    pub fn parked_topic(&self) -> String {
        format!(
            "{}{}",
            self.topic(api::AGGREGATE_TYPE),
            self.order_source_options().parked_suffix
        )
    }

    /// Kafka: the Order service's consumer group, `<prefix>.orders`.
    /// Unlike a JetStream consumer, which lives inside its stream, a
    /// group is the whole cluster's: the prefix keeps two deployments
    /// (or two test runs) sharing a cluster out of each other's
    /// rebalances.
    pub fn consumer_group(&self) -> String {
        format!("{}.{}", self.prefix, orders::CONSUMER)
    }

    /// The Order service's Kafka group membership.
    fn order_source_options(&self) -> KafkaSourceOptions {
        let topic = self.topic(api::AGGREGATE_TYPE);
        let mut options = KafkaSourceOptions::new(&self.consumer_group(), &[&topic]);
        options.session_timeout = self.session_timeout;
        options
    }

    /// Where the events go, in words (for start-up lines); for a broker
    /// URL of another scheme, why it is refused.
    pub fn describe(&self) -> String {
        let url = idem::store::redact_broker_url(&self.broker);
        match self.kind() {
            Ok(Broker::Nats) => {
                format!("{url} stream {} (subjects {}.>)", self.stream, self.prefix)
            }
            Ok(Broker::Kafka) => format!(
                "{url} topics {}, {} (key: aggregate id)",
                self.topic(api::AGGREGATE_TYPE),
                self.topic(orders::AGGREGATE_TYPE)
            ),
            Err(why) => why,
        }
    }

    /// Creates what the events travel through, where missing: on NATS,
    /// the event stream and the parked-messages stream (duplicate window
    /// 5 minutes); on Kafka, the topics `<prefix>.payment`,
    /// `<prefix>.order` and the parked topic, with
    /// [`topics`](Self::topics)' partitions and replication. An error
    /// when the broker cannot be reached (on Kafka, after 20 s).
    pub async fn ensure_destinations(&self) -> Result<(), String> {
        match self.kind()? {
            Broker::Nats => {
                for (stream, subject) in [
                    (self.stream.clone(), format!("{}.>", self.prefix)),
                    (self.parked_stream(), self.parked_subject()),
                ] {
                    NatsPublisher::connect(&self.broker, &stream)
                        .await
                        .map_err(|e| e.to_string())?
                        .create_stream(vec![subject], Duration::from_secs(300))
                        .await
                        .map_err(|e| e.to_string())?;
                }
            }
            Broker::Kafka => {
                let publisher = self.kafka_publisher()?;
                for topic in [
                    self.topic(api::AGGREGATE_TYPE),
                    self.topic(orders::AGGREGATE_TYPE),
                    self.parked_topic(),
                ] {
                    tokio::time::timeout(KAFKA_SETUP_TIMEOUT, publisher.create_topic(&topic, self.topics))
                        .await
                        .map_err(|_| {
                            format!(
                                "Kafka at {} did not answer within {KAFKA_SETUP_TIMEOUT:?} (creating topic {topic})",
                                idem::store::redact_broker_url(&self.broker)
                            )
                        })?
                        .map_err(|e| e.to_string())?;
                }
            }
        }
        Ok(())
    }

    /// The relay's Kafka publisher: a topic per aggregate type, created
    /// when missing (a relay that starts before the Order service).
    fn kafka_publisher(&self) -> Result<KafkaPublisher, String> {
        KafkaPublisher::connect(
            &self.broker,
            KafkaPublisherOptions {
                topics: KafkaTopics::PerAggregateType,
                create: Some(self.topics),
                ..KafkaPublisherOptions::default()
            },
        )
        .map_err(|e| e.to_string())
    }

    /// Runs the Order service's consumer until `stop`: `PaymentAuthorized`
    /// events through the inbox into [`orders::PaymentHandler`]. On NATS
    /// the durable consumer `orders` on the stream, filtered to that
    /// subject; on Kafka the group [`consumer_group`](Self::consumer_group)
    /// on the payment topic.
    pub async fn run_order_consumer(
        &self,
        orders: &orders::Orders,
        stop: impl std::future::Future<Output = ()> + Send,
    ) -> Result<idem_messaging::ConsumerStats, String> {
        let consumer = idem_messaging::Consumer::new(
            orders.store().pool().clone(),
            orders::PaymentHandler,
            idem_messaging::ConsumerOptions::new(orders::CONSUMER),
        );
        match self.kind()? {
            Broker::Nats => {
                let client = async_nats::connect(&self.broker).await.map_err(|e| {
                    format!(
                        "cannot connect to NATS at {}: {e}",
                        idem::store::redact_broker_url(&self.broker)
                    )
                })?;
                let mut options = JetStreamSourceOptions::new(
                    &self.stream,
                    orders::CONSUMER,
                    &self.parked_subject(),
                );
                options.filter_subjects = vec![format!(
                    "{}.{}.{}",
                    self.prefix,
                    api::AGGREGATE_TYPE,
                    api::PAYMENT_AUTHORIZED
                )];
                options.ack_wait = Duration::from_secs(10);
                let source = JetStreamSource::bind(client, &options)
                    .await
                    .map_err(|e| e.to_string())?;
                Ok(consumer.run(source, stop).await)
            }
            Broker::Kafka => {
                let source = KafkaSource::subscribe(&self.broker, &self.order_source_options())
                    .map_err(|e| e.to_string())?;
                Ok(consumer.run(source, stop).await)
            }
        }
    }

    /// Runs a relay over the outbox in `database` (its `schema=` names it)
    /// to the broker, until `stop`.
    pub async fn run_relay(
        &self,
        database: &str,
        stop: impl std::future::Future<Output = ()> + Send,
    ) -> Result<idem_messaging::RelayStats, String> {
        let opts = idem_postgres::PgOptions::from_url(database).map_err(|e| e.to_string())?;
        let namespace = opts.schema().unwrap_or("public").to_owned();
        let lock_options = opts.connect_options().clone();
        let store = idem_postgres::PgStore::connect_with(opts)
            .await
            .map_err(|e| e.to_string())?;
        let options = idem_messaging::RelayOptions {
            prefix: self.prefix.clone(),
            ..idem_messaging::RelayOptions::default()
        };
        let pool = store.pool().clone();
        match self.kind()? {
            Broker::Nats => {
                let publisher = NatsPublisher::connect(&self.broker, &self.stream)
                    .await
                    .map_err(|e| e.to_string())?;
                let relay = Relay::new(pool, lock_options, &namespace, publisher, options);
                Ok(relay.run(stop).await)
            }
            Broker::Kafka => {
                let publisher = self.kafka_publisher()?;
                let relay = Relay::new(pool, lock_options, &namespace, publisher, options);
                Ok(relay.run(stop).await)
            }
        }
    }
}

/// `msg` with the W3C trace context `cx`, if any: the event then carries
/// the trace of what caused it through the relay to its consumer.
pub fn traced(
    msg: OutboxMessage,
    cx: Option<&TraceContext>,
) -> Result<OutboxMessage, idem_postgres::MessagingError> {
    match cx {
        Some(cx) => msg.with_trace_context(cx.traceparent(), cx.tracestate()),
        None => Ok(msg),
    }
}

/// Binds `addr` and serves `router` until `stop` completes; returns the
/// bound address and the server task.
pub async fn serve(
    addr: std::net::SocketAddr,
    router: axum::Router,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(std::net::SocketAddr, tokio::task::JoinHandle<()>), String> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
    let bound = listener.local_addr().map_err(|e| e.to_string())?;
    let task = tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, router)
            .with_graceful_shutdown(stop)
            .await
        {
            tracing::error!(%err, "server failed");
        }
    });
    Ok((bound, task))
}

/// Connects to `database` (idem's tables are created by migration) and
/// creates or updates the service's own table with the statements of
/// `ddl`, in order (each must be harmless to run again).
pub async fn connect_store(database: &str, ddl: &[&str]) -> Result<idem_postgres::PgStore, String> {
    let opts = idem_postgres::PgOptions::from_url(database).map_err(|e| e.to_string())?;
    let store = idem_postgres::PgStore::connect_with(opts)
        .await
        .map_err(|e| e.to_string())?;
    for statement in ddl {
        idem_postgres::sqlx::query(statement)
            .execute(store.pool())
            .await
            .map_err(|e| format!("cannot create the service's table: {e}"))?;
    }
    Ok(store)
}

/// An RFC 9457 problem body with this example's types.
pub fn problem(
    status: axum::http::StatusCode,
    kind: &str,
    detail: impl Into<String>,
) -> (axum::http::StatusCode, String) {
    let body = serde_json::json!({
        "type": format!("https://idem.example/problems/{kind}"),
        "title": kind.replace('_', " "),
        "status": status.as_u16(),
        "detail": detail.into(),
    });
    (status, body.to_string())
}

/// [`problem`] as an `application/problem+json` response.
pub fn problem_response(
    status: axum::http::StatusCode,
    kind: &str,
    detail: impl Into<String>,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let (status, body) = problem(status, kind, detail);
    (
        status,
        [(axum::http::header::CONTENT_TYPE, "application/problem+json")],
        body,
    )
        .into_response()
}

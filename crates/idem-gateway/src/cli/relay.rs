//! `idem relay`: publishes the PostgreSQL outbox to a broker (NATS
//! JetStream, RabbitMQ or Kafka), with as many relays running at once as wanted; see
//! [`idem_messaging::relay`] for the guarantees.
//!
//! With `--otlp-endpoint` (or `OTEL_EXPORTER_OTLP_ENDPOINT`), the relay
//! exports its spans over OTLP/HTTP, as `idem serve` does with
//! `[telemetry]` (the same exporter, see [`crate::telemetry`]): one
//! `idem.publish` span per publish of a row that carries a trace context,
//! child of that context, whose own context the message carries on as its
//! `traceparent`. The relay starts no trace of its own: rows without a
//! context are published without a span, and each traced row keeps the
//! sampling decision made where its trace began (its `traceparent`'s
//! flag), so there is no sample ratio to set here.

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::get;
#[cfg(feature = "nats")]
use idem_messaging::NatsPublisher;
#[cfg(feature = "rabbitmq")]
use idem_messaging::RabbitPublisher;
#[cfg(feature = "kafka")]
use idem_messaging::{KafkaPublisher, KafkaPublisherOptions, KafkaTopics, TopicSpec};
use idem_messaging::{NotReady, Publisher, Readiness, Relay, RelayOptions};
use idem_postgres::{PgOptions, PgStore};

use crate::error::GatewayError;

/// How long the start-up check of the broker's duplicate window waits.
const START_CHECK: Duration = Duration::from_secs(5);

/// What `idem relay` was asked to do.
#[derive(Debug, Clone, clap::Args)]
pub(super) struct RelayArgs {
    /// The PostgreSQL database holding the outbox (`postgres://…`).
    #[arg(long, env = "IDEM_STORE")]
    pub store: String,
    /// The broker: `nats://host:port` (JetStream),
    /// `amqp://user:password@host:port/vhost` (RabbitMQ) or
    /// `kafka://host:port[,host:port…]` (Kafka).
    #[arg(long, env = "IDEM_BROKER")]
    pub broker: String,
    /// Kafka: publish every event to this one topic (default: a topic per
    /// aggregate type, `<prefix>.<aggregate_type>`). The key is always the
    /// aggregate id.
    #[arg(long, env = "IDEM_TOPIC")]
    pub topic: Option<String>,
    /// Kafka: create a missing topic before the first publish to it.
    #[arg(long)]
    pub create_topics: bool,
    /// Kafka: partitions of a topic made by --create-topics.
    #[arg(long, default_value_t = 12, value_parser = clap::value_parser!(i32).range(1..=10_000))]
    pub topic_partitions: i32,
    /// Kafka: replication factor of a topic made by --create-topics.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(i32).range(1..=100))]
    pub topic_replication: i32,
    /// RabbitMQ: the durable topic exchange published to (declared if
    /// missing); the routing key is the subject.
    #[arg(long, env = "IDEM_EXCHANGE", default_value = "idem")]
    pub exchange: String,
    /// NATS: the JetStream stream that captures the subjects.
    #[arg(long, env = "IDEM_STREAM", default_value = "IDEM")]
    pub stream: String,
    /// Subject prefix: `<prefix>.<aggregate_type>.<message_type>`.
    #[arg(long, env = "IDEM_PREFIX", default_value = "idem")]
    pub prefix: String,
    /// Create the stream (subjects `<prefix>.>`) if it is missing.
    #[arg(long)]
    pub create_stream: bool,
    /// The duplicate window of a stream created with --create-stream.
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    pub duplicate_window: Duration,
    /// Partitions aggregates are hashed into; every relay of one outbox
    /// must use the same number.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub partitions: u16,
    /// Message-id prefix (`<source>:<row id>`) of rows written before
    /// schema version 5, which have no event id of their own; default:
    /// the schema. Newer rows are published under their random event id.
    #[arg(long, env = "IDEM_SOURCE")]
    pub source: Option<String>,
    /// Attempts before a row becomes dead.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(i32).range(1..=1000))]
    pub max_attempts: i32,
    /// Admin listener: /healthz, /readyz (database and broker), /metrics.
    #[arg(
        long,
        env = "IDEM_RELAY_ADMIN_LISTEN",
        default_value = "127.0.0.1:9091"
    )]
    pub admin_listen: std::net::SocketAddr,
    /// Bearer token for /readyz and /metrics (required on a non-loopback address).
    #[arg(long, env = "IDEM_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Export the publish spans of traced rows over OTLP/HTTP to this
    /// collector (`http://host:4318`; `/v1/traces` is added to a URL
    /// without a path). Off when unset.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// The `service.name` of the exported spans.
    #[arg(long, env = "OTEL_SERVICE_NAME", default_value = "idem-relay")]
    pub otlp_service_name: String,
}

impl RelayArgs {
    /// The trace export asked for (`--otlp-endpoint`), checked as
    /// `[telemetry] otlp_endpoint` is; `None` when off.
    pub(super) fn telemetry(
        &self,
    ) -> Result<Option<crate::config::TelemetrySettings>, GatewayError> {
        let Some(endpoint) = self.otlp_endpoint.as_deref().filter(|e| !e.is_empty()) else {
            return Ok(None);
        };
        let endpoint = crate::config::traces_url(endpoint)
            .map_err(|why| GatewayError::Invalid(format!("--otlp-endpoint {endpoint}: {why}")))?;
        if self.otlp_service_name.trim().is_empty() {
            return Err(GatewayError::Invalid(
                "--otlp-service-name must not be empty".to_owned(),
            ));
        }
        Ok(Some(crate::config::TelemetrySettings {
            endpoint,
            // Unused: the relay follows each row's sampling flag.
            sample_ratio: 1.0,
            trace_keys: false,
            service_name: self.otlp_service_name.clone(),
        }))
    }
}

/// The relay's admin routes: `/healthz`, and behind the admin rules
/// `/readyz` (the last round reached the database and the broker, and the
/// broker's client is connected now) and `/metrics`.
fn admin_router(ready: Arc<Readiness>, broker: String, token: Option<Arc<str>>) -> axum::Router {
    let protected = axum::Router::new()
        .route(
            "/readyz",
            get(move || {
                let answer = match ready.check() {
                    Ok(()) => (StatusCode::OK, "ready\n".to_owned()),
                    Err(why) => {
                        let at = match why {
                            NotReady::Broker(_) => format!(" (broker {broker})"),
                            _ => String::new(),
                        };
                        (
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("not ready: {why}{at}\n"),
                        )
                    }
                };
                async move { answer }
            }),
        )
        .route("/metrics", get(crate::admin::metrics));
    axum::Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .merge(crate::admin::guarded(protected, token))
}

/// Runs the relay until SIGINT or SIGTERM.
pub(super) async fn run(args: RelayArgs) -> Result<(), GatewayError> {
    let token: Option<Arc<str>> = args
        .admin_token
        .as_deref()
        .filter(|t| !t.is_empty())
        .map(Arc::from);
    if token.is_none() && !args.admin_listen.ip().is_loopback() {
        return Err(GatewayError::Invalid(format!(
            "--admin-listen {} is not a loopback address: set an admin token (--admin-token or IDEM_ADMIN_TOKEN) first",
            args.admin_listen
        )));
    }
    let admin = tokio::net::TcpListener::bind(args.admin_listen)
        .await
        .map_err(|source| GatewayError::Listen {
            addr: args.admin_listen,
            admin: true,
            source,
        })?;
    crate::metrics::install();
    let opts = PgOptions::from_url(&args.store)?;
    let broker = Broker::from_url(&args.broker)?;
    if args.prefix.is_empty() || args.prefix.contains(['*', '>', '#', ' ']) {
        return Err(GatewayError::Invalid(format!(
            "--prefix {:?}: must be a non-empty subject prefix without wildcards or spaces",
            args.prefix
        )));
    }
    let namespace = opts.schema().unwrap_or("public").to_owned();
    let lock_options = opts.connect_options().clone();
    let store = PgStore::connect_with(opts).await?;
    let options = RelayOptions {
        prefix: args.prefix.clone(),
        partitions: args.partitions,
        max_attempts: args.max_attempts,
        source: args.source.clone(),
        ..RelayOptions::default()
    };
    let setup = Setup {
        store,
        lock_options,
        namespace,
        options,
        admin,
        token,
        store_url: args.store.clone(),
        broker_url: idem::store::redact_broker_url(&args.broker),
    };
    match broker {
        #[cfg(feature = "kafka")]
        Broker::Kafka => drive_kafka(&args, setup).await,
        #[cfg(feature = "nats")]
        Broker::Nats => drive_nats(&args, setup).await,
        #[cfg(feature = "rabbitmq")]
        Broker::Rabbit => drive_rabbit(&args, setup).await,
        // `Broker::from_url` admits only the brokers this build has.
        #[allow(unreachable_patterns)]
        other => Err(GatewayError::Invalid(other.not_built(&args.broker))),
    }
}

/// A broker `idem relay` publishes to, named by its URL's scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Broker {
    /// `nats://`: NATS JetStream.
    Nats,
    /// `amqp://`: RabbitMQ.
    Rabbit,
    /// `kafka://`: Kafka.
    Kafka,
}

impl Broker {
    /// Every broker idem knows, whether or not this build has it.
    const ALL: [Broker; 3] = [Broker::Nats, Broker::Rabbit, Broker::Kafka];

    /// The URL scheme that names it.
    fn scheme(self) -> &'static str {
        match self {
            Broker::Nats => "nats",
            Broker::Rabbit => "amqp",
            Broker::Kafka => "kafka",
        }
    }

    /// Its URL's form, as the error messages show it.
    fn form(self) -> &'static str {
        match self {
            Broker::Nats => "nats://host:port (JetStream)",
            Broker::Rabbit => "amqp://user:password@host:port/vhost (RabbitMQ)",
            Broker::Kafka => "kafka://host:port[,host:port…] (Kafka)",
        }
    }

    /// The cargo feature of idem-gateway that builds its client in.
    fn feature(self) -> &'static str {
        match self {
            Broker::Nats => "nats",
            Broker::Rabbit => "rabbitmq",
            Broker::Kafka => "kafka",
        }
    }

    /// Whether this build has its client.
    fn built(self) -> bool {
        match self {
            Broker::Nats => cfg!(feature = "nats"),
            Broker::Rabbit => cfg!(feature = "rabbitmq"),
            Broker::Kafka => cfg!(feature = "kafka"),
        }
    }

    /// The broker `url` names, if this build has its client; otherwise
    /// an error that lists the forms this build accepts.
    fn from_url(url: &str) -> Result<Self, GatewayError> {
        let scheme = url.split_once("://").map(|(scheme, _)| scheme);
        match Self::ALL.into_iter().find(|b| Some(b.scheme()) == scheme) {
            Some(broker) if broker.built() => Ok(broker),
            Some(broker) => Err(GatewayError::Invalid(broker.not_built(url))),
            None => Err(GatewayError::Invalid(format!(
                "--broker {}: use {}",
                idem::store::redact_broker_url(url),
                Self::accepted()
            ))),
        }
    }

    /// The message for a `url` of this broker when this build lacks it.
    fn not_built(self, url: &str) -> String {
        format!(
            "--broker {}: this idem is built without the `{}` feature; build it with `--features {}`, or use {}",
            idem::store::redact_broker_url(url),
            self.feature(),
            self.feature(),
            Self::accepted()
        )
    }

    /// The URL forms this build accepts, for error messages.
    fn accepted() -> String {
        let forms: Vec<&str> = Self::ALL
            .into_iter()
            .filter(|b| b.built())
            .map(Broker::form)
            .collect();
        match forms.split_last() {
            None => "no broker: this idem is built without any".to_owned(),
            Some((last, [])) => (*last).to_owned(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        }
    }
}

/// Publishes to Kafka: one topic, or a topic per aggregate type.
#[cfg(feature = "kafka")]
async fn drive_kafka(args: &RelayArgs, setup: Setup) -> Result<(), GatewayError> {
    let topics = match args.topic.clone() {
        Some(topic) => KafkaTopics::One(topic),
        None => KafkaTopics::PerAggregateType,
    };
    let options = KafkaPublisherOptions {
        topics: topics.clone(),
        create: args.create_topics.then_some(TopicSpec {
            partitions: args.topic_partitions,
            replication: args.topic_replication,
        }),
        ..KafkaPublisherOptions::default()
    };
    let publisher = KafkaPublisher::connect(&args.broker, options)?;
    eprintln!(
        "idem relay: note: Kafka de-duplicates only a producer's own retries; a row re-published after a relay crash is a second record with the same Idem-Message-Id, and consumers drop it with the inbox"
    );
    match tokio::time::timeout(START_CHECK, publisher.durability_warnings()).await {
        Ok(Ok(warnings)) => {
            for warning in warnings {
                tracing::warn!(reason = "relay_kafka_durability", "{warning}");
                eprintln!("idem relay: WARNING: {warning}");
            }
        }
        Ok(Err(err)) => {
            eprintln!("idem relay: WARNING: cannot check the topics' replication: {err}")
        }
        Err(_) => eprintln!(
            "idem relay: WARNING: Kafka did not answer within {START_CHECK:?}, so the topics' replication is unchecked; publishing starts when it is reachable (see /readyz)"
        ),
    }
    let target = match topics {
        KafkaTopics::One(topic) => format!(
            "{} topic {topic} (key: aggregate id)",
            idem::store::redact_broker_url(&args.broker)
        ),
        KafkaTopics::PerAggregateType => format!(
            "{} topics {}.<aggregate_type> (key: aggregate id)",
            idem::store::redact_broker_url(&args.broker),
            args.prefix
        ),
    };
    setup.drive(publisher, &target).await
}

/// Publishes to a NATS JetStream stream, made first if asked.
#[cfg(feature = "nats")]
async fn drive_nats(args: &RelayArgs, setup: Setup) -> Result<(), GatewayError> {
    let publisher = NatsPublisher::connect(&args.broker, &args.stream).await?;
    if args.create_stream {
        publisher
            .create_stream(vec![format!("{}.>", args.prefix)], args.duplicate_window)
            .await?;
    }
    let target = format!(
        "{} stream {} (subjects {}.>)",
        idem::store::redact_broker_url(&args.broker),
        args.stream,
        args.prefix
    );
    setup.drive(publisher, &target).await
}

/// Publishes to a RabbitMQ topic exchange.
#[cfg(feature = "rabbitmq")]
async fn drive_rabbit(args: &RelayArgs, setup: Setup) -> Result<(), GatewayError> {
    let publisher = RabbitPublisher::connect(&args.broker, &args.exchange).await?;
    eprintln!(
        "idem relay: note: RabbitMQ does not de-duplicate; a row re-published after a relay crash reaches the queues twice with the same message_id, and consumers drop it with the inbox"
    );
    let target = format!(
        "{} exchange {} (routing keys {}.<aggregate_type>.<message_type>)",
        idem::store::redact_broker_url(&args.broker),
        args.exchange,
        args.prefix
    );
    setup.drive(publisher, &target).await
}

/// Everything a relay needs but its publisher.
struct Setup {
    store: PgStore,
    lock_options: idem_postgres::sqlx::postgres::PgConnectOptions,
    namespace: String,
    options: RelayOptions,
    admin: tokio::net::TcpListener,
    token: Option<Arc<str>>,
    store_url: String,
    /// The broker's URL, password redacted, for `/readyz`.
    broker_url: String,
}

impl Setup {
    /// Serves the admin listener and runs the relay through `publisher`
    /// until SIGINT or SIGTERM.
    async fn drive<P: Publisher>(self, publisher: P, target: &str) -> Result<(), GatewayError> {
        let Self {
            store,
            lock_options,
            namespace,
            options,
            admin,
            token,
            store_url,
            broker_url,
        } = self;
        let relay = Relay::new(
            store.pool().clone(),
            lock_options,
            &namespace,
            publisher,
            options,
        );
        let store = store_url.as_str();
        let admin_addr = admin
            .local_addr()
            .map_err(|e| GatewayError::io("the admin listener's address", e))?;
        let router = admin_router(relay.readiness(), broker_url, token);
        tokio::spawn(async move {
            if let Err(err) = axum::serve(admin, router).await {
                tracing::error!(%err, "relay admin listener failed");
            }
        });
        // A broker that is down at start must not hold the relay (and its
        // readiness) before its first round: the check then waits for it.
        match tokio::time::timeout(START_CHECK, relay.check_duplicate_window()).await {
            Ok(Some(warning)) => eprintln!("idem relay: WARNING: {warning}"),
            Ok(None) => {}
            Err(_) => eprintln!(
                "idem relay: WARNING: the broker did not answer within {START_CHECK:?}, so its duplicate window is unchecked; publishing starts when it is reachable (see /readyz)"
            ),
        }
        // Before the ready line: a signal right after it must stop us cleanly.
        let stop = crate::shutdown::shutdown_signal();
        println!(
            "idem relay: publishing the outbox of {} to {target}, admin {admin_addr}",
            idem::store::redact_url(store),
        );
        let stats = relay.run(stop).await;
        println!(
            "idem relay: stopped after publishing {} row(s) ({} already in the stream), {} failed attempt(s), {} dead",
            stats.published, stats.duplicates, stats.failures, stats.dead
        );
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(err: GatewayError) -> String {
        match err {
            GatewayError::Invalid(message) => message,
            other => panic!("expected an invalid-argument error, got {other}"),
        }
    }

    #[test]
    fn each_built_broker_is_named_by_its_scheme() {
        for broker in Broker::ALL.into_iter().filter(|b| b.built()) {
            let url = format!("{}://user:secret@127.0.0.1:1", broker.scheme());
            assert_eq!(
                Broker::from_url(&url).expect("a built broker"),
                broker,
                "{url}"
            );
        }
    }

    #[test]
    fn an_unknown_scheme_lists_the_forms_this_build_accepts() {
        let why = message(
            Broker::from_url("mqtt://user:secret@127.0.0.1:1883").expect_err("mqtt is no broker"),
        );
        assert!(!why.contains("secret"), "the password is redacted: {why}");
        for broker in Broker::ALL {
            assert_eq!(why.contains(broker.form()), broker.built(), "{why}");
        }
        let bare = message(Broker::from_url("127.0.0.1:4222").expect_err("a URL needs a scheme"));
        assert!(bare.starts_with("--broker 127.0.0.1:4222: use "), "{bare}");
    }

    #[test]
    fn a_broker_left_out_of_the_build_names_its_feature() {
        let why = Broker::Kafka.not_built("kafka://user:secret@127.0.0.1:9092");
        assert!(why.contains("without the `kafka` feature"), "{why}");
        assert!(why.contains("--features kafka"), "{why}");
        assert!(!why.contains("secret"), "the password is redacted: {why}");
    }
}

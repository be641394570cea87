//! The relay's [`KafkaPublisher`]: the topics events go to, created and
//! checked for durability, and the publish itself.

use super::producer::{RenewingProducer, SendFailure, producer_config};
use super::*;

/// What fewer than 3 replicas risk, in the durability warnings.
const ONE_BROKER_LOST: &str =
    "one broker lost can lose acknowledged events (3 with min.insync.replicas=2 survive one)";

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

/// Kafka, through an idempotent producer; see the [module docs](super).
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

#[cfg(test)]
mod tests {
    use super::*;

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

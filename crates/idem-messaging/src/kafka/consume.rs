//! The runner's [`KafkaSource`]: a consumer-group member that stores
//! offsets only for settled messages and keeps retries itself.

use super::producer::{RenewingProducer, producer_config};
use super::*;

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
/// [`crate::Consumer`]; see the [module docs](super).
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

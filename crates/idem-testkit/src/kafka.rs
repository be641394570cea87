//! A plain Kafka client for the tests (librdkafka through rdkafka, not
//! idem's adapter): creates topics, produces with acknowledgement, and
//! reads a whole topic back, so what idem published or parked is checked
//! by a client other than idem's own.

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};

/// The tests' group session timeout: a Tansu group join takes about half
/// of it.
pub const SESSION_TIMEOUT: Duration = Duration::from_secs(6);

/// The test producer.
pub type Producer = FutureProducer;

/// `host:port,…` of a `kafka://host:port[,host:port…]` URL.
pub fn servers(url: &str) -> String {
    url.strip_prefix("kafka://")
        .unwrap_or_else(|| panic!("{url}: not a kafka:// URL"))
        .trim_end_matches('/')
        .to_owned()
}

/// Creates `topics` with `partitions` each (one replica).
pub async fn create_topics(url: &str, topics: &[String], partitions: i32) {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", servers(url))
        .create()
        .expect("admin client");
    let new: Vec<NewTopic<'_>> = topics
        .iter()
        .map(|t| NewTopic::new(t, partitions, TopicReplication::Fixed(1)))
        .collect();
    for result in admin
        .create_topics(&new, &AdminOptions::new())
        .await
        .expect("create topics")
    {
        if let Err((topic, code)) = result {
            assert_eq!(
                code,
                rdkafka::types::RDKafkaErrorCode::TopicAlreadyExists,
                "create {topic}"
            );
        }
    }
}

/// An idempotent producer waiting for every in-sync replica.
pub fn producer(url: &str) -> Producer {
    ClientConfig::new()
        .set("bootstrap.servers", servers(url))
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "0")
        .create()
        .expect("producer")
}

/// Produces one record and waits for its acknowledgement.
pub async fn send(
    producer: &Producer,
    topic: &str,
    key: &str,
    headers: &[(&str, &str)],
    payload: &str,
) {
    let mut list = OwnedHeaders::new();
    for (key, value) in headers {
        list = list.insert(Header {
            key,
            value: Some(*value),
        });
    }
    producer
        .send(
            FutureRecord::to(topic)
                .key(key)
                .payload(payload)
                .headers(list),
            Duration::from_secs(10),
        )
        .await
        .map_err(|(e, _)| e)
        .expect("produce");
}

/// One record read back.
#[derive(Debug, Clone)]
pub struct Record {
    /// Its partition.
    pub partition: i32,
    /// Its offset there.
    pub offset: i64,
    /// Its key (empty when it had none).
    pub key: String,
    /// Its headers, in order.
    pub headers: Vec<(String, String)>,
    /// Its value, as text.
    pub payload: String,
}

impl Record {
    /// The first header called `name`.
    pub fn header(&self, name: &str) -> Option<String> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    }
}

/// Every record of `topic` (all partitions, from the start), in partition
/// then offset order: reads until the topic has been quiet for a second.
pub async fn read_all(url: &str, topic: &str) -> Vec<Record> {
    let (url, topic) = (url.to_owned(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", servers(&url))
            .set("group.id", format!("reader-{}", std::process::id()))
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "false")
            .create()
            .expect("reader");
        let metadata = consumer
            .fetch_metadata(Some(&topic), Duration::from_secs(5))
            .expect("metadata");
        let mut list = rdkafka::TopicPartitionList::new();
        for t in metadata.topics() {
            for p in t.partitions() {
                list.add_partition_offset(&topic, p.id(), rdkafka::Offset::Beginning)
                    .expect("partition");
            }
        }
        consumer.assign(&list).expect("assign");
        let mut out = Vec::new();
        let started = std::time::Instant::now();
        let mut quiet_since = started;
        while quiet_since.elapsed() < Duration::from_secs(1) {
            match consumer.poll(Duration::from_millis(100)) {
                Some(Ok(m)) => {
                    quiet_since = std::time::Instant::now();
                    let headers = m
                        .headers()
                        .map(|h| {
                            h.iter()
                                .map(|h| {
                                    (
                                        h.key.to_owned(),
                                        String::from_utf8_lossy(h.value.unwrap_or_default())
                                            .into_owned(),
                                    )
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    out.push(Record {
                        partition: m.partition(),
                        offset: m.offset(),
                        key: String::from_utf8_lossy(m.key().unwrap_or_default()).into_owned(),
                        headers,
                        payload: String::from_utf8_lossy(m.payload().unwrap_or_default())
                            .into_owned(),
                    });
                }
                // A lost broker connection is a state librdkafka recovers
                // from by reconnecting (the product's clients treat it so):
                // the time it lasts is not quiet, up to a bound.
                Some(Err(err))
                    if err.rdkafka_error_code()
                        == Some(rdkafka::types::RDKafkaErrorCode::AllBrokersDown) =>
                {
                    assert!(
                        started.elapsed() < Duration::from_secs(30),
                        "read {topic}: brokers still down after 30 s: {err}"
                    );
                    quiet_since = std::time::Instant::now();
                }
                Some(Err(err)) => panic!("read {topic}: {err}"),
                None => {}
            }
        }
        out.sort_by_key(|r| (r.partition, r.offset));
        out
    })
    .await
    .expect("reader")
}

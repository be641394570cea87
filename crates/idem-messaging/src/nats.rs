//! NATS JetStream: the relay's [`NatsPublisher`] and the runner's
//! [`JetStreamSource`].

use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::jetstream::consumer::{AckPolicy, pull};
use futures_util::StreamExt;

use crate::consumer::{Delivery, Message, SettleError, Source};
use crate::headers;
use crate::publisher::{Outgoing, PublishError, Published, Publisher};

/// NATS JetStream: the id travels as `Nats-Msg-Id`, the stream's
/// `duplicate_window` drops a re-publish of the same id.
#[derive(Debug, Clone)]
pub struct NatsPublisher {
    client: async_nats::Client,
    jetstream: async_nats::jetstream::Context,
    stream: String,
    ack_timeout: Duration,
}

impl NatsPublisher {
    /// Connects to `url` (`nats://host:port`); publishes go to the stream
    /// named `stream` (which must capture the subjects).
    pub async fn connect(url: &str, stream: &str) -> Result<Self, PublishError> {
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .retry_on_initial_connect()
            .event_callback(outage_log(url))
            .connect(url)
            .await
            .map_err(|e| {
                PublishError::broker_down_with(
                    format!(
                        "cannot connect to NATS at {}",
                        idem::store::redact_broker_url(url)
                    ),
                    e,
                )
            })?;
        let jetstream = async_nats::jetstream::new(client.clone());
        Ok(Self {
            client,
            jetstream,
            stream: stream.to_owned(),
            ack_timeout: Duration::from_secs(5),
        })
    }

    /// Creates the stream if it is missing, capturing `subjects` and
    /// remembering ids for `duplicate_window`.
    pub async fn create_stream(
        &self,
        subjects: Vec<String>,
        duplicate_window: Duration,
    ) -> Result<(), PublishError> {
        self.jetstream
            .get_or_create_stream(async_nats::jetstream::stream::Config {
                name: self.stream.clone(),
                subjects,
                duplicate_window,
                ..Default::default()
            })
            .await
            .map_err(|e| {
                PublishError::refused_with(format!("cannot create stream {}", self.stream), e)
            })?;
        Ok(())
    }

    /// The JetStream context (tests read the stream through it).
    pub fn jetstream(&self) -> &async_nats::jetstream::Context {
        &self.jetstream
    }
}

impl Publisher for NatsPublisher {
    async fn publish(&self, msg: &Outgoing) -> Result<Published, PublishError> {
        if !self.is_connected() {
            return Err(PublishError::broker_down("NATS is not connected"));
        }
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, msg.id.as_str());
        for (name, value) in &msg.headers {
            headers.insert(name.as_str(), value.as_str());
        }
        let ack = self
            .jetstream
            .publish_with_headers(msg.subject.clone(), headers, msg.payload.clone())
            .await
            .map_err(|e| {
                PublishError::broker_down_with(format!("publish to {}", msg.subject), e)
            })?;
        let ack = tokio::time::timeout(self.ack_timeout, ack)
            .await
            .map_err(|_| {
                PublishError::broker_down(format!(
                    "no acknowledgement for {} within {:?}",
                    msg.subject, self.ack_timeout
                ))
            })?
            .map_err(|e| {
                use async_nats::jetstream::context::PublishErrorKind;
                let message = format!("publish to {}", msg.subject);
                match e.kind() {
                    PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => {
                        PublishError::broker_down_with(message, e)
                    }
                    _ => PublishError::refused_with(message, e),
                }
            })?;
        Ok(Published {
            duplicate: ack.duplicate,
        })
    }

    async fn duplicate_window(&self) -> Result<Option<Duration>, PublishError> {
        let mut stream = self
            .jetstream
            .get_stream(&self.stream)
            .await
            .map_err(|e| PublishError::refused_with(format!("stream {}", self.stream), e))?;
        let info = stream
            .info()
            .await
            .map_err(|e| PublishError::refused_with(format!("stream {}", self.stream), e))?;
        Ok(Some(info.config.duplicate_window))
    }

    fn is_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }
}

/// A durable JetStream pull consumer, as a [`Source`] for
/// [`crate::Consumer`].
///
/// The broker's redelivery count (`delivered`) is the message's
/// [`Message::deliveries`]; a retry is a `-NAK` with a delay; parking
/// publishes the message (same id, same headers, plus
/// [`headers::PARKED_REASON`] and [`headers::ORIGINAL_SUBJECT`]) to the
/// dead-letter subject, waits for the stream's acknowledgement, then
/// terminates the original (`+TERM`). The dead-letter subject must be
/// captured by a stream, or parking fails and the message is redelivered.
pub struct JetStreamSource {
    jetstream: async_nats::jetstream::Context,
    consumer: async_nats::jetstream::consumer::Consumer<pull::Config>,
    /// `None` after the message stream ended (a broker restart): the next
    /// call opens a new one.
    messages: Option<pull::Stream>,
    dead_letter: String,
}

/// How a [`JetStreamSource`] binds to its stream.
#[derive(Debug, Clone)]
pub struct JetStreamSourceOptions {
    /// The stream to consume.
    pub stream: String,
    /// The durable consumer's name (created if missing; several runner
    /// replicas with the same name share its messages).
    pub durable: String,
    /// Subjects of the stream this consumer takes (empty: all).
    pub filter_subjects: Vec<String>,
    /// Where parked messages go.
    pub dead_letter_subject: String,
    /// How long the broker waits for an acknowledgement before it
    /// redelivers (a crashed runner's messages come back after this).
    pub ack_wait: Duration,
    /// Unacknowledged messages the broker lets this consumer hold.
    pub max_ack_pending: i64,
}

impl JetStreamSourceOptions {
    /// A durable consumer `durable` on `stream`, parking to
    /// `<stream>.parked.<durable>`-style subject `dead_letter_subject`;
    /// ack wait 30 s, 1,000 messages pending.
    pub fn new(stream: &str, durable: &str, dead_letter_subject: &str) -> Self {
        Self {
            stream: stream.to_owned(),
            durable: durable.to_owned(),
            filter_subjects: Vec::new(),
            dead_letter_subject: dead_letter_subject.to_owned(),
            ack_wait: Duration::from_secs(30),
            max_ack_pending: 1000,
        }
    }
}

impl std::fmt::Debug for JetStreamSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JetStreamSource")
            .field("dead_letter", &self.dead_letter)
            .finish_non_exhaustive()
    }
}

impl JetStreamSource {
    /// Binds to (or creates) the durable pull consumer described by
    /// `options` on the stream, through `client`.
    pub async fn bind(
        client: async_nats::Client,
        options: &JetStreamSourceOptions,
    ) -> Result<Self, SettleError> {
        let jetstream = async_nats::jetstream::new(client);
        let stream = jetstream
            .get_stream(&options.stream)
            .await
            .map_err(|e| SettleError::with_source(format!("stream {}", options.stream), e))?;
        let consumer: async_nats::jetstream::consumer::Consumer<pull::Config> = stream
            .get_or_create_consumer(
                &options.durable,
                pull::Config {
                    durable_name: Some(options.durable.clone()),
                    ack_policy: AckPolicy::Explicit,
                    ack_wait: options.ack_wait,
                    // The runner parks; the broker never gives up by itself.
                    max_deliver: -1,
                    max_ack_pending: options.max_ack_pending,
                    // One filter goes in `filter_subject`, which every
                    // server version knows (servers before 2.10 ignore
                    // `filter_subjects` and would deliver everything).
                    filter_subject: match options.filter_subjects.as_slice() {
                        [one] => one.clone(),
                        _ => String::new(),
                    },
                    filter_subjects: match options.filter_subjects.as_slice() {
                        [_] => Vec::new(),
                        many => many.to_vec(),
                    },
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| SettleError::with_source(format!("consumer {}", options.durable), e))?;
        let messages = consumer
            .messages()
            .await
            .map_err(|e| SettleError::with_source(format!("consumer {}", options.durable), e))?;
        Ok(Self {
            jetstream,
            consumer,
            messages: Some(messages),
            dead_letter: options.dead_letter_subject.clone(),
        })
    }
}

impl Source for JetStreamSource {
    type Delivery = JetStreamDelivery;

    async fn next(&mut self) -> Option<Result<JetStreamDelivery, SettleError>> {
        let messages = match self.messages.as_mut() {
            Some(messages) => messages,
            None => match self.consumer.messages().await {
                Ok(messages) => self.messages.insert(messages),
                Err(e) => return Some(Err(SettleError::with_source("JetStream", e))),
            },
        };
        let Some(next) = messages.next().await else {
            // The stream ended (the connection or the consumer went away):
            // open a new one on the next call, after the runner's pause.
            self.messages = None;
            return Some(Err(SettleError::new(
                "JetStream: the message stream ended; reopening",
            )));
        };
        Some(
            next.map_err(|e| SettleError::with_source("JetStream", e))
                .map(|raw| {
                    let deliveries = raw
                        .info()
                        .map(|i| u32::try_from(i.delivered).unwrap_or(u32::MAX))
                        .unwrap_or(1);
                    let mut id = String::new();
                    let mut list = Vec::new();
                    if let Some(map) = &raw.headers {
                        for (name, values) in map.iter() {
                            for value in values {
                                if *name == async_nats::header::NATS_MESSAGE_ID {
                                    id = value.as_str().to_owned();
                                } else {
                                    list.push((name.to_string(), value.as_str().to_owned()));
                                }
                            }
                        }
                    }
                    let message = Message {
                        id,
                        subject: raw.subject.to_string(),
                        headers: list,
                        payload: raw.payload.clone(),
                        deliveries,
                    };
                    JetStreamDelivery {
                        raw,
                        message,
                        jetstream: self.jetstream.clone(),
                        dead_letter: self.dead_letter.clone(),
                    }
                }),
        )
    }
}

/// A message from a [`JetStreamSource`].
#[derive(Debug)]
pub struct JetStreamDelivery {
    raw: async_nats::jetstream::Message,
    message: Message,
    jetstream: async_nats::jetstream::Context,
    dead_letter: String,
}

impl JetStreamDelivery {
    async fn settle(&self, kind: AckKind) -> Result<(), SettleError> {
        self.raw
            .ack_with(kind)
            .await
            .map_err(|e| SettleError::with_source("acknowledge", e))
    }
}

impl Delivery for JetStreamDelivery {
    fn message(&self) -> &Message {
        &self.message
    }

    async fn ack(self) -> Result<(), SettleError> {
        self.settle(AckKind::Ack).await
    }

    async fn retry(self, delay: Duration) -> Result<(), SettleError> {
        self.settle(AckKind::Nak(Some(delay))).await
    }

    async fn park(self, reason: &str) -> Result<(), SettleError> {
        let mut map = async_nats::HeaderMap::new();
        if !self.message.id.is_empty() {
            map.insert(
                async_nats::header::NATS_MESSAGE_ID,
                self.message.id.as_str(),
            );
        }
        for (name, value) in &self.message.headers {
            map.append(name.as_str(), value.as_str());
        }
        map.insert(headers::PARKED_REASON, one_line(reason).as_str());
        map.insert(headers::ORIGINAL_SUBJECT, self.message.subject.as_str());
        let ack = self
            .jetstream
            .publish_with_headers(self.dead_letter.clone(), map, self.message.payload.clone())
            .await
            .map_err(|e| SettleError::with_source(format!("park to {}", self.dead_letter), e))?;
        ack.await
            .map_err(|e| SettleError::with_source(format!("park to {}", self.dead_letter), e))?;
        self.settle(AckKind::Term).await
    }
}

/// A header value on one line (NATS headers cannot hold line breaks).
fn one_line(text: &str) -> String {
    text.replace(['\r', '\n'], " ")
}

/// The client's connection events as the relay's own log lines: one
/// warning when NATS at `url` becomes unreachable (naming it, and what to
/// check), one line when it is back; not one line per reconnect attempt.
/// (The client also logs each event itself, at INFO under the target
/// `async_nats`; the `idem` binary shows those only when asked.)
fn outage_log(
    url: &str,
) -> impl Fn(async_nats::Event) -> std::future::Ready<()> + Send + Sync + 'static {
    use std::sync::atomic::{AtomicBool, Ordering};
    let url = idem::store::redact_broker_url(url);
    let down = AtomicBool::new(false);
    move |event| {
        // The swaps in the guards keep one line per change of state.
        match event {
            async_nats::Event::Connected if down.swap(false, Ordering::Relaxed) => {
                tracing::info!(reason = "nats_connected", %url, "NATS reachable again");
            }
            async_nats::Event::Disconnected | async_nats::Event::ClientError(_)
                if !down.swap(true, Ordering::Relaxed) =>
            {
                tracing::warn!(reason = "nats_unreachable", %url, %event, "NATS at {url} is unreachable; retrying in the background. Is nats-server running there, with JetStream (-js)?");
            }
            _ => {}
        }
        std::future::ready(())
    }
}

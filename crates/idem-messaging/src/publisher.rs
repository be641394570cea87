//! Where the relay publishes: a broker that acknowledges each message and
//! drops a re-published id inside its de-duplication window.

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;

/// One message on its way to the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    /// `<prefix>.<aggregate_type>.<message_type>`.
    pub subject: String,
    /// The de-duplication id (the outbox row id).
    pub id: String,
    /// The JSON payload.
    pub payload: Bytes,
    /// Headers: the row's own, plus `Idem-Aggregate-Id` and `Idem-Sequence`.
    pub headers: Vec<(String, String)>,
}

/// What the broker said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Published {
    /// The broker had this id already (a re-publish it dropped).
    pub duplicate: bool,
}

/// Why a publish failed. Every failure leaves the row pending.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct PublishError {
    /// What happened, in one line.
    pub message: String,
    /// The broker could not be reached or did not answer: nothing is wrong
    /// with the message, so the attempt does not count towards `dead`;
    /// the relay waits for the broker.
    pub broker_down: bool,
}

impl PublishError {
    /// The broker is unreachable or did not answer in time.
    pub fn broker_down(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            broker_down: true,
        }
    }

    /// The broker answered and refused this message (no stream for its
    /// subject, too large…): the attempt counts.
    pub fn refused(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            broker_down: false,
        }
    }
}

/// A broker with publish acknowledgements and id-based de-duplication.
pub trait Publisher: Send + Sync + 'static {
    /// Publishes and waits for the broker's acknowledgement.
    fn publish(
        &self,
        msg: &Outgoing,
    ) -> impl Future<Output = Result<Published, PublishError>> + Send;

    /// How long the broker remembers ids for de-duplication, if it can say.
    fn duplicate_window(
        &self,
    ) -> impl Future<Output = Result<Option<Duration>, PublishError>> + Send;

    /// Whether the broker is reachable now (readiness).
    fn is_connected(&self) -> bool;
}

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
            .connect(url)
            .await
            .map_err(|e| {
                PublishError::broker_down(format!("cannot connect to NATS at {url}: {e}"))
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
                PublishError::refused(format!("cannot create stream {}: {e}", self.stream))
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
            .map_err(|e| PublishError::broker_down(format!("publish to {}: {e}", msg.subject)))?;
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
                let message = format!("publish to {}: {e}", msg.subject);
                match e.kind() {
                    PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => {
                        PublishError::broker_down(message)
                    }
                    _ => PublishError::refused(message),
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
            .map_err(|e| PublishError::refused(format!("stream {}: {e}", self.stream)))?;
        let info = stream
            .info()
            .await
            .map_err(|e| PublishError::refused(format!("stream {}: {e}", self.stream)))?;
        Ok(Some(info.config.duplicate_window))
    }

    fn is_connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }
}

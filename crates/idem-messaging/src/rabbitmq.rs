//! RabbitMQ: the relay's [`RabbitPublisher`] and the runner's
//! [`RabbitSource`].
//!
//! RabbitMQ has no de-duplication window: a row re-published after a relay
//! crash (between the broker's confirm and the relay marking the row) is a
//! second copy in the queue, with the same `message_id`. The consumer's
//! inbox is what drops it, so consumers of a RabbitMQ outbox must run
//! through the inbox ([`crate::Consumer`] does).

use std::sync::RwLock;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};

use idem::store::redact_url;

use crate::consumer::{Delivery, Message, SettleError, Source};
use crate::headers;
use crate::publisher::{Outgoing, PublishError, Published, Publisher};

/// How long a connection attempt or a confirm may take.
const TIMEOUT: Duration = Duration::from_secs(5);

/// One connection and its confirm-mode channel.
struct Link {
    // Held so the connection lives as long as its channel is used, and
    // closed with it.
    connection: Connection,
    channel: Channel,
}

impl std::fmt::Debug for Link {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Link")
            .field("connected", &self.channel.status().connected())
            .finish()
    }
}

/// Opens a connection and a channel with publisher confirms, and declares
/// the durable topic exchange `exchange`. Every failure is the broker's
/// ([`PublishError::BrokerDown`]).
async fn open(url: &str, exchange: &str) -> Result<Link, PublishError> {
    let step = async {
        let connection = Connection::connect(url, ConnectionProperties::default())
            .await
            .map_err(|e| {
                PublishError::broker_down_with(
                    format!("cannot connect to RabbitMQ at {}", redact_url(url)),
                    e,
                )
            })?;
        let channel = connection
            .create_channel()
            .await
            .map_err(|e| PublishError::broker_down_with("cannot open a channel", e))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| PublishError::broker_down_with("cannot enable publisher confirms", e))?;
        channel
            .exchange_declare(
                exchange.into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                PublishError::broker_down_with(format!("cannot declare exchange {exchange}"), e)
            })?;
        Ok(Link {
            connection,
            channel,
        })
    };
    tokio::time::timeout(TIMEOUT, step).await.map_err(|_| {
        PublishError::broker_down(format!(
            "RabbitMQ at {} did not answer within {TIMEOUT:?}",
            redact_url(url)
        ))
    })?
}

/// Publishes `payload` with `properties` and waits for the broker's
/// confirm.
async fn publish_confirmed(
    channel: &Channel,
    exchange: &str,
    routing_key: &str,
    payload: &[u8],
    properties: BasicProperties,
) -> Result<(), PublishError> {
    let step = async {
        let confirm = channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                payload,
                properties,
            )
            .await
            .map_err(|e| PublishError::broker_down_with(format!("publish to {routing_key}"), e))?;
        match confirm
            .await
            .map_err(|e| PublishError::broker_down_with(format!("publish to {routing_key}"), e))?
        {
            Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
            Confirmation::Ack(Some(returned)) => Err(PublishError::refused(format!(
                "no queue is bound to routing key {routing_key} on exchange {exchange:?} ({})",
                returned.reply_text
            ))),
            Confirmation::Nack(_) => Err(PublishError::broker_down(format!(
                "the broker could not take the message for {routing_key}"
            ))),
        }
    };
    tokio::time::timeout(TIMEOUT, step).await.map_err(|_| {
        PublishError::broker_down(format!("no confirm for {routing_key} within {TIMEOUT:?}"))
    })?
}

fn long(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value))
}

/// RabbitMQ with publisher confirms: the relay publishes to a durable topic
/// exchange with the subject as routing key, the row's event id as `message_id`,
/// persistent delivery, and the headers as AMQP headers. An unroutable
/// message (no queue bound) is refused, so it counts as a failed attempt
/// rather than vanishing. The connection is re-opened on the next publish
/// after it drops.
#[derive(Debug)]
pub struct RabbitPublisher {
    url: String,
    exchange: String,
    link: RwLock<Option<Link>>,
    reconnect: tokio::sync::Mutex<()>,
}

impl RabbitPublisher {
    /// Connects to `url` (`amqp://user:password@host:port/vhost`) and
    /// declares the durable topic exchange `exchange`.
    pub async fn connect(url: &str, exchange: &str) -> Result<Self, PublishError> {
        let link = open(url, exchange).await?;
        Ok(Self {
            url: url.to_owned(),
            exchange: exchange.to_owned(),
            link: RwLock::new(Some(link)),
            reconnect: tokio::sync::Mutex::new(()),
        })
    }

    fn current(&self) -> Option<Channel> {
        let guard = self.link.read().unwrap_or_else(|p| p.into_inner());
        guard
            .as_ref()
            .filter(|l| l.channel.status().connected())
            .map(|l| l.channel.clone())
    }

    async fn channel(&self) -> Result<Channel, PublishError> {
        if let Some(channel) = self.current() {
            return Ok(channel);
        }
        let _one_at_a_time = self.reconnect.lock().await;
        if let Some(channel) = self.current() {
            return Ok(channel);
        }
        let link = open(&self.url, &self.exchange).await?;
        let channel = link.channel.clone();
        *self.link.write().unwrap_or_else(|p| p.into_inner()) = Some(link);
        Ok(channel)
    }
}

impl Publisher for RabbitPublisher {
    async fn publish(&self, msg: &Outgoing) -> Result<Published, PublishError> {
        let channel = self.channel().await?;
        let mut table = FieldTable::default();
        for (name, value) in &msg.headers {
            table.insert(name.as_str().into(), long(value));
        }
        let properties = BasicProperties::default()
            .with_message_id(msg.id.as_str().into())
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_headers(table);
        publish_confirmed(
            &channel,
            &self.exchange,
            &msg.subject,
            &msg.payload,
            properties,
        )
        .await?;
        Ok(Published { duplicate: false })
    }

    async fn duplicate_window(&self) -> Result<Option<Duration>, PublishError> {
        Ok(None)
    }

    fn is_connected(&self) -> bool {
        self.current().is_some()
    }
}

/// Where a [`RabbitSource`] takes its messages from.
#[derive(Debug, Clone)]
pub struct RabbitSourceOptions {
    /// The topic exchange the relay publishes to.
    pub exchange: String,
    /// The durable queue this consumer reads (several runner replicas may
    /// share it). Next to it the source declares `<queue>.retry` (delayed
    /// redeliveries) and `<queue>.parked` (the dead letters).
    pub queue: String,
    /// Routing-key patterns binding the queue to the exchange
    /// (`idem.payment.*`, `idem.#`).
    pub bindings: Vec<String>,
    /// Unacknowledged messages the broker lets this consumer hold.
    pub prefetch: u16,
}

impl RabbitSourceOptions {
    /// Queue `queue` bound to `exchange` by `bindings`, 64 messages
    /// prefetched.
    pub fn new(exchange: &str, queue: &str, bindings: &[&str]) -> Self {
        Self {
            exchange: exchange.to_owned(),
            queue: queue.to_owned(),
            bindings: bindings.iter().map(|b| (*b).to_owned()).collect(),
            prefetch: 64,
        }
    }

    /// The queue delayed redeliveries wait in.
    pub fn retry_queue(&self) -> String {
        format!("{}.retry", self.queue)
    }

    /// The queue parked messages go to.
    pub fn parked_queue(&self) -> String {
        format!("{}.parked", self.queue)
    }
}

/// A RabbitMQ queue, as a [`Source`] for [`crate::Consumer`].
///
/// RabbitMQ cannot redeliver a message later by itself, so a retry sends
/// the message to `<queue>.retry` with a per-message expiry equal to the
/// delay; that queue dead-letters expired messages back to `<queue>`. The
/// copy is confirmed before the original is acknowledged (a crash between
/// the two leaves two copies with one id; the inbox drops the second). The
/// delivery count travels in [`headers::DELIVERIES`] (plus one when the
/// broker flags a redelivery after a lost consumer). Note that RabbitMQ
/// expires only messages at the head of a queue: a short delay queued
/// behind a longer one waits for it.
#[derive(Debug)]
pub struct RabbitSource {
    url: String,
    options: RabbitSourceOptions,
    link: Option<(Link, lapin::Consumer)>,
}

impl RabbitSource {
    /// Connects, declares the exchange, the queue, its retry and parked
    /// queues and bindings, and starts consuming.
    pub async fn bind(url: &str, options: RabbitSourceOptions) -> Result<Self, SettleError> {
        let mut source = Self {
            url: url.to_owned(),
            options,
            link: None,
        };
        source.connect().await?;
        Ok(source)
    }

    async fn connect(&mut self) -> Result<(), SettleError> {
        let o = &self.options;
        let link = open(&self.url, &o.exchange)
            .await
            .map_err(SettleError::from_error)?;
        let ch = &link.channel;
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        let declare = |name: String, args: FieldTable| {
            let ch = ch.clone();
            async move {
                ch.queue_declare(name.as_str().into(), durable, args)
                    .await
                    .map_err(|e| {
                        SettleError::with_source(format!("cannot declare queue {name}"), e)
                    })
            }
        };
        declare(o.queue.clone(), FieldTable::default()).await?;
        let mut retry_args = FieldTable::default();
        retry_args.insert("x-dead-letter-exchange".into(), long(""));
        retry_args.insert("x-dead-letter-routing-key".into(), long(&o.queue));
        declare(o.retry_queue(), retry_args).await?;
        declare(o.parked_queue(), FieldTable::default()).await?;
        for key in &o.bindings {
            ch.queue_bind(
                o.queue.as_str().into(),
                o.exchange.as_str().into(),
                key.as_str().into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                SettleError::with_source(format!("cannot bind {} to {key}", o.queue), e)
            })?;
        }
        ch.basic_qos(o.prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| SettleError::with_source("cannot set the prefetch", e))?;
        let consumer = ch
            .basic_consume(
                o.queue.as_str().into(),
                ShortString::from(""),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| SettleError::with_source(format!("cannot consume {}", o.queue), e))?;
        self.link = Some((link, consumer));
        Ok(())
    }
}

impl Source for RabbitSource {
    type Delivery = RabbitDelivery;

    async fn close(self) {
        if let Some((link, consumer)) = self.link {
            drop(consumer);
            let _ = link.channel.close(200, "OK".into()).await;
            let _ = link.connection.close(200, "OK".into()).await;
        }
    }

    async fn next(&mut self) -> Option<Result<RabbitDelivery, SettleError>> {
        if self
            .link
            .as_ref()
            .is_none_or(|(l, _)| !l.channel.status().connected())
            && let Err(err) = self.connect().await
        {
            self.link = None;
            return Some(Err(err));
        }
        let (link, consumer) = self.link.as_mut()?;
        match consumer.next().await {
            Some(Ok(delivery)) => Some(Ok(RabbitDelivery::new(
                delivery,
                link.channel.clone(),
                &self.options,
            ))),
            Some(Err(err)) => {
                self.link = None;
                Some(Err(SettleError::with_source("RabbitMQ consumer", err)))
            }
            None => {
                self.link = None;
                Some(Err(SettleError::new("RabbitMQ closed the consumer")))
            }
        }
    }
}

/// A message from a [`RabbitSource`].
#[derive(Debug)]
pub struct RabbitDelivery {
    delivery: lapin::message::Delivery,
    message: Message,
    channel: Channel,
    retry_queue: String,
    parked_queue: String,
}

/// An AMQP header value as text (numbers and strings; other kinds are not
/// passed on).
fn text(value: &AMQPValue) -> Option<String> {
    Some(match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::ShortString(s) => s.as_str().to_owned(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        AMQPValue::LongInt(n) => n.to_string(),
        AMQPValue::LongUInt(n) => n.to_string(),
        AMQPValue::ShortInt(n) => n.to_string(),
        AMQPValue::ShortUInt(n) => n.to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        _ => return None,
    })
}

impl RabbitDelivery {
    fn new(delivery: lapin::message::Delivery, channel: Channel, o: &RabbitSourceOptions) -> Self {
        let props = &delivery.properties;
        let mut list = Vec::new();
        let mut earlier = 0u32;
        let mut broker_count = None;
        let mut subject = delivery.routing_key.as_str().to_owned();
        if let Some(table) = props.headers() {
            for (name, value) in table.inner() {
                let Some(value) = text(value) else { continue };
                let name = name.as_str();
                if name.eq_ignore_ascii_case(headers::DELIVERIES) {
                    earlier = value.parse().unwrap_or(0);
                } else if name.eq_ignore_ascii_case(headers::ORIGINAL_SUBJECT) {
                    subject = value;
                } else if name == "x-delivery-count" {
                    broker_count = value.parse::<u32>().ok();
                } else if !name.starts_with("x-") {
                    list.push((name.to_owned(), value));
                }
            }
        }
        // Quorum queues count redeliveries; classic queues only flag them.
        let redeliveries = broker_count.unwrap_or(u32::from(delivery.redelivered));
        let message = Message {
            id: props
                .message_id()
                .as_ref()
                .map(|s| s.as_str().to_owned())
                .unwrap_or_default(),
            subject,
            headers: list,
            payload: bytes::Bytes::copy_from_slice(&delivery.data),
            deliveries: earlier.saturating_add(redeliveries).saturating_add(1),
        };
        Self {
            delivery,
            message,
            channel,
            retry_queue: o.retry_queue(),
            parked_queue: o.parked_queue(),
        }
    }

    /// The message's properties for a copy sent to `queue`, with the
    /// runner's headers set and the broker's `x-` headers dropped.
    fn copy_properties(&self, extra: &[(&str, String)]) -> BasicProperties {
        let mut table = FieldTable::default();
        for (name, value) in &self.message.headers {
            table.insert(name.as_str().into(), long(value));
        }
        table.insert(
            headers::DELIVERIES.into(),
            AMQPValue::LongLongInt(i64::from(self.message.deliveries)),
        );
        table.insert(
            headers::ORIGINAL_SUBJECT.into(),
            long(&self.message.subject),
        );
        for (name, value) in extra {
            table.insert((*name).into(), long(value));
        }
        let mut properties = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(table);
        if !self.message.id.is_empty() {
            properties = properties.with_message_id(self.message.id.as_str().into());
        }
        if let Some(kind) = self.delivery.properties.content_type() {
            properties = properties.with_content_type(kind.clone());
        }
        properties
    }

    /// Sends a copy to `queue` (confirmed), then acknowledges the original.
    async fn move_to(&self, queue: &str, properties: BasicProperties) -> Result<(), SettleError> {
        publish_confirmed(&self.channel, "", queue, &self.delivery.data, properties)
            .await
            .map_err(SettleError::from_error)?;
        self.ack_original().await
    }

    async fn ack_original(&self) -> Result<(), SettleError> {
        self.delivery
            .ack(BasicAckOptions::default())
            .await
            .map(|_| ())
            .map_err(|e| SettleError::with_source("acknowledge", e))
    }
}

impl Delivery for RabbitDelivery {
    fn message(&self) -> &Message {
        &self.message
    }

    async fn ack(self) -> Result<(), SettleError> {
        self.ack_original().await
    }

    async fn retry(self, delay: Duration) -> Result<(), SettleError> {
        let properties = self
            .copy_properties(&[])
            .with_expiration(delay.as_millis().max(1).to_string().into());
        self.move_to(&self.retry_queue, properties).await
    }

    async fn park(self, reason: &str) -> Result<(), SettleError> {
        let properties = self.copy_properties(&[(headers::PARKED_REASON, reason.to_owned())]);
        self.move_to(&self.parked_queue, properties).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_not_logged() {
        assert_eq!(
            redact_url("amqp://guest:secret@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
        assert_eq!(redact_url("amqp://127.0.0.1"), "amqp://127.0.0.1");
        assert_eq!(redact_url("amqp://user@host"), "amqp://user@host");
    }
}

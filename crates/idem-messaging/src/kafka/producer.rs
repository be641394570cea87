//! The idempotent producer the relay and parking share, replaced by a
//! new one when a send shows it stuck or broken.

use super::*;

/// How long the producer tries to deliver one message (librdkafka's
/// `message.timeout.ms`) before the publish fails as broker-down.
pub(super) const DELIVERY_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a producer is replaced by a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Renewal {
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
pub(super) fn renew_after(code: Option<RDKafkaErrorCode>, fatal: bool) -> Option<Renewal> {
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

/// The idempotent producer both the relay and parking use.
pub(super) fn producer_config(servers: &str, client_id: &str, linger: Duration) -> ClientConfig {
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
pub(super) struct RenewingProducer {
    config: ClientConfig,
    /// The link's state, shared by every producer it makes.
    pub(super) link: LinkContext,
    /// The producer in use and how many came before it.
    slot: RwLock<(u64, FutureProducer<LinkContext>)>,
}

/// A send that failed, and whether the producer was replaced after it.
pub(super) struct SendFailure {
    pub(super) err: KafkaError,
    pub(super) renewed: bool,
}

impl RenewingProducer {
    pub(super) fn new(config: ClientConfig, link: LinkContext) -> Result<Self, String> {
        let producer = client(&config, link.clone(), "producer")?;
        Ok(Self {
            config,
            link,
            slot: RwLock::new((0, producer)),
        })
    }

    /// The producer in use (for metadata requests).
    pub(super) fn current(&self) -> (u64, FutureProducer<LinkContext>) {
        self.slot.read().expect("producer lock").clone()
    }

    /// Sends `record` and waits for its acknowledgement (at most the
    /// delivery time-out, queueing included: a full local queue is the
    /// broker not keeping up).
    pub(super) async fn send<K, P>(&self, record: FutureRecord<'_, K, P>) -> Result<(), SendFailure>
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
    pub(super) fn replace(&self, broken: u64, why: Renewal) {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}

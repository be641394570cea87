//! One delivery applied: the inbox row and the handler's change in one
//! transaction, then the delivery settled; and the inbox's purge.

use super::error::HandlerError;
use super::handler::Handler;
use super::message::Message;
use super::options::{ConsumerOptions, ConsumerStats, Outcome};
use super::source::Delivery;
use crate::headers;
use crate::trace::TARGET;
use idem::InboxOutcome;
use idem_postgres::guard::{Order, OrderingGuard};
use idem_postgres::inbox::Inbox;
use idem_postgres::sqlx::PgPool;
use std::time::Duration;
use tracing::Instrument as _;
use tracing::field::Empty;

/// Deletes `consumer`'s inbox rows older than `keep`, a batch at a time,
/// once a minute.
pub(super) async fn purge_inbox(pool: PgPool, consumer: String, keep: Duration) {
    const BATCH: usize = 1000;
    let mut every = tokio::time::interval(Duration::from_secs(60));
    loop {
        every.tick().await;
        loop {
            match Inbox::purge_consumer_older_than(&pool, &consumer, keep, BATCH).await {
                Ok(n) if n as usize == BATCH => tokio::task::yield_now().await,
                Ok(_) => break,
                Err(err) => {
                    tracing::warn!(reason = "consumer_inbox_purge_failed", %consumer, %err);
                    break;
                }
            }
        }
    }
}

/// Counts the outcomes of one task's deliveries in `stats` and in
/// `idem_inbox_messages_total{consumer,outcome}`.
pub(super) fn record(
    stats: &mut ConsumerStats,
    consumer: &str,
    done: Result<Vec<(Outcome, bool)>, tokio::task::JoinError>,
) {
    match done {
        Ok(handled) => {
            for (outcome, settled) in handled {
                count(stats, consumer, outcome, settled);
            }
        }
        Err(err) => tracing::error!(reason = "consumer_task_failed", %err),
    }
}

/// Counts one delivery's outcome.
pub(super) fn count(stats: &mut ConsumerStats, consumer: &str, outcome: Outcome, settled: bool) {
    stats.count(outcome);
    if !settled {
        stats.settle_failures += 1;
    }
    metrics::counter!(
        idem::metrics::INBOX_MESSAGES_TOTAL.name,
        "consumer" => consumer.to_owned(),
        "outcome" => outcome.as_str()
    )
    .increment(1);
}

/// Handles one delivery and settles it inside its `idem.consume` span;
/// returns its outcome and whether the broker took the settlement.
pub(super) async fn handle_one<H: Handler, D: Delivery>(
    pool: &PgPool,
    handler: &H,
    options: &ConsumerOptions,
    delivery: D,
) -> (Outcome, bool) {
    let span = consume_span(&options.consumer, delivery.message());
    let (outcome, settled) = handle_and_settle(pool, handler, options, delivery)
        .instrument(span.clone())
        .await;
    span.record("idem.outcome", outcome.as_str());
    if matches!(outcome, Outcome::Retried | Outcome::Parked) {
        span.record("otel.status_code", "ERROR");
    }
    (outcome, settled)
}

/// The span one delivery is handled in: a child of the message's trace
/// context when it has one (a new trace's root otherwise, if the
/// subscriber keeps such).
pub(super) fn consume_span(consumer: &str, msg: &Message) -> tracing::Span {
    let span = tracing::info_span!(target: TARGET, "idem.consume",
        otel.name = %format_args!("process {}", msg.subject), otel.kind = "consumer",
        messaging.operation.type = "process", messaging.consumer.group.name = %consumer,
        messaging.message.id = %msg.id, messaging.destination.name = %msg.subject,
        messaging.message.delivery_count = msg.deliveries, idem.outcome = Empty,
        trace_id = Empty, otel.status_code = Empty);
    if !span.is_disabled()
        && let Some(parent) = msg.trace_context()
    {
        span.record("trace_id", parent.trace_id());
        parent.set_as_parent_of(&span);
    }
    span
}

/// Handles one delivery and settles it; returns its outcome and whether
/// the broker took the settlement.
pub(super) async fn handle_and_settle<H: Handler, D: Delivery>(
    pool: &PgPool,
    handler: &H,
    options: &ConsumerOptions,
    delivery: D,
) -> (Outcome, bool) {
    let msg = delivery.message();
    let (id, deliveries, subject) = (msg.id.clone(), msg.deliveries, msg.subject.clone());
    let consumer = options.consumer.as_str();
    let (outcome, settled) = if id.is_empty() {
        tracing::error!(reason = "consumer_message_without_id", consumer, %subject, "parking a message without an id: it cannot be de-duplicated");
        let settled = delivery
            .park("the message has no id, so a redelivery could not be recognised")
            .await;
        (Outcome::Parked, settled)
    } else {
        match transact(pool, handler, options, msg).await {
            Ok(Verdict::Ack(outcome)) => (outcome, delivery.ack().await),
            Ok(Verdict::Gap) => (Outcome::Gap, delivery.retry(options.gap_delay).await),
            Err(HandlerError::Permanent(why)) => {
                let why = why.to_string();
                tracing::error!(reason = "consumer_message_parked", consumer, %id, %subject, deliveries, %why, "parking a message that cannot be applied");
                (Outcome::Parked, delivery.park(&why).await)
            }
            Err(HandlerError::Retry(why)) if deliveries >= options.max_deliveries => {
                let why = format!("failed {deliveries} deliveries; last error: {why}");
                tracing::error!(reason = "consumer_message_parked", consumer, %id, %subject, deliveries, %why, "parking a message that keeps failing");
                (Outcome::Parked, delivery.park(&why).await)
            }
            Err(HandlerError::Retry(why)) => {
                let delay = crate::backoff(options.backoff, options.max_backoff, deliveries);
                tracing::warn!(reason = "consumer_message_retried", consumer, %id, %subject, deliveries, retry_in_ms = delay.as_millis() as u64, %why);
                (Outcome::Retried, delivery.retry(delay).await)
            }
        }
    };
    let settled = match settled {
        Ok(()) => true,
        Err(err) => {
            tracing::warn!(reason = "consumer_settle_failed", consumer, %id, outcome = outcome.as_str(), %err, "the broker will deliver the message again");
            false
        }
    };
    (outcome, settled)
}

/// The transaction: inbox, ordering guard, handler, commit.
pub(super) async fn transact<H: Handler>(
    pool: &PgPool,
    handler: &H,
    options: &ConsumerOptions,
    msg: &Message,
) -> Result<Verdict, HandlerError> {
    let aggregate = if options.ordering {
        msg.aggregate()?
    } else {
        None
    };
    let mut tx = pool.begin().await?;
    let aggregate_id = aggregate
        .map(|(_, id, _)| id)
        .or_else(|| msg.header(headers::AGGREGATE_ID));
    if Inbox::process(&mut tx, &options.consumer, &msg.id, aggregate_id).await?
        == InboxOutcome::Duplicate
    {
        return Ok(Verdict::Ack(Outcome::Duplicate));
    }
    if let Some((kind, id, sequence)) = aggregate {
        match OrderingGuard::check(&mut tx, &options.consumer, kind, id, sequence).await? {
            Order::Apply => {}
            Order::Stale { .. } => {
                // Keep the inbox row: the next copy is a plain duplicate.
                tx.commit().await?;
                return Ok(Verdict::Ack(Outcome::Stale));
            }
            Order::Gap { .. } => return Ok(Verdict::Gap),
        }
    }
    handler.handle(&mut tx, msg).await?;
    tx.commit().await?;
    Ok(Verdict::Ack(Outcome::Applied))
}

/// What the transaction decided, before the delivery is settled.
pub(super) enum Verdict {
    Ack(Outcome),
    Gap,
}

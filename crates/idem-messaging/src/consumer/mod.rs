//! The consumer runner: effectively-once handling of at-least-once
//! deliveries.
//!
//! For every message a [`Source`] delivers, [`Consumer::run`]:
//!
//! 1. refuses a message without an id (it parks it: without an id it could
//!    never be recognised when it comes again, so it is never handled
//!    unprotected);
//! 2. begins a PostgreSQL transaction and records the id in the inbox
//!    (`idem_postgres::inbox`); a message already recorded is a duplicate:
//!    acknowledged, the handler is not called;
//! 3. when the message carries the relay's `Idem-Aggregate-Type`,
//!    `Idem-Aggregate-Id` and `Idem-Sequence` headers, asks the ordering
//!    guard (`idem_postgres::guard`): an event already applied is dropped
//!    (acknowledged), an event that arrives before its predecessor is
//!    redelivered after [`ConsumerOptions::gap_delay`]. With
//!    [`ConsumerOptions::ordering`] on, one aggregate's deliveries are
//!    handled one after another in the order they came (other aggregates'
//!    beside them, up to [`ConsumerOptions::concurrency`] in all), so an
//!    in-order stream never trips over its own events;
//! 4. runs the [`Handler`] in the same transaction, commits, and only then
//!    acknowledges. A crash after the commit and before the acknowledgement
//!    makes the broker deliver the message again; the inbox row committed
//!    with the change turns that delivery into a duplicate.
//!
//! A handler that fails has its transaction rolled back (nothing of it, not
//! even the inbox row, remains) and the message is redelivered after an
//! exponential backoff with jitter; after [`ConsumerOptions::max_deliveries`]
//! deliveries, or at once for [`HandlerError::Permanent`], it is *parked*:
//! moved to the source's dead-letter subject or queue, with the reason, for
//! an operator to look at. Stopping the runner finishes the messages in
//! hand and takes no new ones; messages it fetched but did not start are
//! redelivered by the broker.
//!
//! Each delivery is handled inside an `idem.consume` span (see
//! [`crate::trace`]), child of the message's `traceparent` when it has a
//! valid one: the handler's own spans, and (feature `otel`) the trace
//! context of what it enqueues in its outbox, continue the trace of the
//! event it handles.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use idem::InboxOutcome;
use idem::store::BoxError;
use idem_postgres::MessagingError;
use idem_postgres::guard::{Order, OrderingGuard};
use idem_postgres::inbox::Inbox;
use idem_postgres::sqlx::{self, PgPool, Postgres, Transaction};
use tokio::task::JoinSet;
use tracing::Instrument as _;
use tracing::field::Empty;

use crate::cause::caused;
use crate::headers;
use crate::trace::{TARGET, TraceContext};

/// A message as the handler sees it, whatever the broker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// The message id (NATS `Nats-Msg-Id`, AMQP `message_id`); for events
    /// from the relay, the row's random event id (`<source>:<row id>` for
    /// rows written before event ids). Empty when the message had none.
    pub id: String,
    /// The subject (NATS) or original routing key (RabbitMQ).
    pub subject: String,
    /// The headers, in the order they came.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub payload: Bytes,
    /// How many times the broker has delivered it, this time included (1 on
    /// the first delivery).
    pub deliveries: u32,
}

impl Message {
    /// The first header called `name` (ASCII case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The payload parsed as JSON; a payload that is not (or not of this
    /// shape) is a [`HandlerError::Permanent`]: it will never parse.
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, HandlerError> {
        serde_json::from_slice(&self.payload)
            .map_err(|e| HandlerError::permanent_with("payload is not the expected JSON", e))
    }

    /// The W3C trace context in the message's `traceparent` and
    /// `tracestate` headers; `None` without a valid `traceparent` (a
    /// malformed one is ignored, as W3C says).
    pub fn trace_context(&self) -> Option<TraceContext> {
        TraceContext::from_headers(self.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())))
    }

    /// The relay's ordering headers: aggregate type, aggregate id and its
    /// sequence number. `Ok(None)` when the message has none of them; an
    /// error when they are incomplete or the sequence is not a number.
    pub fn aggregate(&self) -> Result<Option<(&str, &str, i64)>, HandlerError> {
        let kind = self.header(headers::AGGREGATE_TYPE);
        let id = self.header(headers::AGGREGATE_ID);
        let sequence = self.header(headers::SEQUENCE);
        match (kind, id, sequence) {
            (None, None, None) => Ok(None),
            (Some(kind), Some(id), Some(sequence)) => {
                let sequence = sequence.parse::<i64>().map_err(|_| {
                    HandlerError::permanent(format!(
                        "header {}: {sequence:?} is not a number",
                        headers::SEQUENCE
                    ))
                })?;
                Ok(Some((kind, id, sequence)))
            }
            _ => Err(HandlerError::permanent(format!(
                "incomplete ordering headers: {}, {} and {} go together",
                headers::AGGREGATE_TYPE,
                headers::AGGREGATE_ID,
                headers::SEQUENCE
            ))),
        }
    }
}

/// Why a handler did not apply a message.
///
/// Each kind holds what went wrong: a message, an error (a driver's, a
/// client's), or a message and the error behind it (the `*_with`
/// constructors), whose cause stays reachable as the error's
/// [`source`](std::error::Error::source); `HandlerError::Retry(err.into())`
/// wraps an error as it is (same text, same source). Its text (`why`, or
/// `why: cause`) is what the runner logs and gives as the reason when it
/// parks the message.
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Something that may pass later (a lock timeout, a service down):
    /// the message is redelivered after a backoff.
    #[error(transparent)]
    Retry(BoxError),
    /// The message can never be applied (malformed, refers to nothing):
    /// it is parked at once.
    #[error(transparent)]
    Permanent(BoxError),
}

impl HandlerError {
    /// A failure worth retrying.
    pub fn retry(why: impl Into<String>) -> Self {
        Self::Retry(why.into().into())
    }

    /// A failure no retry will fix.
    pub fn permanent(why: impl Into<String>) -> Self {
        Self::Permanent(why.into().into())
    }

    /// A failure worth retrying, because of `source`: shows as
    /// `why: source`.
    pub fn retry_with(why: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self::Retry(caused(why, source))
    }

    /// A failure no retry will fix, because of `source`: shows as
    /// `why: source`.
    pub fn permanent_with(why: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self::Permanent(caused(why, source))
    }
}

/// A database failure: retried (`database: …`).
impl From<sqlx::Error> for HandlerError {
    fn from(err: sqlx::Error) -> Self {
        Self::retry_with("database", err)
    }
}

/// A refused id or message is permanent; a database failure is retried.
impl From<MessagingError> for HandlerError {
    fn from(err: MessagingError) -> Self {
        match err {
            MessagingError::InvalidMessage { .. } => Self::Permanent(Box::new(err)),
            _ => Self::Retry(Box::new(err)),
        }
    }
}

/// The business change for one message, made inside the runner's
/// transaction (which already holds the message's inbox row). Return
/// `Ok(())` to commit; an error rolls everything back.
pub trait Handler: Send + Sync + 'static {
    /// Applies `msg` using `tx`; do not commit or roll back `tx`.
    fn handle(
        &self,
        tx: &mut Transaction<'static, Postgres>,
        msg: &Message,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// Why settling a delivery with the broker failed (the broker will
/// redeliver the message after its acknowledgement timeout), or why a
/// [`Source`] could not deliver. It shows as `message` or
/// `message: cause`; the broker client's error stays its
/// [`source`](std::error::Error::source).
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct SettleError(BoxError);

impl SettleError {
    /// A failure described by `message`.
    pub fn new(message: impl Into<String>) -> Self {
        Self(message.into().into())
    }

    /// A failure described by `message`, because of `source` (the broker
    /// client's error): shows as `message: source`.
    pub fn with_source(message: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Self(caused(message, source))
    }

    /// `err` as it is (same text, same source), e.g. a failed publish to
    /// a retry or dead-letter queue.
    #[cfg_attr(not(feature = "rabbitmq"), allow(dead_code))]
    pub(crate) fn from_error(err: impl Into<BoxError>) -> Self {
        Self(err.into())
    }
}

/// One delivery, and how to settle it with its broker.
pub trait Delivery: Send + 'static {
    /// The message.
    fn message(&self) -> &Message;

    /// Done with it: the broker may forget it.
    fn ack(self) -> impl Future<Output = Result<(), SettleError>> + Send;

    /// Deliver it again after `delay`.
    fn retry(self, delay: Duration) -> impl Future<Output = Result<(), SettleError>> + Send;

    /// Move it to the dead-letter subject or queue, with `reason`, and
    /// stop delivering it.
    fn park(self, reason: &str) -> impl Future<Output = Result<(), SettleError>> + Send;
}

/// Where deliveries come from: a JetStream pull consumer
/// (`JetStreamSource`, feature `nats`), a RabbitMQ queue (`RabbitSource`,
/// feature `rabbitmq`), or your own.
pub trait Source: Send + 'static {
    /// The source's deliveries.
    type Delivery: Delivery;

    /// The next delivery; `None` when the source is closed for good. A
    /// transient failure (the broker restarting) is an `Err`: the runner
    /// logs it, waits a little and asks again.
    fn next(&mut self) -> impl Future<Output = Option<Result<Self::Delivery, SettleError>>> + Send;

    /// Lets go of the broker once the runner is done, so messages it
    /// received but did not start go back to other consumers at once.
    fn close(self) -> impl Future<Output = ()> + Send
    where
        Self: Sized,
    {
        async {}
    }
}

/// How the runner works.
#[derive(Debug, Clone)]
pub struct ConsumerOptions {
    /// The consumer's name in the inbox and the ordering guard: one per
    /// logical consumer (several replicas share it).
    pub consumer: String,
    /// Messages handled at once (one aggregate's one at a time, with
    /// `ordering`, which holds up to 4 × this many so that other
    /// aggregates' run while one aggregate's later events wait).
    pub concurrency: usize,
    /// Deliveries before a failing message is parked.
    pub max_deliveries: u32,
    /// First retry delay after a handler failure (doubled per delivery,
    /// with jitter).
    pub backoff: Duration,
    /// Longest retry delay.
    pub max_backoff: Duration,
    /// Redelivery delay of an event whose predecessor has not been applied
    /// yet.
    pub gap_delay: Duration,
    /// Apply the ordering guard to messages with the relay's ordering
    /// headers.
    pub ordering: bool,
    /// How long this consumer's inbox rows are kept (deleted in batches of
    /// 1,000 once a minute while the runner runs); `None` keeps them. Keep
    /// it longer than the broker can redeliver a message (JetStream: the
    /// stream's age limit; RabbitMQ: the longest a message can wait), or an
    /// old redelivery would be handled again.
    pub inbox_retention: Option<Duration>,
}

impl ConsumerOptions {
    /// Defaults for the consumer called `consumer`: 16 at once, parked
    /// after 10 deliveries, backoff 200 ms to 30 s, gaps retried after
    /// 200 ms, ordering on, inbox rows kept 7 days.
    pub fn new(consumer: impl Into<String>) -> Self {
        Self {
            consumer: consumer.into(),
            concurrency: 16,
            max_deliveries: 10,
            backoff: Duration::from_millis(200),
            max_backoff: Duration::from_secs(30),
            gap_delay: Duration::from_millis(200),
            ordering: true,
            inbox_retention: Some(Duration::from_secs(7 * 24 * 3600)),
        }
    }
}

/// What became of one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Handled and committed, then acknowledged.
    Applied,
    /// Seen before (inbox): acknowledged, not handled.
    Duplicate,
    /// An event older than the aggregate's applied version: acknowledged,
    /// not handled.
    Stale,
    /// An event ahead of its predecessor: redelivered later.
    Gap,
    /// The handler failed: redelivered after a backoff.
    Retried,
    /// Moved to the dead-letter subject or queue.
    Parked,
}

impl Outcome {
    /// Every outcome, for metrics.
    pub const ALL: [Self; 6] = [
        Self::Applied,
        Self::Duplicate,
        Self::Stale,
        Self::Gap,
        Self::Retried,
        Self::Parked,
    ];

    /// Its `outcome` label in `idem_inbox_messages_total{consumer,outcome}`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Duplicate => "duplicate",
            Self::Stale => "stale",
            Self::Gap => "gap",
            Self::Retried => "retried",
            Self::Parked => "parked",
        }
    }
}

/// Counts of outcomes since the runner started.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ConsumerStats {
    /// Handled and committed.
    pub applied: u64,
    /// Duplicates acknowledged.
    pub duplicates: u64,
    /// Stale events dropped.
    pub stale: u64,
    /// Events redelivered for a gap.
    pub gaps: u64,
    /// Failures redelivered.
    pub retried: u64,
    /// Messages parked.
    pub parked: u64,
    /// Settlements the broker did not take (the message comes again).
    pub settle_failures: u64,
}

impl ConsumerStats {
    fn count(&mut self, outcome: Outcome) {
        let slot = match outcome {
            Outcome::Applied => &mut self.applied,
            Outcome::Duplicate => &mut self.duplicates,
            Outcome::Stale => &mut self.stale,
            Outcome::Gap => &mut self.gaps,
            Outcome::Retried => &mut self.retried,
            Outcome::Parked => &mut self.parked,
        };
        *slot += 1;
    }
}

/// The runner; see the [module docs](self).
#[derive(Debug)]
pub struct Consumer<H> {
    pool: PgPool,
    handler: Arc<H>,
    options: Arc<ConsumerOptions>,
}

/// What the transaction decided, before the delivery is settled.
enum Verdict {
    Ack(Outcome),
    Gap,
}

impl<H: Handler> Consumer<H> {
    /// A runner handling messages with `handler` in transactions on `pool`
    /// (whose database holds the inbox: `idem migrate` or
    /// `PgStore::connect` creates it).
    pub fn new(pool: PgPool, handler: H, options: ConsumerOptions) -> Self {
        Self {
            pool,
            handler: Arc::new(handler),
            options: Arc::new(options),
        }
    }

    /// Handles deliveries from `source` until `stop` completes (then
    /// finishes the messages in hand) or the source closes.
    pub async fn run<S: Source>(
        &self,
        mut source: S,
        stop: impl Future<Output = ()> + Send,
    ) -> ConsumerStats {
        let mut stats = ConsumerStats::default();
        let concurrency = self.options.concurrency.max(1);
        // With lanes, deliveries waiting behind their aggregate's are held
        // too: a look-ahead lets other aggregates' run meanwhile.
        let held = if self.options.ordering {
            concurrency * LOOK_AHEAD
        } else {
            concurrency
        };
        let limit = Arc::new(tokio::sync::Semaphore::new(held));
        let running = Arc::new(tokio::sync::Semaphore::new(concurrency));
        let mut tasks: JoinSet<Vec<(Outcome, bool)>> = JoinSet::new();
        let lanes = Arc::new(std::sync::Mutex::new(Lanes::default()));
        let retention = self.options.inbox_retention.map(|keep| {
            tokio::spawn(purge_inbox(
                self.pool.clone(),
                self.options.consumer.clone(),
                keep,
            ))
        });
        tokio::pin!(stop);
        loop {
            // Take a slot first, so no more is pulled than may be held
            // (what is not pulled is not held).
            let permit = tokio::select! {
                biased;
                () = &mut stop => break,
                Some(done) = tasks.join_next(), if !tasks.is_empty() => {
                    record(&mut stats, &self.options.consumer, done);
                    continue;
                }
                permit = Arc::clone(&limit).acquire_owned() => permit,
            };
            let Ok(permit) = permit else { break };
            let next = tokio::select! {
                biased;
                () = &mut stop => break,
                next = source.next() => next,
            };
            match next {
                None => break,
                Some(Err(err)) => {
                    tracing::warn!(reason = "consumer_source_failed", consumer = %self.options.consumer, %err, "retrying in 1 s");
                    tokio::select! {
                        () = &mut stop => break,
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
                Some(Ok(delivery)) => {
                    let lane = if self.options.ordering {
                        Lanes::<S::Delivery>::of(delivery.message())
                    } else {
                        None
                    };
                    let admitted =
                        lanes
                            .lock()
                            .expect("lanes")
                            .admit(lane.clone(), delivery, permit);
                    if let Some(first) = admitted {
                        self.start(&mut tasks, &lanes, &running, first, lane);
                    }
                }
            }
        }
        // Finish what is in hand, the deliveries waiting in lanes included.
        while let Some(done) = tasks.join_next().await {
            record(&mut stats, &self.options.consumer, done);
        }
        source.close().await;
        if let Some(task) = retention {
            task.abort();
        }
        stats
    }
}

impl<H: Handler> Consumer<H> {
    /// Handles `first` in a task of `tasks`, then, in the same task, each
    /// delivery that waits behind it in its `lane`, until the lane is
    /// empty; each holds its slot until it is handled, and is handled
    /// while holding one of the `running` permits.
    fn start<D: Delivery>(
        &self,
        tasks: &mut JoinSet<Vec<(Outcome, bool)>>,
        lanes: &Arc<std::sync::Mutex<Lanes<D>>>,
        running: &Arc<tokio::sync::Semaphore>,
        first: Waiting<D>,
        lane: Option<Lane>,
    ) {
        let (pool, handler, options, lanes, running) = (
            self.pool.clone(),
            Arc::clone(&self.handler),
            Arc::clone(&self.options),
            Arc::clone(lanes),
            Arc::clone(running),
        );
        tasks.spawn(async move {
            // A panicking handler must not leave its lane busy for good.
            let _free = lane.clone().map(|lane| LaneGuard {
                lanes: Arc::clone(&lanes),
                lane,
            });
            let mut handled = Vec::new();
            let (mut delivery, mut permit) = first;
            loop {
                let run = running.acquire().await.expect("never closed");
                handled.push(handle_one(&pool, &*handler, &options, delivery).await);
                drop((run, permit));
                let next = lane
                    .as_ref()
                    .and_then(|lane| lanes.lock().expect("lanes").release(lane));
                match next {
                    Some(waiting) => (delivery, permit) = waiting,
                    None => return handled,
                }
            }
        });
    }
}

/// Frees a lane whose task ended without emptying it (its handler
/// panicked): what waited there is dropped unsettled, as the panicking
/// delivery is, and the broker delivers it again.
struct LaneGuard<D> {
    lanes: Arc<std::sync::Mutex<Lanes<D>>>,
    lane: Lane,
}

impl<D> Drop for LaneGuard<D> {
    fn drop(&mut self) {
        if std::thread::panicking()
            && let Ok(mut lanes) = self.lanes.lock()
            && let Some(dropped) = lanes.busy.remove(&self.lane)
        {
            tracing::error!(reason = "consumer_task_failed", aggregate = %self.lane.1, waiting = dropped.len(), "a handler panicked; the deliveries waiting behind it are dropped unsettled and come again");
        }
    }
}

/// With ordering on, how many deliveries per unit of concurrency may be
/// held (handled, or waiting behind their aggregate's): a Kafka partition
/// or a stream hands over runs of one aggregate, and without a look-ahead
/// the slots would fill with one aggregate's waiting events.
const LOOK_AHEAD: usize = 4;

/// An aggregate: its type and id.
type Lane = (String, String);

/// One aggregate's deliveries run one after another, in the order the
/// source gave them, while other aggregates' run beside them. Brokers
/// deliver an aggregate's events in order (a Kafka partition holds long
/// runs of one key); handled at once, a later event would find its
/// predecessor uncommitted and come back after `gap_delay` (a gap), so
/// an in-order stream of one aggregate would move at one event per gap
/// delay. A waiting delivery keeps its place among the held ones (at most
/// [`LOOK_AHEAD`] × `concurrency`), not a running slot.
struct Lanes<D> {
    /// The aggregates with a delivery in hand, and what waits behind it.
    busy: std::collections::HashMap<Lane, std::collections::VecDeque<Waiting<D>>>,
}

/// A delivery waiting for its lane, with its slot.
type Waiting<D> = (D, tokio::sync::OwnedSemaphorePermit);

impl<D> Default for Lanes<D> {
    fn default() -> Self {
        Self {
            busy: std::collections::HashMap::new(),
        }
    }
}

impl<D> Lanes<D> {
    /// The lane of `msg`: its ordering headers' aggregate (none without
    /// them, or with broken ones, which the handling reports).
    fn of(msg: &Message) -> Option<Lane> {
        msg.aggregate()
            .ok()
            .flatten()
            .map(|(kind, id, _)| (kind.to_owned(), id.to_owned()))
    }

    /// What to start now: `delivery` itself, unless its lane is busy (it
    /// then waits its turn).
    fn admit(
        &mut self,
        lane: Option<Lane>,
        delivery: D,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) -> Option<Waiting<D>> {
        let Some(lane) = lane else {
            return Some((delivery, permit));
        };
        match self.busy.entry(lane) {
            std::collections::hash_map::Entry::Occupied(mut queue) => {
                queue.get_mut().push_back((delivery, permit));
                None
            }
            std::collections::hash_map::Entry::Vacant(free) => {
                free.insert(std::collections::VecDeque::new());
                Some((delivery, permit))
            }
        }
    }

    /// The next delivery of `lane`, whose last one is done; the lane is
    /// free when none waits.
    fn release(&mut self, lane: &Lane) -> Option<Waiting<D>> {
        let queue = self.busy.get_mut(lane)?;
        let next = queue.pop_front();
        if next.is_none() {
            self.busy.remove(lane);
        }
        next
    }
}

/// Deletes `consumer`'s inbox rows older than `keep`, a batch at a time,
/// once a minute.
async fn purge_inbox(pool: PgPool, consumer: String, keep: Duration) {
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
fn record(
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
fn count(stats: &mut ConsumerStats, consumer: &str, outcome: Outcome, settled: bool) {
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
async fn handle_one<H: Handler, D: Delivery>(
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
fn consume_span(consumer: &str, msg: &Message) -> tracing::Span {
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
async fn handle_and_settle<H: Handler, D: Delivery>(
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
async fn transact<H: Handler>(
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

#[cfg(test)]
mod tests {
    use super::*;

    fn message(headers: &[(&str, &str)]) -> Message {
        Message {
            id: "1".into(),
            subject: "idem.order.OrderPaid".into(),
            headers: headers
                .iter()
                .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
                .collect(),
            payload: Bytes::from_static(br#"{"order_id":"o1"}"#),
            deliveries: 1,
        }
    }

    #[test]
    fn the_trace_context_is_read_from_the_headers() {
        const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(message(&[]).trace_context(), None);
        let cx = message(&[("Traceparent", GOOD), ("tracestate", "rojo=1")])
            .trace_context()
            .expect("valid");
        assert_eq!(cx.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(cx.tracestate(), Some("rojo=1"));
        assert_eq!(
            message(&[("traceparent", &GOOD.to_uppercase())]).trace_context(),
            None,
            "a malformed traceparent is ignored"
        );
    }

    #[test]
    fn an_aggregates_deliveries_wait_for_each_other_in_order() {
        let slots = Arc::new(tokio::sync::Semaphore::new(8));
        let slot = || Arc::clone(&slots).try_acquire_owned().expect("a slot");
        let lane = |id: &str| Some(("order".to_owned(), id.to_owned()));
        let mut lanes = Lanes::default();
        assert_eq!(lanes.admit(lane("a"), 1, slot()).map(|w| w.0), Some(1));
        assert_eq!(lanes.admit(lane("b"), 2, slot()).map(|w| w.0), Some(2));
        assert!(lanes.admit(lane("a"), 3, slot()).is_none(), "a is busy");
        assert!(lanes.admit(lane("a"), 4, slot()).is_none(), "a is busy");
        assert_eq!(lanes.admit(None, 5, slot()).map(|w| w.0), Some(5));
        // The two waiting deliveries keep their slots (the started ones'
        // were dropped here).
        assert_eq!(slots.available_permits(), 6);
        assert_eq!(
            lanes.release(&("order".into(), "a".into())).map(|w| w.0),
            Some(3)
        );
        assert_eq!(
            lanes.release(&("order".into(), "a".into())).map(|w| w.0),
            Some(4)
        );
        assert!(lanes.release(&("order".into(), "a".into())).is_none());
        assert!(lanes.release(&("order".into(), "b".into())).is_none());
        assert!(lanes.busy.is_empty(), "free lanes are forgotten");
        assert_eq!(lanes.admit(lane("a"), 6, slot()).map(|w| w.0), Some(6));
    }

    #[test]
    fn ordering_headers_are_all_or_nothing() {
        assert_eq!(message(&[]).aggregate().ok(), Some(None));
        let full = message(&[
            ("idem-aggregate-type", "order"),
            ("Idem-Aggregate-Id", "o1"),
            ("Idem-Sequence", "7"),
        ]);
        assert_eq!(full.aggregate().ok(), Some(Some(("order", "o1", 7))));
        let partial = message(&[("Idem-Aggregate-Id", "o1")]);
        assert!(matches!(
            partial.aggregate(),
            Err(HandlerError::Permanent(_))
        ));
        let bad = message(&[
            ("Idem-Aggregate-Type", "order"),
            ("Idem-Aggregate-Id", "o1"),
            ("Idem-Sequence", "seven"),
        ]);
        assert!(matches!(bad.aggregate(), Err(HandlerError::Permanent(_))));
    }

    #[test]
    fn errors_read_as_before_and_keep_their_cause() {
        use std::error::Error as _;

        let err = HandlerError::retry("the ledger is down");
        assert!(matches!(err, HandlerError::Retry(_)));
        assert_eq!(err.to_string(), "the ledger is down");
        assert!(err.source().is_none());

        let io = std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out");
        let err = HandlerError::permanent_with("ledger refused", io);
        assert!(matches!(err, HandlerError::Permanent(_)));
        assert_eq!(err.to_string(), "ledger refused: timed out");
        assert!(
            err.source()
                .and_then(|e| e.downcast_ref::<std::io::Error>())
                .is_some()
        );
        let err = HandlerError::retry_with("ledger", "busy");
        assert_eq!(err.to_string(), "ledger: busy");

        // Driver errors are retried, with the driver's error as the cause.
        let err = HandlerError::from(sqlx::Error::PoolTimedOut);
        assert!(matches!(err, HandlerError::Retry(_)));
        assert_eq!(
            err.to_string(),
            format!("database: {}", sqlx::Error::PoolTimedOut)
        );
        assert!(
            err.source()
                .and_then(|e| e.downcast_ref::<sqlx::Error>())
                .is_some()
        );
        // A refused message is permanent and reads as the store's error.
        let refused = MessagingError::InvalidMessage {
            field: "message_id",
            reason: "must not be empty".into(),
        };
        let text = refused.to_string();
        let err = HandlerError::from(refused);
        assert!(matches!(&err, HandlerError::Permanent(e) if e.is::<MessagingError>()));
        assert_eq!(err.to_string(), text);
        let err = HandlerError::from(MessagingError::Database(sqlx::Error::PoolTimedOut));
        assert!(matches!(err, HandlerError::Retry(_)));

        let err = SettleError::with_source("acknowledge", "connection closed");
        assert_eq!(err.to_string(), "acknowledge: connection closed");
        assert!(err.source().is_some());
        let err = SettleError::new("RabbitMQ closed the consumer");
        assert_eq!(err.to_string(), "RabbitMQ closed the consumer");
        assert!(err.source().is_none());
    }

    /// The runner counts every delivery in
    /// `idem_inbox_messages_total{consumer,outcome}` (DESIGN §7).
    #[test]
    fn outcomes_are_counted_per_consumer_in_the_inbox_metric() {
        use std::sync::Mutex;

        use metrics::{
            Counter, CounterFn, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString,
            Unit,
        };

        /// A counter: its name, its labels, its value.
        type Counted = (String, Vec<(String, String)>, u64);
        /// Every counter registered, in order.
        #[derive(Default)]
        struct Counters(Arc<Mutex<Vec<Counted>>>);
        struct One(Arc<Mutex<Vec<Counted>>>, usize);
        impl CounterFn for One {
            fn increment(&self, value: u64) {
                self.0.lock().expect("counters")[self.1].2 += value;
            }
            fn absolute(&self, value: u64) {
                self.0.lock().expect("counters")[self.1].2 = value;
            }
        }
        impl Recorder for Counters {
            fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
            fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
            fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
            fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
                let mut all = self.0.lock().expect("counters");
                let labels = key
                    .labels()
                    .map(|l| (l.key().to_owned(), l.value().to_owned()))
                    .collect();
                all.push((key.name().to_owned(), labels, 0));
                Counter::from_arc(Arc::new(One(Arc::clone(&self.0), all.len() - 1)))
            }
            fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
                Gauge::noop()
            }
            fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
                Histogram::noop()
            }
        }

        let recorder = Counters::default();
        let mut stats = ConsumerStats::default();
        metrics::with_local_recorder(&recorder, || {
            record(&mut stats, "orders", Ok(vec![(Outcome::Applied, true)]));
            record(&mut stats, "orders", Ok(vec![(Outcome::Duplicate, false)]));
        });
        assert_eq!(stats.applied, 1);
        assert_eq!(stats.duplicates, 1);
        assert_eq!(stats.settle_failures, 1);
        let counted = recorder.0.lock().expect("counters").clone();
        let label = |k: &str, v: &str| (k.to_owned(), v.to_owned());
        assert_eq!(
            counted,
            vec![
                (
                    "idem_inbox_messages_total".to_owned(),
                    vec![label("consumer", "orders"), label("outcome", "applied")],
                    1
                ),
                (
                    "idem_inbox_messages_total".to_owned(),
                    vec![label("consumer", "orders"), label("outcome", "duplicate")],
                    1
                ),
            ]
        );
    }

    #[test]
    fn payloads_that_do_not_parse_are_permanent() {
        #[derive(serde::Deserialize)]
        struct Paid {
            order_id: String,
        }
        let ok: Paid = message(&[]).json().expect("parses");
        assert_eq!(ok.order_id, "o1");
        let mut bad = message(&[]);
        bad.payload = Bytes::from_static(b"not json");
        let err = bad.json::<Paid>().err().expect("not JSON");
        assert!(matches!(err, HandlerError::Permanent(_)));
        assert!(
            err.to_string()
                .starts_with("payload is not the expected JSON: "),
            "{err}"
        );
        assert!(
            std::error::Error::source(&err)
                .and_then(|e| e.downcast_ref::<serde_json::Error>())
                .is_some()
        );
    }
}

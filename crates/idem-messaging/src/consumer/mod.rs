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

use idem_postgres::sqlx::PgPool;
use tokio::task::JoinSet;

mod apply;
mod error;
mod handler;
mod lanes;
mod message;
mod options;
mod source;

use apply::*;
pub use error::HandlerError;
pub use handler::Handler;
use lanes::*;
pub use message::Message;
pub use options::{ConsumerOptions, ConsumerStats, Outcome};
pub use source::{Delivery, SettleError, Source};

/// The runner; see the [module docs](self).
#[derive(Debug)]
pub struct Consumer<H> {
    pool: PgPool,
    handler: Arc<H>,
    options: Arc<ConsumerOptions>,
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

#[cfg(test)]
mod tests {
    use bytes::Bytes;
    use idem_postgres::MessagingError;
    use idem_postgres::sqlx;

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

//! What a runner is told, and what it reports: its options, each
//! message's outcome, and the counts.

use std::time::Duration;

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
    pub(super) fn count(&mut self, outcome: Outcome) {
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

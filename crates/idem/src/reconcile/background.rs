//! The background reconciliation: every held record it hears of or
//! finds, asked about with backoff and settled through fenced actions.

use super::*;

/// Most held records a [`Reconciliation`] follows at once; past it, new
/// ones wait for a scan or a client's retry.
pub const MAX_FOLLOWED: usize = 10_000;
/// Lookups a [`Reconciliation`] runs at once.
const CONCURRENT_LOOKUPS: usize = 16;
/// Held records read by one scan at most.
const SCAN_CAP: usize = 10_000;

type RecordId = (String, String, String);

fn id_of(scope: &Scope, key: &IdempotencyKey) -> RecordId {
    (
        scope.tenant().to_owned(),
        scope.operation().to_owned(),
        key.as_str().to_owned(),
    )
}

/// One held record being followed.
#[derive(Debug, Clone)]
struct Job {
    scope: Scope,
    key: IdempotencyKey,
    /// Set when the attempt that left the record held was ours: it is
    /// settled with that lease (no takeover; the attempt number stays).
    lease: Option<Lease>,
    schedule: Schedule,
    began: Instant,
    due: Instant,
    pause: Duration,
    /// Gave up: kept so that scans do not start again, until the record
    /// changes.
    gave_up: bool,
    /// A lookup is running.
    running: bool,
}

impl Job {
    /// A record to follow from `now`, first looked up at `due`.
    fn new(
        scope: &Scope,
        key: &IdempotencyKey,
        lease: Option<Lease>,
        schedule: Schedule,
        now: Instant,
        due: Instant,
    ) -> Self {
        Self {
            scope: scope.clone(),
            key: key.clone(),
            lease,
            schedule,
            began: now,
            due,
            pause: schedule.first,
            gave_up: false,
            running: false,
        }
    }
}

/// Lists processing records, for scans (a store with [`ListRecords`]).
type Lister = Arc<
    dyn Fn(ListFilter) -> Pin<Box<dyn Future<Output = Result<Page, StoreError>> + Send>>
        + Send
        + Sync,
>;

struct Inner<S, R> {
    store: Arc<S>,
    reconciler: R,
    jobs: Mutex<HashMap<RecordId, Job>>,
    /// Apart from the rest, so the loop can wait on it without keeping
    /// the reconciliation alive.
    wake: Arc<Notify>,
    scan: Option<(Lister, Duration)>,
}

impl<S, R> std::fmt::Debug for Inner<S, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reconciliation")
            .field("followed", &lock(&self.jobs).len())
            .field("scan_every", &self.scan.as_ref().map(|(_, every)| every))
            .finish_non_exhaustive()
    }
}

/// Reconciles held records in the background; see the [module docs](super).
///
/// It hears of held records from the code that made or met them
/// ([`hold`](Self::hold), [`held`](Self::held)) and, on a store that can
/// list its records, finds the rest by listing processing records every
/// [`with_scan_every`](Self::with_scan_every) (records left by a process
/// that died, whose clients never came back). Cheap to clone; clones share one set of followed records.
/// Several processes may reconcile the same store: every verdict is fenced
/// to the attempt that was looked up.
#[derive(Debug)]
pub struct Reconciliation<S, R> {
    inner: Arc<Inner<S, R>>,
}

impl<S, R> Clone for Reconciliation<S, R> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<S: ListRecords, R: Reconciler> Reconciliation<S, R> {
    /// Lists processing records every `every` to find held ones nobody
    /// follows (`None`: never, for a store where listing is costly: held
    /// records are then found through [`hold`](Self::hold) and
    /// [`held`](Self::held) only). Call before cloning or spawning.
    pub fn with_scan_every(mut self, every: Option<Duration>) -> Self {
        let store = Arc::clone(&self.inner.store);
        let lister: Lister = Arc::new(move |filter: ListFilter| {
            let store = Arc::clone(&store);
            Box::pin(async move { store.list(&filter).await })
        });
        if let Some(inner) = Arc::get_mut(&mut self.inner) {
            inner.scan = every.map(|every| (lister, every));
        }
        self
    }
}

impl<S: Store, R: Reconciler> Reconciliation<S, R> {
    /// Reconciles records of `store` through `reconciler`. It follows the
    /// held records it is told of; see [`with_scan_every`](Self::with_scan_every)
    /// to find the others too.
    pub fn new(store: Arc<S>, reconciler: R) -> Self {
        Self {
            inner: Arc::new(Inner {
                store,
                reconciler,
                jobs: Mutex::new(HashMap::new()),
                wake: Arc::new(Notify::new()),
                scan: None,
            }),
        }
    }

    /// The reconciler.
    pub fn reconciler(&self) -> &R {
        &self.inner.reconciler
    }

    /// Our own attempt left the record held (its outcome is unknown) and
    /// still owns it under `lease`: follow it, and settle it with that
    /// lease. Returns when the first lookup is due, or `None` when the
    /// reconciler does not cover the record (it is left for an operator)
    /// or too many records are followed already.
    pub fn hold(&self, scope: &Scope, key: &IdempotencyKey, lease: Lease) -> Option<Duration> {
        let schedule = self.inner.reconciler.schedule(scope)?;
        let now = Instant::now();
        let mut jobs = lock(&self.inner.jobs);
        if jobs.len() >= MAX_FOLLOWED {
            drop(jobs);
            tracing::warn!(reason = "idempotency_reconcile_full", tenant = scope.tenant(), operation = scope.operation(), %key, "too many held records followed; this one waits for a scan or a retry");
            return None;
        }
        let job = Job::new(scope, key, Some(lease), schedule, now, now + schedule.first);
        jobs.insert(id_of(scope, key), job);
        drop(jobs);
        self.inner.wake.notify_one();
        Some(schedule.first)
    }

    /// A request found the record held: follow it if it is not followed
    /// yet. Returns how long until the next lookup (for a `Retry-After`),
    /// or `None` when nothing will reconcile it: the reconciler does not
    /// cover it, or gave up on it. It is then held for an operator.
    pub fn held(&self, scope: &Scope, key: &IdempotencyKey) -> Option<Duration> {
        let now = Instant::now();
        let mut jobs = lock(&self.inner.jobs);
        if let Some(job) = jobs.get(&id_of(scope, key)) {
            return (!job.gave_up).then(|| job.due.saturating_duration_since(now));
        }
        let schedule = self.inner.reconciler.schedule(scope)?;
        if jobs.len() >= MAX_FOLLOWED {
            return None;
        }
        jobs.insert(
            id_of(scope, key),
            Job::new(scope, key, None, schedule, now, now),
        );
        drop(jobs);
        self.inner.wake.notify_one();
        Some(Duration::ZERO)
    }

    /// How long until the next lookup of this record, if it is followed
    /// and not given up.
    pub fn next_lookup(&self, scope: &Scope, key: &IdempotencyKey) -> Option<Duration> {
        let jobs = lock(&self.inner.jobs);
        let job = jobs.get(&id_of(scope, key))?;
        (!job.gave_up).then(|| job.due.saturating_duration_since(Instant::now()))
    }

    /// How many held records are followed (given up ones included).
    pub fn followed(&self) -> usize {
        lock(&self.inner.jobs).len()
    }

    /// Runs in a task of its own until every handle to this
    /// reconciliation is dropped.
    pub fn spawn(&self) -> JoinHandle<()> {
        let weak = Arc::downgrade(&self.inner);
        tokio::spawn(run(weak))
    }

    /// Runs the lookups due now (after a scan, when `scan` says so and
    /// scans are set up), then returns; for tests and for callers that
    /// drive it themselves.
    pub async fn run_due(&self, scan: bool) {
        if scan && let Some((lister, _)) = &self.inner.scan {
            scan_once(&self.inner, lister).await;
        }
        run_due(&self.inner).await;
    }
}

/// The background loop: scans now and then, runs what is due, sleeps
/// until the next due lookup or a new held record.
async fn run<S: Store, R: Reconciler>(weak: Weak<Inner<S, R>>) {
    let mut next_scan = Instant::now();
    loop {
        let Some(inner) = weak.upgrade() else { return };
        if let Some((lister, every)) = &inner.scan
            && Instant::now() >= next_scan
        {
            scan_once(&inner, lister).await;
            next_scan = Instant::now() + *every;
        }
        run_due(&inner).await;
        let next_due = lock(&inner.jobs)
            .values()
            .filter(|j| !j.gave_up && !j.running)
            .map(|j| j.due)
            .min();
        let wake_at = match (next_due, inner.scan.as_ref()) {
            (Some(due), Some(_)) => due.min(next_scan),
            (Some(due), None) => due,
            (None, Some(_)) => next_scan,
            (None, None) => Instant::now() + Duration::from_secs(60),
        };
        let wake = Arc::clone(&inner.wake);
        drop(inner);
        let woken = wake.notified();
        // Woken early by a new held record, or at the next due time.
        let _ = tokio::time::timeout_at(wake_at, woken).await;
    }
}

/// Finds held records nobody follows yet (left by a process that died, or
/// by another gateway), and forgets given-up ones that are no longer held.
async fn scan_once<S: Store, R: Reconciler>(inner: &Arc<Inner<S, R>>, lister: &Lister) {
    let now = Timestamp::now();
    let mut filter = ListFilter {
        state: Some(RecordState::Processing),
        limit: 500,
        ..ListFilter::default()
    };
    let mut held = HashSet::new();
    let mut seen = 0;
    loop {
        let page = match lister(filter.clone()).await {
            Ok(page) => page,
            Err(err) => {
                tracing::warn!(reason = "idempotency_reconcile_scan_failed", %err, "cannot list processing records; trying again at the next scan");
                return;
            }
        };
        seen += page.records.len();
        for record in &page.records {
            if !record.lease_live(now) || record.is_outcome_unknown() {
                held.insert(id_of(&record.scope, &record.key));
            }
        }
        {
            let mut jobs = lock(&inner.jobs);
            let at = Instant::now();
            for record in &page.records {
                let id = id_of(&record.scope, &record.key);
                if !held.contains(&id) || jobs.contains_key(&id) || jobs.len() >= MAX_FOLLOWED {
                    continue;
                }
                if let Some(schedule) = inner.reconciler.schedule(&record.scope) {
                    let job = Job::new(&record.scope, &record.key, None, schedule, at, at);
                    jobs.insert(id, job);
                }
            }
        }
        match page.next {
            Some(next) if seen < SCAN_CAP => filter.after = Some(next),
            Some(_) => return,
            None => break,
        }
    }
    // A complete scan: a given-up record no longer held was settled by
    // someone else.
    let mut gone = Vec::new();
    lock(&inner.jobs).retain(|id, job| {
        let keep = !job.gave_up || held.contains(id);
        if !keep {
            gone.push((job.scope.clone(), job.key.clone()));
        }
        keep
    });
    for (scope, key) in gone {
        inner.reconciler.forget(&scope, &key);
    }
}

/// Runs every lookup that is due, a few at a time.
async fn run_due<S: Store, R: Reconciler>(inner: &Arc<Inner<S, R>>) {
    let now = Instant::now();
    let due: Vec<Job> = {
        let mut jobs = lock(&inner.jobs);
        jobs.values_mut()
            .filter(|j| !j.gave_up && !j.running && j.due <= now)
            .map(|j| {
                j.running = true;
                j.clone()
            })
            .collect()
    };
    let mut running = JoinSet::new();
    for job in due {
        while running.len() >= CONCURRENT_LOOKUPS {
            running.join_next().await;
        }
        let inner = Arc::clone(inner);
        running.spawn(async move {
            let next = step(&inner, &job).await;
            let id = id_of(&job.scope, &job.key);
            let mut jobs = lock(&inner.jobs);
            match next {
                Step::Done => {
                    jobs.remove(&id);
                    drop(jobs);
                    inner.reconciler.forget(&job.scope, &job.key);
                }
                Step::Later(at) => {
                    if let Some(j) = jobs.get_mut(&id) {
                        j.running = false;
                        j.due = at;
                        j.pause = (j.pause * 2).min(j.schedule.max_pause);
                    }
                }
                Step::GaveUp => {
                    if let Some(j) = jobs.get_mut(&id) {
                        j.running = false;
                        j.gave_up = true;
                    }
                }
            }
        });
    }
    while running.join_next().await.is_some() {}
}

/// What to do with a followed record after one look.
enum Step {
    /// Settled, or no longer held: forget it.
    Done,
    /// Ask again then.
    Later(Instant),
    /// Stop asking.
    GaveUp,
}

/// Looks one held record up and applies the verdict.
async fn step<S: Store, R: Reconciler>(inner: &Inner<S, R>, job: &Job) -> Step {
    let (scope, key) = (&job.scope, &job.key);
    let store = &*inner.store;
    let backoff = || {
        if job.began.elapsed() >= job.schedule.give_up {
            Step::GaveUp
        } else {
            Step::Later(Instant::now() + job.pause)
        }
    };
    let record = match store.get(scope, key).await {
        Ok(Some(record)) => record,
        Ok(None) => return Step::Done,
        Err(err) => {
            tracing::debug!(reason = "idempotency_reconcile_failed", tenant = scope.tenant(), operation = scope.operation(), %key, %err, "cannot read the held record");
            return backoff();
        }
    };
    let now = Timestamp::now();
    if record.state.is_final() {
        return Step::Done;
    }
    if let Some(lease) = &job.lease
        && (lease.owner != record.lease.owner || lease.attempt != record.lease.attempt)
    {
        // Taken over or settled by someone else since.
        return Step::Done;
    }
    if job.lease.is_none() && record.lease_live(now) && !record.is_outcome_unknown() {
        // An attempt is running it: not held.
        return Step::Done;
    }
    let verdict = match inner.reconciler.reconcile(&record).await {
        Ok(verdict) => verdict,
        Err(err) => {
            tracing::warn!(reason = "idempotency_reconcile_failed", tenant = scope.tenant(), operation = scope.operation(), %key, %err, "the lookup failed; asking again later");
            return give_up_or(inner, &record, job, backoff());
        }
    };
    let expected = Some(record.lease.attempt);
    let applied = match verdict {
        Reconciled::Unknown => return give_up_or(inner, &record, job, backoff()),
        Reconciled::Done(outcome) => {
            settle(store, job, Settled::Completed, Some(&outcome), expected).await
        }
        Reconciled::NotDone => {
            let quiet_since = record.updated_at;
            let believable = quiet_since.plus(job.schedule.settle);
            if now < believable {
                tracing::debug!(reason = "idempotency_reconcile_not_yet", tenant = scope.tenant(), operation = scope.operation(), %key, "not found yet; believed once the record has been quiet for the settle time");
                let wait = believable.since(now).max(Duration::from_millis(10));
                return Step::Later(Instant::now() + wait);
            }
            settle(store, job, Settled::Released, None, expected).await
        }
    };
    match applied {
        Ok(how) => {
            tracing::info!(reason = "idempotency_reconciled", tenant = scope.tenant(), operation = scope.operation(), %key, attempt = record.lease.attempt, result = how.as_str(), held_ms = now.since(record.created_at).as_millis() as u64);
            inner.reconciler.settled(&record, how);
            Step::Done
        }
        Err(OperatorError::LeaseLive { retry_after }) => Step::Later(Instant::now() + retry_after),
        Err(OperatorError::Store(err)) if err.is_transient() => backoff(),
        Err(err) => {
            tracing::info!(reason = "idempotency_reconcile_skipped", tenant = scope.tenant(), operation = scope.operation(), %key, %err);
            Step::Done
        }
    }
}

/// `step` unless the schedule is spent: then the record is left for an
/// operator, loudly.
fn give_up_or<S, R: Reconciler>(
    inner: &Inner<S, R>,
    record: &Record,
    job: &Job,
    step: Step,
) -> Step {
    if matches!(step, Step::GaveUp) {
        tracing::warn!(reason = "idempotency_reconcile_gave_up", tenant = record.scope.tenant(), operation = record.scope.operation(), key = %record.key, attempt = record.lease.attempt, asked_for_secs = job.began.elapsed().as_secs(), "no answer from the lookup; the record stays held for an operator (idem records list --state held)");
        inner.reconciler.settled(record, Settled::GaveUp);
    }
    step
}

/// Records the verdict: with our own lease when the attempt was ours,
/// else as an operator would (fenced to the attempt looked at).
async fn settle<S: Store>(
    store: &S,
    job: &Job,
    how: Settled,
    outcome: Option<&FinalOutcome>,
    expected: Option<u32>,
) -> Result<Settled, OperatorError> {
    let (scope, key) = (&job.scope, &job.key);
    let result = match (&job.lease, outcome) {
        (Some(lease), Some(outcome)) => store.resolve(scope, key, lease, outcome).await,
        (Some(lease), None) => store.release(scope, key, lease).await,
        (None, Some(outcome)) => {
            return operator::resolve(store, scope, key, outcome, expected)
                .await
                .map(|_| how);
        }
        (None, None) => {
            return operator::release(store, scope, key, expected)
                .await
                .map(|_| how);
        }
    };
    match result {
        Ok(()) => Ok(how),
        Err(StoreError::Fenced) => Err(OperatorError::Changed),
        Err(err) => Err(err.into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{
        Fingerprint, LeaseExpiry, MemoryStore, OwnerToken, Reservation, ReserveRequest, Store,
        StoredResponse, Verdict,
    };
    use std::sync::atomic::{AtomicU32, Ordering};

    fn scope(op: &str) -> Scope {
        Scope::new("t", op).expect("scope")
    }

    fn key(k: &str) -> IdempotencyKey {
        k.parse().expect("key")
    }

    async fn reserve(store: &MemoryStore, op: &str, k: &str, lease: Duration) -> Lease {
        match store
            .reserve(ReserveRequest {
                scope: &scope(op),
                key: &key(k),
                fingerprint: Fingerprint::builder().part("body", b"x").finish(),
                owner: OwnerToken::random(),
                lease,
                retention: Duration::from_secs(60),
                on_lease_expiry: LeaseExpiry::Hold,
            })
            .await
            .expect("reserve")
        {
            Reservation::Acquired(lease) => lease,
            other => panic!("{other:?}"),
        }
    }

    /// Answers by key: `charged-*` happened, `never-*` did not, the rest
    /// is unknown. Counts lookups and what was settled.
    #[derive(Default)]
    struct Provider {
        lookups: AtomicU32,
        settled: Mutex<Vec<(String, Settled)>>,
        forgotten: Mutex<Vec<String>>,
    }

    impl Reconciler for Provider {
        async fn reconcile(&self, record: &Record) -> Result<Reconciled, BoxError> {
            self.lookups.fetch_add(1, Ordering::SeqCst);
            let k = record.key.as_str();
            if k.starts_with("charged") {
                Ok(Reconciled::Done(FinalOutcome {
                    verdict: Verdict::Completed,
                    response: StoredResponse::new(201, "charged"),
                    resource_id: None,
                    error_code: None,
                    retention: Duration::from_secs(60),
                }))
            } else if k.starts_with("never") {
                Ok(Reconciled::NotDone)
            } else {
                Err("provider asleep".into())
            }
        }

        fn schedule(&self, scope: &Scope) -> Option<Schedule> {
            (scope.operation() == "pay").then(|| {
                Schedule::default()
                    .with_first(Duration::from_millis(10))
                    .with_max_pause(Duration::from_millis(20))
                    .with_settle(Duration::from_millis(300))
                    .with_give_up(Duration::from_millis(200))
            })
        }

        fn settled(&self, record: &Record, how: Settled) {
            lock(&self.settled).push((record.key.as_str().to_owned(), how));
        }

        fn forget(&self, _scope: &Scope, key: &IdempotencyKey) {
            lock(&self.forgotten).push(key.as_str().to_owned());
        }
    }

    async fn state(store: &MemoryStore, op: &str, k: &str) -> Option<RecordState> {
        store
            .get(&scope(op), &key(k))
            .await
            .expect("get")
            .map(|r| r.state)
    }

    #[tokio::test]
    async fn our_held_attempt_is_completed_with_its_own_lease() {
        let store = Arc::new(MemoryStore::new());
        let lease = reserve(&store, "pay", "charged-1", Duration::from_secs(30)).await;
        store
            .mark_unknown(&scope("pay"), &key("charged-1"), &lease, "timeout")
            .await
            .expect("mark");
        let r = Reconciliation::new(Arc::clone(&store), Provider::default());
        let first = r.hold(&scope("pay"), &key("charged-1"), lease);
        assert_eq!(first, Some(Duration::from_millis(10)));
        let _task = r.spawn();
        for _ in 0..100 {
            if state(&store, "pay", "charged-1").await == Some(RecordState::Completed) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let rec = store
            .get(&scope("pay"), &key("charged-1"))
            .await
            .expect("get")
            .expect("kept");
        assert_eq!(rec.state, RecordState::Completed);
        assert_eq!(
            rec.lease.attempt, 1,
            "settled by its own attempt, not a takeover"
        );
        assert_eq!(rec.response.map(|r| r.status), Some(201));
        assert_eq!(r.followed(), 0);
        assert_eq!(
            *lock(&r.reconciler().settled),
            [("charged-1".to_owned(), Settled::Completed)]
        );
    }

    #[tokio::test]
    async fn not_done_is_believed_only_after_the_settle_time() {
        let store = Arc::new(MemoryStore::new());
        let lease = reserve(&store, "pay", "never-1", Duration::from_secs(30)).await;
        store
            .mark_unknown(&scope("pay"), &key("never-1"), &lease, "timeout")
            .await
            .expect("mark");
        let r = Reconciliation::new(Arc::clone(&store), Provider::default());
        let held = Instant::now();
        r.hold(&scope("pay"), &key("never-1"), lease);
        tokio::time::sleep(Duration::from_millis(20)).await;
        r.run_due(false).await;
        // Judged against when the hold began, not against fixed sleeps: a
        // stall of this test on a loaded machine moves both ends.
        let looked = held.elapsed();
        let lookups = if looked < Duration::from_millis(300) {
            assert_eq!(
                state(&store, "pay", "never-1").await,
                Some(RecordState::Processing),
                "a 'never happened' seen {looked:?} after the attempt is not believed yet"
            );
            let wait = r
                .next_lookup(&scope("pay"), &key("never-1"))
                .expect("followed");
            let due = Instant::now() + wait;
            assert!(
                due >= held + Duration::from_millis(290),
                "next lookup at the settle time: {:?} after the hold",
                due - held
            );
            tokio::time::sleep(wait + Duration::from_millis(10)).await;
            r.run_due(false).await;
            2
        } else {
            // Looked at past the settle time already: believed at once.
            1
        };
        assert_eq!(state(&store, "pay", "never-1").await, None, "released");
        assert_eq!(r.reconciler().lookups.load(Ordering::SeqCst), lookups);
    }

    #[tokio::test]
    async fn orphans_are_found_by_scans_and_unknowns_given_up() {
        let store = Arc::new(MemoryStore::new());
        // Left by a process that died: lapsed leases, nobody follows them.
        for k in ["charged-2", "asleep-1"] {
            reserve(&store, "pay", k, Duration::from_millis(1)).await;
        }
        // Not this reconciler's, and one still running.
        reserve(&store, "other", "charged-3", Duration::from_millis(1)).await;
        reserve(&store, "pay", "charged-live", Duration::from_secs(30)).await;
        tokio::time::sleep(Duration::from_millis(5)).await;
        let r = Reconciliation::new(Arc::clone(&store), Provider::default())
            .with_scan_every(Some(Duration::from_secs(10)));
        r.run_due(true).await;
        assert_eq!(
            state(&store, "pay", "charged-2").await,
            Some(RecordState::Completed)
        );
        let taken = store
            .get(&scope("pay"), &key("charged-2"))
            .await
            .expect("get")
            .expect("kept");
        assert_eq!(taken.lease.attempt, 2, "an orphan is taken over, fenced");
        assert_eq!(
            state(&store, "other", "charged-3").await,
            Some(RecordState::Processing)
        );
        assert_eq!(
            state(&store, "pay", "charged-live").await,
            Some(RecordState::Processing)
        );
        assert_eq!(r.followed(), 1, "only the unknown one is still followed");
        assert!(
            r.held(&scope("other"), &key("charged-3")).is_none(),
            "nothing reconciles it"
        );
        assert!(r.held(&scope("pay"), &key("asleep-1")).is_some());
        // Past give_up, the unknown one is left for an operator.
        tokio::time::sleep(Duration::from_millis(250)).await;
        r.run_due(false).await;
        assert!(
            r.held(&scope("pay"), &key("asleep-1")).is_none(),
            "given up"
        );
        assert_eq!(
            state(&store, "pay", "asleep-1").await,
            Some(RecordState::Processing)
        );
        assert!(lock(&r.reconciler().settled).contains(&("asleep-1".to_owned(), Settled::GaveUp)));
        // A scan does not start it again while it is held.
        r.run_due(true).await;
        assert!(r.held(&scope("pay"), &key("asleep-1")).is_none());
    }

    #[tokio::test]
    async fn a_takeover_since_ends_the_follow() {
        let store = Arc::new(MemoryStore::new());
        let lease = reserve(&store, "pay", "charged-4", Duration::from_millis(1)).await;
        let r = Reconciliation::new(Arc::clone(&store), Provider::default());
        r.hold(&scope("pay"), &key("charged-4"), lease);
        // An operator released it meanwhile.
        store
            .release(&scope("pay"), &key("charged-4"), &lease)
            .await
            .expect("release");
        tokio::time::sleep(Duration::from_millis(15)).await;
        r.run_due(false).await;
        assert_eq!(r.followed(), 0);
        assert_eq!(r.reconciler().lookups.load(Ordering::SeqCst), 0);
        assert_eq!(
            *lock(&r.reconciler().forgotten),
            ["charged-4"],
            "told to forget it"
        );
    }
}

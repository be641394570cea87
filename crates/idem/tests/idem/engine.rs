//! Engine behaviour when things go wrong: store faults while recording,
//! fail-open and fail-closed, duplicates waiting for the first answer, and
//! a fast tier that loses everything.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use idem::{
    Begin, CacheStore, Engine, EngineError, FailMode, InFlight, MemoryStore, Policy, RecordError,
    RecordState, Run, Store, StoredResponse, Tiered,
};
use idem_testkit::conformance::{fp, key, unique_scope};
use idem_testkit::{Op, faulty};

#[tokio::test]
async fn transient_record_failures_are_retried_within_the_bound() {
    let store = Arc::new(faulty(MemoryStore::new()));
    let engine = Engine::from_arc(Arc::clone(&store));
    let (scope, k) = (unique_scope("retry-record"), key("k"));
    let Begin::Execute(guard) = engine.begin(&scope, &k, fp("a")).await.expect("begin") else {
        panic!("executes");
    };
    store.hook().fail_next(Op::Resolve, 2);
    guard
        .complete(StoredResponse::new(201, "ok"))
        .await
        .expect("third try records");
    assert_eq!(store.hook().calls(Op::Resolve), 3);
    let rec = store.get(&scope, &k).await.expect("get").expect("exists");
    assert_eq!(rec.state, RecordState::Completed);
}

#[tokio::test]
async fn an_answer_is_recorded_through_a_store_outage_shorter_than_half_the_lease() {
    let store = Arc::new(faulty(MemoryStore::new()));
    let engine = Engine::from_arc(Arc::clone(&store))
        .with_policy(Policy::default().with_lease(Duration::from_secs(6)));
    let (scope, k) = (unique_scope("outage-record"), key("k"));
    let Begin::Execute(guard) = engine.begin(&scope, &k, fp("a")).await.expect("begin") else {
        panic!("executes");
    };
    // Eight failures in a row: some 1.6 s of a store that is down, more
    // than the four quick tries cover, well within half the 6 s lease.
    store.hook().fail_next(Op::Resolve, 8);
    guard
        .complete(StoredResponse::new(201, "ok"))
        .await
        .expect("recorded once the store is back");
    assert_eq!(store.hook().calls(Op::Resolve), 9);
    let rec = store.get(&scope, &k).await.expect("get").expect("exists");
    assert_eq!(rec.state, RecordState::Completed);
}

#[tokio::test]
async fn work_done_but_not_recordable_is_marked_outcome_unknown() {
    let store = Arc::new(faulty(MemoryStore::new()));
    // A short lease: recording is given up after the tries and half the
    // lease, whichever ends later.
    let engine = Engine::from_arc(Arc::clone(&store)).with_policy(
        Policy::default()
            .with_record_attempts(3)
            .with_lease(Duration::from_millis(100)),
    );
    let (scope, k) = (unique_scope("unknown-record"), key("k"));
    store.hook().fail_next(Op::Resolve, 100);
    let executions = AtomicU32::new(0);
    let run = engine
        .run(&scope, &k, fp("a"), || async {
            executions.fetch_add(1, Ordering::SeqCst);
            StoredResponse::new(201, "charged")
        })
        .await
        .expect("run");
    // The caller still gets the answer of the work that was done...
    let Run::Executed(resp) = run else {
        panic!("expected Executed, got {run:?}")
    };
    assert_eq!(&resp.body[..], b"charged");
    assert_eq!(store.hook().calls(Op::Resolve), 3, "bounded retries");
    // ...and the record says the outcome is unknown, so no retry runs it again.
    let rec = store.get(&scope, &k).await.expect("get").expect("exists");
    assert!(rec.is_outcome_unknown(), "{rec:?}");
    let again = engine
        .run(&scope, &k, fp("a"), || async {
            executions.fetch_add(1, Ordering::SeqCst);
            StoredResponse::new(201, "charged twice")
        })
        .await
        .expect("run");
    assert!(
        matches!(
            again,
            Run::InProgress {
                outcome_unknown: true,
                ..
            }
        ),
        "{again:?}"
    );
    assert_eq!(executions.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_guard_reports_not_recorded_when_even_marking_fails() {
    let store = Arc::new(faulty(MemoryStore::new()));
    let engine = Engine::from_arc(Arc::clone(&store)).with_policy(
        Policy::default()
            .with_record_attempts(2)
            .with_lease(Duration::from_millis(100)),
    );
    let (scope, k) = (unique_scope("not-recorded"), key("k"));
    let Begin::Execute(guard) = engine.begin(&scope, &k, fp("a")).await.expect("begin") else {
        panic!("executes");
    };
    store.hook().fail_next(Op::Resolve, 100);
    store.hook().fail_next(Op::MarkUnknown, 100);
    match guard.complete(StoredResponse::new(200, "x")).await {
        Err(RecordError::NotRecorded {
            marked_unknown,
            source,
        }) => {
            assert!(!marked_unknown);
            assert!(source.is_transient());
        }
        other => panic!("expected NotRecorded, got {other:?}"),
    }
}

#[tokio::test]
async fn fail_closed_refuses_and_fail_open_runs_unprotected() {
    let store = Arc::new(faulty(MemoryStore::new()));
    let (scope, k) = (unique_scope("fail-mode"), key("k"));
    let closed = Engine::from_arc(Arc::clone(&store));
    store.hook().fail_next(Op::Reserve, 1);
    let executions = AtomicU32::new(0);
    let result = closed
        .run(&scope, &k, fp("a"), || async {
            executions.fetch_add(1, Ordering::SeqCst);
            StoredResponse::new(200, "x")
        })
        .await;
    assert!(
        matches!(result, Err(EngineError::Store(ref e)) if e.is_transient()),
        "{result:?}"
    );
    assert_eq!(
        executions.load(Ordering::SeqCst),
        0,
        "fail-closed runs nothing"
    );

    let open = closed
        .clone()
        .with_policy(Policy::default().with_fail_mode(FailMode::Open));
    store.hook().fail_next(Op::Reserve, 1);
    let result = open
        .run(&scope, &k, fp("a"), || async {
            executions.fetch_add(1, Ordering::SeqCst);
            StoredResponse::new(200, "unprotected")
        })
        .await
        .expect("fail-open runs");
    assert!(matches!(result, Run::Unprotected(ref r) if &r.body[..] == b"unprotected"));
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    assert_eq!(
        store.get(&scope, &k).await.expect("get"),
        None,
        "nothing recorded"
    );
}

#[tokio::test]
async fn reject_policy_answers_in_progress_at_once() {
    let engine = Engine::new(MemoryStore::new());
    let (scope, k) = (unique_scope("reject"), key("k"));
    let Begin::Execute(_guard) = engine.begin(&scope, &k, fp("a")).await.expect("begin") else {
        panic!("executes");
    };
    match engine.begin(&scope, &k, fp("a")).await.expect("begin") {
        Begin::InProgress {
            retry_after,
            outcome_unknown,
        } => {
            assert!(
                retry_after > Duration::from_secs(25) && retry_after <= Duration::from_secs(30)
            );
            assert!(!outcome_unknown);
        }
        other => panic!("expected InProgress, got {other:?}"),
    }
}

#[tokio::test]
async fn wait_policy_gives_up_after_its_bound() {
    let engine = Engine::new(MemoryStore::new()).with_policy(
        Policy::default().with_on_in_flight(InFlight::Wait(Duration::from_millis(120))),
    );
    let (scope, k) = (unique_scope("wait-bound"), key("k"));
    let Begin::Execute(_guard) = engine.begin(&scope, &k, fp("a")).await.expect("begin") else {
        panic!("executes");
    };
    let started = std::time::Instant::now();
    let second = engine.begin(&scope, &k, fp("a")).await.expect("begin");
    assert!(matches!(second, Begin::InProgress { .. }), "{second:?}");
    assert!(started.elapsed() >= Duration::from_millis(120));
}

/// 101 duplicates wait on one key: each asks the store at most
/// `MAX_LOOKS` times however long it waits, and once more when the attempt
/// decides; past the cap, the rest are answered at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waiting_duplicates_do_not_poll_the_store() {
    let store = Arc::new(faulty(MemoryStore::new()));
    let engine = Engine::from_arc(Arc::clone(&store))
        .with_policy(Policy::default().with_on_in_flight(InFlight::Wait(Duration::from_secs(10))));
    let (scope, k) = (unique_scope("wait-no-poll"), key("k"));
    let Begin::Execute(first) = engine.begin(&scope, &k, fp("a")).await.expect("begin") else {
        panic!("executes");
    };
    let mut waiting = tokio::task::JoinSet::new();
    for _ in 0..100 {
        let (engine, scope, k) = (engine.clone(), scope.clone(), k.clone());
        waiting.spawn(async move { engine.begin(&scope, &k, fp("a")).await });
    }
    // Long enough that polling would have asked dozens of times each.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let before = store.hook().calls(Op::Reserve);
    first
        .complete(StoredResponse::new(201, "once"))
        .await
        .expect("complete");
    let (mut replays, mut refused) = (0, 0);
    while let Some(done) = waiting.join_next().await {
        match done.expect("task").expect("begin") {
            Begin::Replay(r) => {
                assert_eq!(&r.response.body[..], b"once");
                replays += 1;
            }
            Begin::InProgress { .. } => refused += 1,
            other => panic!("{other:?}"),
        }
    }
    let total = store.hook().calls(Op::Reserve);
    eprintln!("101 callers on one key: {before} reservations in 1.5 s of waiting, {total} in all");
    assert_eq!(
        (replays, refused),
        (
            idem::engine::MAX_WAITERS_PER_KEY,
            100 - idem::engine::MAX_WAITERS_PER_KEY
        ),
        "the waiters past the cap are answered at once"
    );
    let most = idem::engine::MAX_LOOKS;
    assert!(
        before <= 1 + most * 100,
        "{before} reservations while waiting: at most {most} per waiter"
    );
    assert!(
        total - before <= idem::engine::MAX_WAITERS_PER_KEY as u32,
        "{} more after the decision: one per waiter",
        total - before
    );
}

/// An attempt in another process (another engine) does not wake this
/// one's waiters: they see its answer at one of their few looks.
#[tokio::test]
async fn a_waiter_for_another_process_sees_its_answer_in_a_few_looks() {
    let store = Arc::new(faulty(MemoryStore::new()));
    let policy = Policy::default().with_on_in_flight(InFlight::Wait(Duration::from_secs(30)));
    let here = Engine::from_arc(Arc::clone(&store)).with_policy(policy.clone());
    let there = Engine::from_arc(Arc::clone(&store)).with_policy(policy);
    let (scope, k) = (unique_scope("wait-elsewhere"), key("k"));
    let Begin::Execute(first) = there.begin(&scope, &k, fp("a")).await.expect("begin") else {
        panic!("executes");
    };
    let waiter = {
        let (here, scope, k) = (here.clone(), scope.clone(), k.clone());
        tokio::spawn(async move { here.begin(&scope, &k, fp("a")).await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    first
        .complete(StoredResponse::new(201, "there"))
        .await
        .expect("complete");
    let started = store.hook().calls(Op::Reserve);
    match waiter.await.expect("task").expect("begin") {
        Begin::Replay(r) => assert_eq!(&r.response.body[..], b"there"),
        other => panic!("expected the replay, got {other:?}"),
    }
    let looks = store.hook().calls(Op::Reserve) - 1;
    assert!(
        looks <= idem::engine::MAX_LOOKS,
        "{looks} looks ({started} reservations when the answer was recorded)"
    );
}

#[tokio::test]
async fn waiting_duplicate_executes_when_the_first_releases() {
    let engine = Engine::new(MemoryStore::new())
        .with_policy(Policy::default().with_on_in_flight(InFlight::Wait(Duration::from_secs(5))));
    let (scope, k) = (unique_scope("wait-release"), key("k"));
    let Begin::Execute(first) = engine.begin(&scope, &k, fp("a")).await.expect("begin") else {
        panic!("executes");
    };
    let waiter = {
        let (engine, scope, k) = (engine.clone(), scope.clone(), k.clone());
        tokio::spawn(async move { engine.begin(&scope, &k, fp("a")).await })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    first.release().await.expect("release");
    match waiter.await.expect("task").expect("begin") {
        Begin::Execute(guard) => assert_eq!(guard.attempt(), 1),
        other => panic!("expected Execute, got {other:?}"),
    }
}

#[tokio::test]
async fn transient_statuses_release_the_key_and_rerun() {
    let engine = Engine::new(MemoryStore::new());
    let (scope, k) = (unique_scope("release-status"), key("k"));
    let executions = AtomicU32::new(0);
    for expected in [503u16, 201] {
        let run = engine
            .run(&scope, &k, fp("a"), || async {
                let n = executions.fetch_add(1, Ordering::SeqCst);
                StoredResponse::new(if n == 0 { 503 } else { 201 }, "x")
            })
            .await
            .expect("run");
        assert!(
            matches!(run, Run::Executed(ref r) if r.status == expected),
            "{run:?}"
        );
    }
    let run = engine
        .run(&scope, &k, fp("a"), || async {
            StoredResponse::new(500, "never")
        })
        .await
        .expect("run");
    assert!(
        matches!(run, Run::Replayed(ref r) if r.response.status == 201),
        "{run:?}"
    );
    assert_eq!(executions.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn resource_id_and_error_code_are_kept_and_replayed() {
    let engine = Engine::new(MemoryStore::new());
    let (scope, k) = (unique_scope("details"), key("k"));
    let Begin::Execute(mut guard) = engine.begin(&scope, &k, fp("a")).await.expect("begin") else {
        panic!("executes");
    };
    guard.set_resource_id("pay_123");
    guard.set_error_code("card_declined");
    guard
        .fail(StoredResponse::new(422, "declined"))
        .await
        .expect("fail");
    match engine.begin(&scope, &k, fp("a")).await.expect("begin") {
        Begin::Replay(replay) => {
            assert_eq!(replay.state, RecordState::Failed);
            assert_eq!(replay.resource_id.as_deref(), Some("pay_123"));
            assert_eq!(replay.response.status, 422);
        }
        other => panic!("expected Replay, got {other:?}"),
    }
    let rec = engine
        .store()
        .get(&scope, &k)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(rec.error_code.as_deref(), Some("card_declined"));
}

#[tokio::test]
async fn tiered_survives_losing_the_fast_tier_without_a_duplicate() {
    let store = Arc::new(Tiered::new(MemoryStore::new(), MemoryStore::new()));
    let engine = Engine::from_arc(Arc::clone(&store));
    let (scope, k) = (unique_scope("tiered-flush"), key("k"));
    let executions = AtomicU32::new(0);
    let work = || async {
        executions.fetch_add(1, Ordering::SeqCst);
        StoredResponse::new(201, "once")
    };
    assert!(matches!(
        engine.run(&scope, &k, fp("a"), work).await.expect("run"),
        Run::Executed(_)
    ));
    // Replays come from the fast copy.
    assert!(store.fast().get(&scope, &k).await.expect("get").is_some());
    assert!(matches!(
        engine.run(&scope, &k, fp("a"), work).await.expect("run"),
        Run::Replayed(_)
    ));

    // The fast tier forgets everything (restart, FLUSHALL, eviction).
    store.fast().evict(&scope, &k).await.expect("evict");
    assert!(store.fast().is_empty());
    let run = engine.run(&scope, &k, fp("a"), work).await.expect("run");
    assert!(
        matches!(run, Run::Replayed(ref r) if &r.response.body[..] == b"once"),
        "{run:?}"
    );
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    // ...and the replay put the copy back.
    assert!(store.fast().get(&scope, &k).await.expect("get").is_some());

    // A lost fast tier during processing cannot let a duplicate in either.
    let k2 = key("k2");
    let Begin::Execute(_guard) = engine.begin(&scope, &k2, fp("a")).await.expect("begin") else {
        panic!("executes");
    };
    store.fast().evict(&scope, &k2).await.expect("evict");
    assert!(matches!(
        engine.begin(&scope, &k2, fp("a")).await.expect("begin"),
        Begin::InProgress { .. }
    ));
}

#[tokio::test]
async fn memory_purge_deletes_exactly_its_batch() {
    use idem::Purge;
    let engine = Engine::new(MemoryStore::new())
        .with_policy(Policy::default().with_retention(Duration::from_millis(1)));
    let scope = unique_scope("memory-purge");
    for i in 0..7 {
        let run = engine
            .run(&scope, &key(&format!("k{i}")), fp("a"), || async {
                StoredResponse::new(200, "x")
            })
            .await
            .expect("run");
        assert!(matches!(run, Run::Executed(_)));
    }
    let Begin::Execute(_processing) = engine
        .begin(&scope, &key("p"), fp("a"))
        .await
        .expect("begin")
    else {
        panic!("executes");
    };
    tokio::time::sleep(Duration::from_millis(20)).await;
    let store = engine.store();
    assert_eq!(store.len(), 8);
    assert_eq!(store.purge_expired(3).await.expect("purge"), 3);
    assert_eq!(store.purge_expired(3).await.expect("purge"), 3);
    assert_eq!(store.purge_expired(3).await.expect("purge"), 1);
    assert_eq!(store.purge_expired(3).await.expect("purge"), 0);
    assert_eq!(store.len(), 1, "the processing record stays");
}

/// Polls `begin` until it stops answering "in progress"; the first other
/// answer, or `None` if `within` ran out.
async fn first_decision<S: Store>(
    engine: &Engine<S>,
    scope: &idem::Scope,
    k: &idem::IdempotencyKey,
    within: Duration,
) -> Option<Begin<S>> {
    let deadline = tokio::time::Instant::now() + within;
    while tokio::time::Instant::now() < deadline {
        match engine.begin(scope, k, fp("a")).await {
            Ok(Begin::InProgress { .. }) | Err(_) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Ok(other) => return Some(other),
        }
    }
    None
}

/// The retry of a key whose reservation was released: it runs, on a fresh
/// record (not a takeover), well before the default 30 s lease lapses.
async fn retry_owns_a_fresh_record<S: Store>(
    engine: &Engine<S>,
    scope: &idem::Scope,
    k: &idem::IdempotencyKey,
) -> idem::Guard<S> {
    let Some(Begin::Execute(guard)) =
        first_decision(engine, scope, k, Duration::from_secs(5)).await
    else {
        panic!("the retry should own the key well before the 30 s lease lapses");
    };
    assert_eq!(guard.attempt(), 1, "a fresh record, not a takeover");
    guard
}

#[tokio::test]
async fn a_reservation_whose_answer_was_lost_is_released_once_the_store_answers() {
    let store = Arc::new(faulty(MemoryStore::new()));
    // The default 30 s lease: without the check the retry below would be
    // told "in progress" for all of it.
    let engine = Engine::from_arc(Arc::clone(&store));
    let (scope, k) = (unique_scope("lost-ack"), key("k"));
    store.hook().lose_answer_next(Op::Reserve, 1);
    // The store stays unreachable for the first checks too.
    store.hook().fail_next(Op::Get, 3);
    let refused = engine.begin(&scope, &k, fp("a")).await;
    assert!(
        matches!(refused, Err(EngineError::Store(ref e)) if e.is_transient()),
        "{refused:?}"
    );
    let rec = store.hook().inner().get(&scope, &k).await.expect("get");
    assert_eq!(
        rec.map(|r| r.state),
        Some(RecordState::Processing),
        "the reservation did commit"
    );

    let guard = retry_owns_a_fresh_record(&engine, &scope, &k).await;
    assert!(
        store.hook().calls(Op::Get) >= 4,
        "checked through the outage"
    );
    guard
        .complete(StoredResponse::new(201, "once"))
        .await
        .expect("recorded");
}

/// A reservation that committed although the store reported an error
/// that is not transient (a commit hook failing after the commit, say) is
/// checked and released like one whose answer was lost.
#[tokio::test]
async fn a_reservation_reported_failed_for_good_is_still_checked_and_released() {
    let store = Arc::new(faulty(MemoryStore::new()));
    let engine = Engine::from_arc(Arc::clone(&store));
    let (scope, k) = (unique_scope("broken-ack"), key("k"));
    store.hook().break_answer_next(Op::Reserve, 1);
    let refused = engine.begin(&scope, &k, fp("a")).await;
    assert!(
        matches!(refused, Err(EngineError::Store(ref e)) if !e.is_transient()),
        "{refused:?}"
    );
    let guard = retry_owns_a_fresh_record(&engine, &scope, &k).await;
    guard
        .complete(StoredResponse::new(201, "once"))
        .await
        .expect("recorded");
}

/// A check that meets an error retrying may not cure (a driver's protocol
/// error on a connection left mid-statement by the time-out, a refused
/// statement) keeps watching: giving up would leave the key held for the
/// whole lease, and under `LeaseExpiry::Hold` for good.
#[tokio::test]
async fn a_lost_reservation_is_still_released_after_a_check_meets_a_backend_error() {
    let store = Arc::new(faulty(MemoryStore::new()));
    let engine = Engine::from_arc(Arc::clone(&store));
    let (scope, k) = (unique_scope("lost-ack-backend"), key("k"));
    store.hook().lose_answer_next(Op::Reserve, 1);
    store.hook().break_next(Op::Get, 2);
    assert!(engine.begin(&scope, &k, fp("a")).await.is_err());
    let guard = retry_owns_a_fresh_record(&engine, &scope, &k).await;
    assert!(store.hook().calls(Op::Get) >= 3, "checked past the errors");
    guard
        .complete(StoredResponse::new(201, "once"))
        .await
        .expect("recorded");
}

#[tokio::test]
async fn a_live_reservation_of_another_owner_is_never_released_by_the_check() {
    let store = Arc::new(faulty(MemoryStore::new()));
    let engine = Engine::from_arc(Arc::clone(&store));
    let (scope, k) = (unique_scope("lost-ack-other"), key("k"));
    let Begin::Execute(first) = engine.begin(&scope, &k, fp("a")).await.expect("begin") else {
        panic!("executes");
    };
    // A duplicate's reservation attempt fails after reaching the store:
    // the record it finds is the first owner's, which must stay.
    store.hook().lose_answer_next(Op::Reserve, 1);
    assert!(engine.begin(&scope, &k, fp("a")).await.is_err());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(store.hook().calls(Op::Get) >= 1, "the check ran");
    first
        .complete(StoredResponse::new(201, "first"))
        .await
        .expect("the first owner still records");
}

#[tokio::test]
async fn fail_open_keeps_a_reservation_whose_answer_was_lost() {
    let store = Arc::new(faulty(MemoryStore::new()));
    let engine = Engine::from_arc(Arc::clone(&store))
        .with_policy(Policy::default().with_fail_mode(FailMode::Open));
    let (scope, k) = (unique_scope("lost-ack-open"), key("k"));
    store.hook().lose_answer_next(Op::Reserve, 1);
    let ran = engine
        .run(&scope, &k, fp("a"), || async {
            StoredResponse::new(200, "x")
        })
        .await
        .expect("runs unprotected");
    assert!(matches!(ran, Run::Unprotected(_)));
    // The work ran: its record keeps a retry out for the lease.
    assert!(
        first_decision(&engine, &scope, &k, Duration::from_millis(500))
            .await
            .is_none()
    );
}

/// A record written before keyed hashing (its unkeyed tenant, its `v1:`
/// fingerprint) answers a retry that arrives after the upgrade: replayed,
/// never run again, and a different request under its key is a mismatch.
#[tokio::test]
async fn records_written_before_keyed_hashing_still_answer_their_retries() {
    use idem::{Scope, V1Address};
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::from_arc(Arc::clone(&store));
    let op = unique_scope("upgrade").operation().to_owned();
    let (old_scope, new_scope) = (
        Scope::new("unkeyed-tenant", &op).expect("scope"),
        Scope::new("keyed-tenant", &op).expect("scope"),
    );
    let k = key("paid-before-the-upgrade");
    let Begin::Execute(guard) = engine.begin(&old_scope, &k, fp("v1")).await.expect("begin") else {
        panic!("executes");
    };
    guard
        .complete(StoredResponse::new(201, "charged once"))
        .await
        .expect("recorded");
    let earlier = |fingerprint| V1Address {
        scope: old_scope.clone(),
        fingerprint,
    };
    // The retry: the old answer, and the reservation it made is gone.
    match engine
        .begin_accepting_v1(&new_scope, &k, fp("v2"), &earlier(fp("v1")))
        .await
        .expect("begin")
    {
        Begin::Replay(r) => assert_eq!(r.response.body.as_ref(), b"charged once"),
        other => panic!("expected a replay, got {other:?}"),
    }
    assert!(store.get(&new_scope, &k).await.expect("get").is_none());
    // Another request under that key.
    assert!(matches!(
        engine
            .begin_accepting_v1(&new_scope, &k, fp("v2-other"), &earlier(fp("v1-other")))
            .await
            .expect("begin"),
        Begin::Mismatch { .. }
    ));
    // A tenant that did not move (an identity): the record is found in
    // the same scope, where its v1 fingerprint differs from the new one.
    assert!(matches!(
        engine.begin(&old_scope, &k, fp("v2")).await.expect("begin"),
        Begin::Mismatch { .. }
    ));
    let same = V1Address {
        scope: old_scope.clone(),
        fingerprint: fp("v1"),
    };
    assert!(matches!(
        engine
            .begin_accepting_v1(&old_scope, &k, fp("v2"), &same)
            .await
            .expect("begin"),
        Begin::Replay(_)
    ));
    // No earlier record: runs, as begin would.
    assert!(matches!(
        engine
            .begin_accepting_v1(&new_scope, &key("fresh"), fp("v2"), &earlier(fp("v1")))
            .await
            .expect("begin"),
        Begin::Execute(_)
    ));
}

/// A record written by the version before exact JSON numbers (its `v2:`
/// fingerprint) answers its retry once the `v3:` fingerprint mismatches
/// it: replayed; another request under that key stays a mismatch.
#[tokio::test]
async fn records_written_before_exact_numbers_still_answer_their_retries() {
    let store = Arc::new(MemoryStore::new());
    let engine = Engine::from_arc(Arc::clone(&store));
    let scope = unique_scope("v2-upgrade");
    let k = key("paid-under-v2");
    let Begin::Execute(guard) = engine.begin(&scope, &k, fp("v2")).await.expect("begin") else {
        panic!("executes");
    };
    guard
        .complete(StoredResponse::new(201, "charged once"))
        .await
        .expect("recorded");
    let Begin::Mismatch { state } = engine.begin(&scope, &k, fp("v3")).await.expect("begin") else {
        panic!("the v3 fingerprint differs");
    };
    match engine
        .recheck_mismatch(&scope, &k, state, fp("v2"))
        .await
        .expect("recheck")
    {
        Begin::Replay(r) => assert_eq!(r.response.body.as_ref(), b"charged once"),
        other => panic!("expected a replay, got {other:?}"),
    }
    assert!(matches!(
        engine
            .recheck_mismatch(&scope, &k, state, fp("v2-other"))
            .await
            .expect("recheck"),
        Begin::Mismatch { .. }
    ));
}

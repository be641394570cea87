//! Through the engine: one execution per key, heartbeats, and a guard
//! dropped without a decision.

use super::*;

/// Through the engine: many concurrent callers of one key run the work
/// exactly once; with `InFlight::Wait`, all the others get the replay.
pub async fn engine_runs_work_once<S: Store>(store: Arc<S>) {
    const CALLERS: usize = 64;
    let scope = unique_scope("engine");
    let k = key("once");
    let engine = Engine::from_arc(store)
        .with_policy(Policy::default().with_on_in_flight(InFlight::Wait(Duration::from_secs(10))));
    let executions = Arc::new(AtomicU32::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(CALLERS));
    let mut tasks = JoinSet::new();
    for _ in 0..CALLERS {
        let (engine, scope, k, executions, barrier) = (
            engine.clone(),
            scope.clone(),
            k.clone(),
            Arc::clone(&executions),
            Arc::clone(&barrier),
        );
        tasks.spawn(async move {
            barrier.wait().await;
            engine
                .run(&scope, &k, fp("same"), || async {
                    executions.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    StoredResponse::new(201, "made")
                })
                .await
                .expect("run")
        });
    }
    let (mut executed, mut replayed) = (0, 0);
    while let Some(joined) = tasks.join_next().await {
        match joined.expect("task") {
            Run::Executed(r) => {
                assert_eq!(&r.body[..], b"made");
                executed += 1;
            }
            Run::Replayed(r) => {
                assert_eq!(&r.response.body[..], b"made");
                replayed += 1;
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(executions.load(Ordering::SeqCst), 1);
    assert_eq!((executed, replayed), (1, CALLERS - 1));
}

/// Through the engine: a heartbeat keeps slow work's record from being
/// taken over; without one, the lapsed lease is taken over under `Retry`
/// (a re-run, said so on the guard) and the stale owner's answer is
/// refused.
pub async fn engine_heartbeat_protects_slow_work<S: Store>(store: Arc<S>) {
    // The heartbeat renews every third of the lease, so each renewal has
    // two thirds of it to land: 1 s here, not the 200 ms of a
    // [`SHORT_LEASE`], which one stalled fsync on a loaded machine spends.
    const HEARTBEAT_LEASE: Duration = Duration::from_millis(1500);
    let scope = unique_scope("heartbeat");
    let beating = Engine::from_arc(Arc::clone(&store)).with_policy(
        Policy::default()
            .with_lease(HEARTBEAT_LEASE)
            .with_on_lease_expiry(LeaseExpiry::Retry),
    );
    let engine = Engine::from_arc(store).with_policy(
        Policy::default()
            .with_lease(SHORT_LEASE)
            .with_on_lease_expiry(LeaseExpiry::Retry),
    );

    let k = key("slow-with-heartbeat");
    let idem::Begin::Execute(mut guard) = beating.begin(&scope, &k, fp("a")).await.expect("begin")
    else {
        panic!("first begin executes");
    };
    guard.keep_alive();
    tokio::time::sleep(HEARTBEAT_LEASE * 3).await;
    assert!(matches!(
        beating.begin(&scope, &k, fp("a")).await.expect("begin"),
        idem::Begin::InProgress { .. }
    ));
    assert!(!guard.lease_lost());
    guard
        .complete(StoredResponse::new(200, "slow"))
        .await
        .expect("complete");

    let k = key("slow-without-heartbeat");
    let idem::Begin::Execute(zombie) = engine.begin(&scope, &k, fp("a")).await.expect("begin")
    else {
        panic!("first begin executes");
    };
    tokio::time::sleep(PAST_SHORT_LEASE).await;
    let idem::Begin::Execute(second) = engine.begin(&scope, &k, fp("a")).await.expect("begin")
    else {
        panic!("lapsed lease is taken over");
    };
    assert_eq!(second.attempt(), 2);
    let rerun = second.rerun().expect("a takeover is a re-run");
    assert_eq!(
        (rerun.attempt, rerun.reason),
        (2, idem::RerunReason::LeaseLapsed)
    );
    assert!(rerun.held_for.is_some_and(|d| d >= SHORT_LEASE));
    assert!(matches!(
        zombie.complete(StoredResponse::new(200, "zombie")).await,
        Err(idem::RecordError::LeaseLost)
    ));
    second
        .complete(StoredResponse::new(200, "second"))
        .await
        .expect("complete");
    let rec = engine
        .store()
        .get(&scope, &k)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(
        rec.response.map(|r| r.body),
        Some(Bytes::from_static(b"second"))
    );
}

/// Through the engine: a guard dropped without a decision (a crash, a
/// cancelled request) keeps the record. By default its lapsed lease holds
/// it (the outcome is unknown, nothing runs again); under `Retry` the
/// next attempt takes it over.
pub async fn engine_dropped_guard_keeps_record<S: Store>(store: Arc<S>) {
    let scope = unique_scope("dropped");
    let policy = Policy::default().with_lease(SHORT_LEASE);
    let held = Engine::from_arc(Arc::clone(&store)).with_policy(policy.clone());
    let retry =
        Engine::from_arc(store).with_policy(policy.with_on_lease_expiry(LeaseExpiry::Retry));
    for (k, engine) in [("dropped-held", &held), ("dropped-retry", &retry)] {
        let k = key(k);
        match engine.begin(&scope, &k, fp("a")).await.expect("begin") {
            idem::Begin::Execute(mut guard) => {
                guard.keep_alive();
                drop(guard);
            }
            other => panic!("expected Execute, got {other:?}"),
        }
        assert!(matches!(
            engine.begin(&scope, &k, fp("a")).await.expect("begin"),
            idem::Begin::InProgress {
                outcome_unknown: false,
                ..
            }
        ));
    }
    tokio::time::sleep(PAST_SHORT_LEASE).await;
    match held
        .begin(&scope, &key("dropped-held"), fp("a"))
        .await
        .expect("begin")
    {
        idem::Begin::InProgress {
            outcome_unknown, ..
        } => assert!(outcome_unknown, "held: its owner stopped renewing"),
        other => panic!("the default never runs it again, got {other:?}"),
    }
    match retry
        .begin(&scope, &key("dropped-retry"), fp("a"))
        .await
        .expect("begin")
    {
        idem::Begin::Execute(guard) => assert_eq!(guard.attempt(), 2),
        other => panic!("expected a takeover, got {other:?}"),
    }
}

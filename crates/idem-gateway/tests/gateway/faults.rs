//! Network faults on the gateway's links, through the fault proxy: a slow
//! upstream link past the lease, an upstream answer that breaks off, and a
//! store that goes silent (black hole) or slow — on PostgreSQL and Redis.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use idem_testkit::client::{Answer, metric, send, until_status};
use idem_testkit::fault::FaultProxy;
use idem_testkit::gateway::{GatewayProcess as Gateway, sqlite_store};
use idem_testkit::services;
use idem_testkit::upstream::CountingUpstream;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");

const CONFIG: &str = r#"
store_timeout = "1s"

[defaults]
lease = "1s"
upstream_timeout = "15s"

[[route]]
method = "POST"
path = "/v1/payments"
require_key = true

[[route]]
method = "POST"
path = "/v1/open"
require_key = true
on_store_error = "open"
"#;

fn unique(label: &str) -> String {
    format!("{label}-{}", idem::OwnerToken::random())
}

fn headers<'a>(auth: &'a str, key: &'a str) -> [(&'a str, &'a str); 3] {
    [
        ("content-type", "application/json"),
        ("authorization", auth),
        ("idempotency-key", key),
    ]
}

/// `idem_requests_total` with this outcome, summed over routes.
async fn counted(gw: &Gateway, outcome: &str) -> f64 {
    metric(
        gw.admin,
        "idem_requests_total",
        &format!("outcome=\"{outcome}\""),
    )
    .await
}

/// `POST path` with an empty JSON object, this tenant and key.
async fn post(addr: SocketAddr, path: &str, auth: &str, key: &str) -> Answer {
    send(addr, Method::POST, path, &headers(auth, key), "{}").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_link_slower_than_the_lease_does_not_run_the_work_twice() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let link = FaultProxy::start(up.addr()).await;
    let upstream = format!("http://{}", link.addr());
    let gw = Gateway::builder(IDEM, dir.path())
        .config(CONFIG)
        .upstream(&upstream)
        .store(&sqlite_store(dir.path()))
        .start()
        .await;
    let auth = "Bearer slow-link";

    // Each chunk waits 1.2–1.5 s each way: the answer takes well over the
    // 1 s lease, which the gateway's heartbeat keeps renewing.
    link.set_latency(Duration::from_millis(1200), Duration::from_millis(300));
    let addr = gw.addr;
    let first = tokio::spawn(async move { post(addr, "/v1/payments", auth, "slow-1").await });
    // The upstream has it after 1.2 s or more, past the lease; its answer
    // is as long again on the way back.
    up.until_received("slow-1").await;
    let retry = post(addr, "/v1/payments", auth, "slow-1").await;
    assert_eq!(retry.status, StatusCode::CONFLICT, "{:?}", retry.body);
    assert_eq!(retry.problem_type(), "idempotency-request-in-progress");
    let first = first.await.expect("join");
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);

    link.restore();
    let replay = post(addr, "/v1/payments", auth, "slow-1").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        replay.body, first.body,
        "the original answer, byte for byte"
    );
    assert_eq!(up.executions("slow-1"), 1);
    gw.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upstream_answer_that_breaks_off_is_outcome_unknown_and_not_rerun() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let link = FaultProxy::start(up.addr()).await;
    let upstream = format!("http://{}", link.addr());
    let config = CONFIG.replace("lease = \"1s\"", "lease = \"30s\"");
    let gw = Gateway::builder(IDEM, dir.path())
        .config(&config)
        .upstream(&upstream)
        .store(&sqlite_store(dir.path()))
        .log("error")
        .start()
        .await;
    let auth = "Bearer broken-answers";

    // Broken inside the status line and headers, then inside a 5 KB body.
    for (key, after, size) in [("cut-head", 40, "0"), ("cut-body", 600, "5000")] {
        link.reset_responses_after(Some(after));
        let mut h = headers(auth, key).to_vec();
        h.push(("x-size", size));
        let broken = send(gw.addr, Method::POST, "/v1/payments", &h, "{}").await;
        assert_eq!(
            broken.status,
            StatusCode::BAD_GATEWAY,
            "{key}: {:?}",
            broken.body
        );
        assert_eq!(broken.problem_type(), "upstream-response-broken");
        assert_eq!(up.executions(key), 1, "{key}: the upstream did the work");

        // The work may have happened: a retry is not run again while the
        // record's outcome is unknown.
        link.reset_responses_after(None);
        let retry = send(gw.addr, Method::POST, "/v1/payments", &h, "{}").await;
        assert_eq!(
            retry.status,
            StatusCode::CONFLICT,
            "{key}: {:?}",
            retry.body
        );
        assert!(
            String::from_utf8_lossy(&retry.body).contains("may have taken effect"),
            "{key}: {:?}",
            retry.body
        );
        assert_eq!(up.executions(key), 1, "{key}: not run twice");
    }
    assert_eq!(counted(&gw, "outcome_unknown").await, 2.0);
    gw.terminate().await;
}

/// A store link that turns slow, then silent, then comes back: slow is
/// only slower; silent costs each request at most the store time-out
/// (fail-closed: `503`, nothing forwarded; fail-open: forwarded, marked
/// and counted); back, protection resumes without a restart. `extra`:
/// store URL options.
async fn a_store_link_slow_then_silent_then_back(store_url: &str, label: &str, extra: &str) {
    let link = FaultProxy::start(services::socket_addr(store_url)).await;
    let store = services::via(store_url, link.addr(), extra);
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = Gateway::builder(IDEM, dir.path())
        .config(CONFIG)
        .upstream(&up.url())
        .store(&store)
        .log("error")
        .start()
        .await;
    let auth = format!("Bearer {}", unique(label));
    let auth = auth.as_str();

    let ok = post(gw.addr, "/v1/payments", auth, "before").await;
    assert_eq!(ok.status, StatusCode::CREATED, "{label}: {:?}", ok.body);

    // Slow: 30–70 ms per chunk each way (an operation is a few chunks),
    // inside the 1 s time-out.
    link.set_latency(Duration::from_millis(30), Duration::from_millis(40));
    let slow = post(gw.addr, "/v1/payments", auth, "slow").await;
    assert_eq!(slow.status, StatusCode::CREATED, "{label}: {:?}", slow.body);
    let again = post(gw.addr, "/v1/payments", auth, "slow").await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"), "{label}");
    link.restore();

    // Silent.
    link.blackhole();
    let started = Instant::now();
    let closed = post(gw.addr, "/v1/payments", auth, "silent").await;
    let took = started.elapsed();
    assert_eq!(
        closed.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{label}: {:?}",
        closed.body
    );
    assert_eq!(closed.problem_type(), "idempotency-store-unavailable");
    assert!(closed.header("retry-after").is_some());
    assert!(
        took < Duration::from_secs(10),
        "{label}: answered after {took:?}"
    );
    assert_eq!(
        up.executions("silent"),
        0,
        "{label}: fail-closed forwards nothing"
    );
    let unprotected_before = counted(&gw, "unprotected").await;
    let open = post(gw.addr, "/v1/open", auth, "open-1").await;
    assert_eq!(open.status, StatusCode::CREATED, "{label}: {:?}", open.body);
    assert_eq!(open.header("idempotency-status"), Some("unprotected"));
    assert_eq!(up.executions("open-1"), 1);
    assert_eq!(counted(&gw, "unprotected").await, unprotected_before + 1.0);

    // Back: the held connections are reset, the pool replaces them.
    link.restore();
    let back = until_status(
        async || post(gw.addr, "/v1/payments", auth, "silent").await,
        StatusCode::CREATED,
    )
    .await;
    assert_eq!(back.header("idempotent-replayed"), None, "{label}");
    let replay = post(gw.addr, "/v1/payments", auth, "silent").await;
    assert_eq!(
        replay.header("idempotent-replayed"),
        Some("true"),
        "{label}"
    );
    assert_eq!(up.executions("silent"), 1, "{label}");
    gw.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_postgres_link_slow_then_silent_then_back() {
    let Some(pg) = services::postgres() else {
        return;
    };
    // No ping before reuse (it would run into the pool's acquire time-out
    // first): the query itself meets the silence, and only the gateway's
    // store time-out stands between it and a hung request.
    a_store_link_slow_then_silent_then_back(&pg, "postgres", "ping_after_idle_ms=600000").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redis_link_slow_then_silent_then_back() {
    let Some(redis) = services::redis() else {
        return;
    };
    a_store_link_slow_then_silent_then_back(&redis, "redis", "").await;
}

/// A reservation that reaches the store only after the gateway gave up on
/// it (the store time-out answered `503`) commits with nobody to run it.
/// The gateway that sent it releases it once the store answers again, so
/// the key is free long before the 120 s lease would lapse. A second
/// gateway on a direct link shows the orphan was really there.
async fn a_reservation_committed_after_its_time_out_is_released(
    store_url: &str,
    label: &str,
    extra: &str,
) {
    let link = FaultProxy::start(services::socket_addr(store_url)).await;
    let slow_store = services::via(store_url, link.addr(), extra);
    let config = CONFIG.replace("lease = \"1s\"", "lease = \"120s\"");
    let (dir_a, dir_b) = (
        tempfile::tempdir().expect("dir"),
        tempfile::tempdir().expect("dir"),
    );
    let up = CountingUpstream::start().await;
    let a = Gateway::builder(IDEM, dir_a.path())
        .config(&config)
        .upstream(&up.url())
        .store(&slow_store)
        // The engine's warnings (a check of the lost reservation that
        // failed) show in a failing run's output.
        .log("error,idem=warn")
        .start()
        .await;
    let b = Gateway::builder(IDEM, dir_b.path())
        .config(&config)
        .upstream(&up.url())
        .store(store_url)
        .log("error")
        .start()
        .await;
    let auth = format!("Bearer {}", unique(label));
    let auth = auth.as_str();
    // The warm-up prepares the reservation statement on a's one
    // connection. a's start-up jobs (the census of processing records,
    // cleanup) share that connection and may hold it past the 1 s store
    // time-out on a big, busy database: a refused warm-up is tried again
    // with a fresh key.
    let mut warmed = false;
    for attempt in 0..10 {
        let warm = post(a.addr, "/v1/payments", auth, &format!("warm-{attempt}")).await;
        if warm.status == StatusCode::CREATED {
            warmed = true;
            if attempt > 0 {
                // A refused reservation is watched for 5 s (the engine's
                // settle time) by checks on that same connection; once
                // the link is slow, one of them would hold it.
                tokio::time::sleep(Duration::from_secs(7)).await;
            }
            break;
        }
        assert_eq!(
            warm.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{label}: {:?}",
            warm.body
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(warmed, "{label}: the warm-up never got through");

    // The pool checks each connection it takes back with a round trip of
    // its own, which outlives the request. Set the delay while that check
    // is still on the line and the connection stays busy for seconds: the
    // late request then waits for it, times out before it sends anything,
    // and no reservation ever lands. So the delay goes on once the line is
    // quiet; and where a loaded machine still kept the late request from
    // being sent (b then finds its key free, and rightly runs it), the
    // scenario runs again with a fresh key.
    let mut late = None;
    for attempt in 0..5 {
        let key = format!("late-{attempt}");
        link.quiet_for(Duration::from_millis(250)).await;
        // 1.5 s each way: the reservation lands half a second after the
        // 1 s store time-out refused the request.
        link.set_latency(Duration::from_millis(1500), Duration::ZERO);
        let refused = post(a.addr, "/v1/payments", auth, &key).await;
        assert_eq!(
            refused.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{label}: {:?}",
            refused.body
        );
        tokio::time::sleep(Duration::from_secs(2)).await;
        let held = post(b.addr, "/v1/payments", auth, &key).await;
        if held.status == StatusCode::CONFLICT {
            late = Some(key);
            break;
        }
        assert_eq!(
            held.status,
            StatusCode::CREATED,
            "{label}: the late reservation holds the key, or never reached the store: {:?}",
            held.body
        );
        eprintln!("{label}: attempt {attempt}: the late request never reached the store; again");
        link.restore();
        tokio::time::sleep(Duration::from_secs(7)).await;
    }
    let key = late.unwrap_or_else(|| panic!("{label}: no late reservation landed in 5 tries"));
    let key = key.as_str();

    // Freed within until_status's ~10 s, far inside the lease.
    link.restore();
    let freed = until_status(
        async || post(b.addr, "/v1/payments", auth, key).await,
        StatusCode::CREATED,
    )
    .await;
    assert_eq!(freed.header("idempotent-replayed"), None, "{label}");
    assert_eq!(up.executions(key), 1, "{label}: run once, by b");
    a.terminate().await;
    b.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_postgres_reservation_is_released() {
    let Some(pg) = services::postgres() else {
        return;
    };
    // One connection, which the warm-up prepared the reservation
    // statement on: the late request is a single message on the link
    // (a fresh connection would first wait for its statement to be
    // prepared, and time out before sending the reservation at all).
    a_reservation_committed_after_its_time_out_is_released(
        &pg,
        "postgres-late",
        "ping_after_idle_ms=600000&max_connections=1",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_late_redis_reservation_is_released() {
    let Some(redis) = services::redis() else {
        return;
    };
    a_reservation_committed_after_its_time_out_is_released(&redis, "redis-late", "").await;
}

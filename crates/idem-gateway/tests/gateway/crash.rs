//! The gateway SIGKILLed under load, ten times, on the embedded store:
//! clients that retry with the same key all get an answer, every answer a
//! client got is the one every later retry gets (no acknowledged record is
//! lost), and a key runs upstream more than once only when a kill caught
//! it between forwarding and recording (the lease then lets a retry take
//! it over, and the forwarded key lets the upstream absorb the repeat).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::http::{Method, StatusCode};
use idem_testkit::client::try_send;
use idem_testkit::gateway::{GatewayProcess as Gateway, sqlite_store};
use idem_testkit::upstream::CountingUpstream;
use tokio::sync::RwLock;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");
const KEYS: usize = 400;
const KILLS: usize = 10;

// The counting upstream stands for one that deduplicates by the forwarded
// key, so a kill mid-request may be run again (the opt-in): the test shows
// no acknowledged answer is lost. Under the default (hold) such keys would
// wait for an operator, which `reruns.rs` covers.
const CONFIG: &str = r#"
[defaults]
lease = "1s"
upstream_timeout = "2s"
on_lease_expiry = "retry"

[[route]]
method = "POST"
path = "/v1/payments"
require_key = true
"#;

/// Sends the payment for `key` until the gateway answers 201 (retrying
/// refusals, 409s, 5xx and connection errors with the same key); returns
/// the body.
async fn pay(gateway: &RwLock<SocketAddr>, key: &str) -> bytes::Bytes {
    for attempt in 0..3000 {
        let addr = *gateway.read().await;
        let sent = tokio::time::timeout(
            Duration::from_secs(3),
            try_send(
                addr,
                Method::POST,
                "/v1/payments",
                &[
                    ("idempotency-key", key),
                    ("authorization", "Bearer crash-test"),
                    ("content-type", "application/json"),
                    ("x-delay-ms", "30"),
                ],
                r#"{"amount_cents":100}"#,
            ),
        )
        .await;
        match sent {
            Ok(Ok(r)) if r.status == StatusCode::CREATED => return r.body,
            Ok(Ok(r)) if r.status == StatusCode::CONFLICT || r.status.is_server_error() => {}
            Ok(Ok(r)) => panic!("{key}: unexpected {}", r.status),
            Ok(Err(_)) | Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(20 + (attempt % 4) * 20)).await;
    }
    panic!("{key}: never answered");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkilled_ten_times_under_load_nothing_acknowledged_is_lost() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = sqlite_store(dir.path());
    let up = CountingUpstream::start().await;
    let upstream = up.url();
    let start = || {
        Gateway::builder(IDEM, dir.path())
            .config(CONFIG)
            .upstream(&upstream)
            .store(&store)
            .log("error")
            .start()
    };
    let mut gateway = start().await;
    let current = Arc::new(RwLock::new(gateway.addr));

    // Sixteen clients at a time; new keys keep coming until the last
    // kill, so that every kill lands under load however fast the gateway
    // comes back (at least KEYS keys in all).
    let stop = Arc::new(AtomicBool::new(false));
    let clients = tokio::spawn({
        let (current, stop) = (Arc::clone(&current), Arc::clone(&stop));
        async move {
            let limit = Arc::new(tokio::sync::Semaphore::new(16));
            let mut tasks = tokio::task::JoinSet::new();
            let mut i = 0;
            while i < KEYS || !stop.load(Ordering::SeqCst) {
                let slot = Arc::clone(&limit).acquire_owned().await.expect("open");
                let current = Arc::clone(&current);
                let key = format!("crash-key-{i}");
                tasks.spawn(async move {
                    let body = pay(&current, &key).await;
                    drop(slot);
                    (key, body)
                });
                i += 1;
            }
            let mut answers = HashMap::new();
            while let Some(r) = tasks.join_next().await {
                let (key, body) = r.expect("client");
                answers.insert(key, body);
            }
            answers
        }
    });

    let mut kills = 0;
    while kills < KILLS {
        tokio::time::sleep(Duration::from_millis(200)).await;
        gateway.kill().await;
        gateway = start().await;
        *current.write().await = gateway.addr;
        kills += 1;
    }
    stop.store(true, Ordering::SeqCst);
    let answers = clients.await.expect("clients");
    assert!(answers.len() >= KEYS, "{} keys", answers.len());

    // Every answer a client got is what a retry gets now, from the store.
    // Asked sixteen at a time, as they were sent.
    let addr = Arc::new(RwLock::new(*current.read().await));
    let mut asked = tokio::task::JoinSet::new();
    let limit = Arc::new(tokio::sync::Semaphore::new(16));
    for key in answers.keys().cloned() {
        let (addr, limit) = (Arc::clone(&addr), Arc::clone(&limit));
        asked.spawn(async move {
            let _slot = limit.acquire().await;
            let again = pay(&addr, &key).await;
            (key, again)
        });
    }
    let mut repeats = 0;
    let mut repeated = Vec::new();
    while let Some(done) = asked.join_next().await {
        let (key, again) = done.expect("retry");
        let body = &answers[&key];
        assert_eq!(&again, body, "{key}: the acknowledged answer was lost");
        let runs = up.executions(&key);
        assert!(runs >= 1, "{key}");
        repeats += runs - 1;
        if runs > 1 {
            repeated.push(key);
        }
    }
    // Every key run more than once is found by `records list --state rerun`
    // (it may list more: a takeover of an attempt killed before forwarding).
    let listed = idem_testkit::gateway::listed_keys(IDEM, &store, "rerun");
    for key in &repeated {
        assert!(
            listed.contains(key),
            "{key} ran twice but is not listed as a re-run"
        );
    }
    eprintln!("crash: {} records listed as re-runs", listed.len());
    // A repeat needs a kill between forwarding and recording: at most the
    // 16 requests in flight per kill.
    assert!(
        repeats <= (KILLS * 16) as u64,
        "{repeats} repeated executions for {KILLS} kills"
    );
    eprintln!(
        "crash: {kills} kills, {} keys, {} upstream executions ({repeats} repeats after kills)",
        answers.len(),
        up.total()
    );
}

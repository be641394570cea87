//! Store servers restarting under load, behind the real gateway: a private
//! PostgreSQL crashed (immediate stop, crash recovery) and started again,
//! and a private Redis killed and restarted empty under the tiered store.
//! Clients retry as a well-behaved client does (`503`, `409`, connection
//! errors) until they have an answer; every key must run once and keep its
//! answer.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, StatusCode};
use idem_testkit::client::try_send;
use idem_testkit::gateway::GatewayProcess as Gateway;
use idem_testkit::servers::{PrivatePostgres, PrivateRedis};
use idem_testkit::services;
use idem_testkit::upstream::CountingUpstream;
use tokio::sync::Mutex;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");

const CONFIG: &str = r#"
store_timeout = "2s"

[defaults]
lease = "30s"

[[route]]
method = "POST"
path = "/v1/payments"
require_key = true
"#;

const KEYS: usize = 300;
const WORKERS: usize = 8;

/// What the clients saw.
#[derive(Debug, Default)]
struct Seen {
    /// Each key's 2xx answers (every copy's).
    answers: BTreeMap<String, Vec<Bytes>>,
    /// Statuses (and "error" for transport errors) of every attempt.
    statuses: BTreeMap<String, usize>,
    attempts: usize,
}

/// Sends one key until it is answered `201`, retrying what a client
/// retries; returns the answer's body.
async fn until_answered(addr: SocketAddr, auth: &str, key: &str, seen: &Mutex<Seen>) -> Bytes {
    let headers = [
        ("authorization", auth),
        ("idempotency-key", key),
        ("content-type", "application/json"),
        ("x-delay-ms", "40"),
    ];
    for _ in 0..1200 {
        let answer = try_send(
            addr,
            Method::POST,
            "/v1/payments",
            &headers,
            "{\"amount\":1}",
        )
        .await;
        let mut s = seen.lock().await;
        s.attempts += 1;
        match answer {
            Ok(a) if a.status == StatusCode::CREATED => {
                *s.statuses.entry("201".into()).or_default() += 1;
                return a.body;
            }
            Ok(a) => {
                assert!(
                    [
                        StatusCode::SERVICE_UNAVAILABLE,
                        StatusCode::CONFLICT,
                        StatusCode::BAD_GATEWAY
                    ]
                    .contains(&a.status),
                    "{key}: unexpected {} {:?}",
                    a.status,
                    a.body
                );
                *s.statuses.entry(a.status.as_u16().to_string()).or_default() += 1;
            }
            Err(_) => *s.statuses.entry("error".into()).or_default() += 1,
        }
        drop(s);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{key}: no answer after 1200 attempts");
}

/// `KEYS` keys, each sent twice at once, by `WORKERS` clients
/// taking keys in turn, while `faults` runs; then every key once more.
/// Asserts: one execution per key, one answer per key, replayed after.
async fn storm_through(
    gw: &Gateway,
    up: &CountingUpstream,
    label: &str,
    faults: impl Future<Output = ()>,
) {
    let auth = Arc::new(format!("Bearer {label}-{}", idem::OwnerToken::random()));
    let seen = Arc::new(Mutex::new(Seen::default()));
    let next = Arc::new(AtomicUsize::new(0));
    let addr = gw.addr;
    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (auth, seen, next) = (Arc::clone(&auth), Arc::clone(&seen), Arc::clone(&next));
            let label = label.to_owned();
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= KEYS {
                        return;
                    }
                    let key = format!("{label}-{i}");
                    // Two copies of the key at once.
                    let (a, b) = tokio::join!(
                        until_answered(addr, &auth, &key, &seen),
                        until_answered(addr, &auth, &key, &seen)
                    );
                    let bodies = vec![a, b];
                    seen.lock().await.answers.insert(key, bodies);
                }
            })
        })
        .collect();
    faults.await;
    for w in workers {
        w.await.expect("worker");
    }

    let seen = seen.lock().await;
    let mut twice = Vec::new();
    for (key, bodies) in &seen.answers {
        assert!(
            bodies.windows(2).all(|w| w[0] == w[1]),
            "{key}: copies got different answers"
        );
        if up.executions(key) != 1 {
            twice.push((key.clone(), up.executions(key)));
        }
    }
    assert_eq!(seen.answers.len(), KEYS);
    assert!(
        twice.is_empty(),
        "{label}: keys not run exactly once: {twice:?}"
    );
    // Nothing recorded was lost: every key replays its answer.
    for (key, bodies) in &seen.answers {
        let headers = [
            ("authorization", auth.as_str()),
            ("idempotency-key", key.as_str()),
            ("content-type", "application/json"),
            ("x-delay-ms", "40"),
        ];
        let replay = try_send(
            addr,
            Method::POST,
            "/v1/payments",
            &headers,
            "{\"amount\":1}",
        )
        .await
        .expect("replay");
        assert_eq!(
            replay.header("idempotent-replayed"),
            Some("true"),
            "{key}: {:?}",
            replay.body
        );
        assert_eq!(replay.body, bodies[0], "{key}: replayed another answer");
    }
    eprintln!(
        "{label}: {KEYS} keys × 2 copies, {} attempts, statuses {:?}, {} executions",
        seen.attempts,
        seen.statuses,
        up.total()
    );
}

async fn start(dir: &Path, up: &CountingUpstream, store: &str) -> Gateway {
    Gateway::builder(IDEM, dir)
        .config(CONFIG)
        .upstream(&up.url())
        .store(store)
        .log("error")
        .start()
        .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_crashing_under_load_loses_nothing_and_runs_nothing_twice() {
    let Some(pg) = PrivatePostgres::start() else {
        return;
    };
    let pg = Arc::new(pg);
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let store = format!(
        "{}?connect_timeout_ms=500&acquire_timeout_ms=1000",
        pg.url()
    );
    let gw = start(dir.path(), &up, &store).await;
    let crashes = {
        let pg = Arc::clone(&pg);
        async move {
            for _ in 0..2 {
                tokio::time::sleep(Duration::from_millis(600)).await;
                let pg = Arc::clone(&pg);
                tokio::task::spawn_blocking(move || {
                    pg.crash();
                    // Down for 3 s: longer than the engine's quick tries
                    // to record an answer take, within half the lease.
                    std::thread::sleep(Duration::from_secs(3));
                    pg.start_again();
                })
                .await
                .expect("restart");
            }
        }
    };
    storm_through(&gw, &up, "pg-crash", crashes).await;
    gw.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redis_restarting_empty_under_the_tiered_store_runs_nothing_twice() {
    let Some(pg) = services::postgres() else {
        return;
    };
    let Some(redis) = PrivateRedis::start() else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let store = format!("tiered:{},{pg}", redis.url());
    let gw = start(dir.path(), &up, &store).await;
    let redis = Arc::new(std::sync::Mutex::new(redis));
    let restarts = {
        let redis = Arc::clone(&redis);
        async move {
            for _ in 0..3 {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let redis = Arc::clone(&redis);
                tokio::task::spawn_blocking(move || {
                    let mut r = redis.lock().unwrap_or_else(|p| p.into_inner());
                    r.kill();
                    std::thread::sleep(Duration::from_millis(300));
                    r.restart();
                })
                .await
                .expect("restart");
            }
        }
    };
    storm_through(&gw, &up, "redis-restart", restarts).await;
    gw.terminate().await;
}

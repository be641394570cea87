//! A gateway whose wall clock jumps while it serves (libfaketime moves
//! it): leases and retention on the embedded store keep to the time that
//! really passed, so a jump forward neither hands in-flight work to a retry
//! nor expires answers early, and a jump back holds nothing longer.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use http::{Method, StatusCode};
use idem_testkit::client::{Answer, metric, send};
use idem_testkit::gateway::{GatewayProcess as Gateway, TEST_CREDENTIAL, sqlite_store};
use idem_testkit::services;
use idem_testkit::upstream::CountingUpstream;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");

const CONFIG: &str = r#"
[defaults]
lease = "2s"
retention = "24h"

[[route]]
method = "POST"
path = "/v1/payments"
require_key = true

[monitor]
interval = "1s"
"#;

/// libfaketime re-reads the offset file at most this often.
const FAKETIME_CACHE_SECS: u64 = 1;

fn jump(offset_file: &Path, offset: &str) {
    std::fs::write(offset_file, offset).expect("write the clock offset");
}

/// `POST /v1/payments` with this key.
async fn pay(addr: SocketAddr, key: &str) -> Answer {
    send(
        addr,
        Method::POST,
        "/v1/payments",
        &[("authorization", TEST_CREDENTIAL), ("idempotency-key", key)],
        "{}",
    )
    .await
}

/// The same, answered by the upstream after 4 s.
async fn pay_slowly(addr: SocketAddr, key: &str) -> Answer {
    let h = [
        ("authorization", TEST_CREDENTIAL),
        ("idempotency-key", key),
        ("x-delay-ms", "4000"),
    ];
    send(addr, Method::POST, "/v1/payments", &h, "{}").await
}

async fn settle() {
    tokio::time::sleep(Duration::from_millis(FAKETIME_CACHE_SECS * 1000 + 500)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn wall_clock_jumps_break_no_lease_and_expire_no_answer() {
    let Some(lib) = services::program(
        "libfaketime",
        "IDEM_TEST_LIBFAKETIME",
        "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    ) else {
        return;
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let offset_file = dir.path().join("faketime.rc");
    jump(&offset_file, "+0");
    let cache = FAKETIME_CACHE_SECS.to_string();
    let env = [
        ("LD_PRELOAD", lib.to_str().expect("utf-8 path")),
        (
            "FAKETIME_TIMESTAMP_FILE",
            offset_file.to_str().expect("utf-8 path"),
        ),
        ("FAKETIME_CACHE_DURATION", cache.as_str()),
        // Only the wall clock jumps, as when an operator or a bad NTP
        // server steps it; the monotonic clock runs on.
        ("FAKETIME_DONT_FAKE_MONOTONIC", "1"),
    ];
    let up = CountingUpstream::start().await;
    let store = sqlite_store(dir.path());
    let gw = Gateway::builder(IDEM, dir.path())
        .config(CONFIG)
        .upstream(&up.url())
        .store(&store)
        .envs(&env)
        .start()
        .await;
    let addr = gw.addr;

    // An answer recorded before the jumps.
    let done = pay(addr, "done").await;
    assert_eq!(done.status, StatusCode::CREATED);

    // Work in flight (4 s upstream, 2 s lease) when the clock leaps a day
    // and a half ahead: a retry still finds it in progress.
    let slow = tokio::spawn(async move { pay_slowly(addr, "in-flight").await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    jump(&offset_file, "+36h");
    settle().await;
    let retry = pay_slowly(addr, "in-flight").await;
    assert_eq!(
        retry.status,
        StatusCode::CONFLICT,
        "a forward jump handed live work to a retry: {:?}",
        retry.body
    );
    let slow = slow.await.expect("join");
    assert_eq!(slow.status, StatusCode::CREATED);
    assert_eq!(up.executions("in-flight"), 1);

    // The answer from before the jump is still replayed: 24 h of
    // retention have not really passed.
    let again = pay(addr, "done").await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(again.body, done.body);
    assert_eq!(up.executions("done"), 1);

    // The step is reported: 36 h = 129,600 s ahead.
    let offset = metric(gw.admin, "idem_wall_clock_offset_seconds", "").await;
    assert!((offset - 129_600.0).abs() < 10.0, "offset {offset}");

    // Then twelve hours behind the real time (two days back): new work
    // runs once and is replayed, old answers still are.
    jump(&offset_file, "-12h");
    settle().await;
    let fresh = pay(addr, "after").await;
    assert_eq!(fresh.status, StatusCode::CREATED);
    let replay = pay(addr, "after").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(up.executions("after"), 1);
    let old = pay(addr, "done").await;
    assert_eq!(old.body, done.body);
    assert_eq!(up.executions("done"), 1);
    gw.terminate().await;
}

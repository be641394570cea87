//! The real `idem` binary in front of a real counting upstream on
//! loopback: every row of the HTTP contract, restarts, shutdown, bad config.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http::{Method, StatusCode};
use idem_testkit::client::send;
use idem_testkit::gateway::{GatewayProcess as Gateway, sqlite_store};
use idem_testkit::upstream::CountingUpstream;
use tokio::process::Command;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");
const JSON: (&str, &str) = ("content-type", "application/json");
const AUTH: (&str, &str) = ("authorization", "Bearer merchant-1");

/// Starts `idem serve` with this config text (upstream and store given as
/// flags) and waits for its "listening" line.
async fn start(dir: &Path, config: &str, upstream: &str, store: &str) -> Gateway {
    Gateway::builder(IDEM, dir)
        .config(config)
        .upstream(upstream)
        .store(store)
        .start()
        .await
}

const CONFIG: &str = r#"
[defaults]
lease = "30s"
max_request_body = "1KiB"
max_stored_response = "64KiB"
upstream_timeout = "1s"

[[route]]
method = "POST"
path = "/v1/payments"
require_key = true

[[route]]
method = "POST"
path = "/v1/storm"
require_key = true
on_in_flight = "wait"
in_flight_wait = "10s"

[[route]]
method = "POST"
path = "/v1/open"
on_store_error = "open"
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_contract_through_the_real_gateway() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), CONFIG, &up.url(), &sqlite_store(dir.path())).await;

    // First request executes; the key is forwarded upstream, hop-by-hop
    // headers are not.
    let h = [
        JSON,
        AUTH,
        ("idempotency-key", "pay-1"),
        ("connection", "keep-alive, x-hop"),
        ("x-hop", "secret"),
    ];
    let first = gw
        .post("/v1/payments", &h, r#"{"amount":100,"currency":"EUR"}"#)
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let seen = up.last_headers().expect("upstream saw the request");
    assert_eq!(seen["idempotency-key"], "pay-1");
    assert!(
        seen.get("x-hop").is_none(),
        "headers named by Connection are not forwarded"
    );
    assert!(seen.contains_key("x-forwarded-for"));
    // Replay: same status, body bytes and stored headers, marked.
    let again = gw
        .post("/v1/payments", &h, r#"{"amount":100,"currency":"EUR"}"#)
        .await;
    assert_eq!((again.status, &again.body), (first.status, &first.body));
    assert_eq!(again.header("location"), first.header("location"));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert!(again.header("set-cookie").is_none());
    // Re-serialised JSON is the same request.
    let reordered = gw
        .post(
            "/v1/payments",
            &h,
            "{\n \"currency\": \"EUR\", \"amount\": 100.0 }",
        )
        .await;
    assert_eq!(reordered.body, first.body);
    // Another body under the same key: 422.
    let other = gw
        .post("/v1/payments", &h, r#"{"amount":999,"currency":"EUR"}"#)
        .await;
    assert_eq!(
        (other.status, other.problem_type().as_str()),
        (StatusCode::UNPROCESSABLE_ENTITY, "idempotency-key-reused")
    );
    assert_eq!(up.executions("pay-1"), 1);

    // Same key, another tenant: its own execution.
    let t2 = gw
        .post(
            "/v1/payments",
            &[
                JSON,
                ("authorization", "Bearer merchant-2"),
                ("idempotency-key", "pay-1"),
            ],
            r#"{"amount":100,"currency":"EUR"}"#,
        )
        .await;
    assert_eq!(t2.status, StatusCode::CREATED);
    assert_eq!(up.executions("pay-1"), 2);

    // Missing, malformed, duplicated keys; oversized body: nothing forwarded.
    let before = up.total();
    let missing = gw.post("/v1/payments", &[JSON, AUTH], "{}").await;
    assert_eq!(
        (missing.status, missing.problem_type().as_str()),
        (StatusCode::BAD_REQUEST, "idempotency-key-missing")
    );
    let long = "k".repeat(300);
    let bad = gw
        .post(
            "/v1/payments",
            &[JSON, AUTH, ("idempotency-key", &long)],
            "{}",
        )
        .await;
    assert_eq!(
        (bad.status, bad.problem_type().as_str()),
        (StatusCode::BAD_REQUEST, "idempotency-key-invalid")
    );
    let twice = gw
        .post(
            "/v1/payments",
            &[
                JSON,
                AUTH,
                ("idempotency-key", "a"),
                ("idempotency-key", "b"),
            ],
            "{}",
        )
        .await;
    assert_eq!(
        (twice.status, twice.problem_type().as_str()),
        (StatusCode::BAD_REQUEST, "idempotency-key-ambiguous")
    );
    let big = gw
        .post(
            "/v1/payments",
            &[JSON, AUTH, ("idempotency-key", "big")],
            &"x".repeat(2000),
        )
        .await;
    assert_eq!(
        (big.status, big.problem_type().as_str()),
        (StatusCode::PAYLOAD_TOO_LARGE, "request-body-too-large")
    );
    assert_eq!(up.total(), before, "refusals forward nothing");

    // In flight: 409 with Retry-After (the first is slow upstream).
    let slow_h = [
        JSON,
        AUTH,
        ("idempotency-key", "slow"),
        ("x-delay-ms", "600"),
    ];
    let slow = {
        let addr = gw.addr;
        let slow_h = slow_h.map(|(k, v)| (k.to_owned(), v.to_owned()));
        tokio::spawn(async move {
            let h: Vec<(&str, &str)> = slow_h
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            send(addr, Method::POST, "/v1/payments", &h, "{}").await
        })
    };
    up.until_received("slow").await;
    let busy = gw.post("/v1/payments", &slow_h, "{}").await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert!(busy.header("retry-after").is_some());
    assert_eq!(slow.await.expect("task").status, StatusCode::CREATED);

    // Upstream timeout after sending: 504, and the record stays
    // processing with an unknown outcome: a retry is told so, not re-run.
    let timeout_h = [
        JSON,
        AUTH,
        ("idempotency-key", "timeout"),
        ("x-delay-ms", "2500"),
    ];
    let t = gw.post("/v1/payments", &timeout_h, "{}").await;
    assert_eq!(
        (t.status, t.problem_type().as_str()),
        (StatusCode::GATEWAY_TIMEOUT, "upstream-timeout")
    );
    let retry = gw.post("/v1/payments", &timeout_h, "{}").await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert!(String::from_utf8_lossy(&retry.body).contains("may have taken effect"));
    assert_eq!(up.executions("timeout"), 1);

    // Oversized response: the client gets it all, the replay a tombstone.
    let huge_h = [
        JSON,
        AUTH,
        ("idempotency-key", "huge"),
        ("x-size", "100000"),
    ];
    let huge = gw.post("/v1/payments", &huge_h, "{}").await;
    assert_eq!(
        (huge.status, huge.body.len()),
        (StatusCode::CREATED, 100_000)
    );
    let huge_again = gw.post("/v1/payments", &huge_h, "{}").await;
    assert_eq!(
        (huge_again.status, huge_again.problem_type().as_str()),
        (StatusCode::CREATED, "idempotency-response-not-retained")
    );
    assert_eq!(up.executions("huge"), 1);

    // Unprotected methods pass through; admin health and readiness answer.
    let get = send(
        gw.addr,
        Method::GET,
        "/v1/payments",
        &[("idempotency-key", "g")],
        "",
    )
    .await;
    assert_eq!(get.status, StatusCode::CREATED, "GET forwarded as is");
    assert_eq!(
        send(gw.admin, Method::GET, "/healthz", &[], "")
            .await
            .status,
        StatusCode::OK
    );
    assert_eq!(
        send(gw.admin, Method::GET, "/readyz", &[], "").await.status,
        StatusCode::OK
    );

    assert!(gw.terminate().await.success(), "clean exit on SIGTERM");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_identical_requests_execute_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), CONFIG, &up.url(), &sqlite_store(dir.path())).await;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..64 {
        let addr = gw.addr;
        tasks.spawn(async move {
            send(
                addr,
                Method::POST,
                "/v1/storm",
                &[
                    JSON,
                    AUTH,
                    ("idempotency-key", "storm-1"),
                    ("x-delay-ms", "200"),
                ],
                r#"{"amount":5}"#,
            )
            .await
        });
    }
    let mut bodies = std::collections::HashSet::new();
    while let Some(done) = tasks.join_next().await {
        let a = done.expect("task");
        assert_eq!(a.status, StatusCode::CREATED, "{:?}", a.body);
        bodies.insert(a.body);
    }
    assert_eq!(
        up.executions("storm-1"),
        1,
        "exactly one upstream execution"
    );
    assert_eq!(bodies.len(), 1, "every 2xx answer byte-identical");
    assert!(gw.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_survive_a_gateway_restart() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let h = [JSON, AUTH, ("idempotency-key", "restart-1")];
    let gw = start(dir.path(), CONFIG, &up.url(), &sqlite_store(dir.path())).await;
    let first = gw.post("/v1/payments", &h, r#"{"amount":1}"#).await;
    assert!(gw.terminate().await.success());
    let gw = start(dir.path(), CONFIG, &up.url(), &sqlite_store(dir.path())).await;
    let again = gw.post("/v1/payments", &h, r#"{"amount":1}"#).await;
    assert_eq!((again.status, &again.body), (first.status, &first.body));
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(up.executions("restart-1"), 1);
    assert!(gw.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_in_flight_requests_finish() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), CONFIG, &up.url(), &sqlite_store(dir.path())).await;
    let addr = gw.addr;
    let inflight = tokio::spawn(async move {
        send(
            addr,
            Method::POST,
            "/v1/payments",
            &[
                JSON,
                AUTH,
                ("idempotency-key", "drain"),
                ("x-delay-ms", "700"),
            ],
            "{}",
        )
        .await
    });
    up.until_received("drain").await;
    let status = gw.terminate().await;
    assert!(status.success());
    assert_eq!(
        inflight.await.expect("task").status,
        StatusCode::CREATED,
        "finished, not cut"
    );
    // The answer was recorded before exit: a new gateway replays it.
    let gw = start(dir.path(), CONFIG, &up.url(), &sqlite_store(dir.path())).await;
    let again = gw
        .post(
            "/v1/payments",
            &[JSON, AUTH, ("idempotency-key", "drain")],
            "{}",
        )
        .await;
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(up.executions("drain"), 1);
    assert!(gw.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_unreachable_is_502_and_releases_the_key() {
    let dir = tempfile::tempdir().expect("temp dir");
    // Port 1 on loopback: connection refused.
    let gw = start(
        dir.path(),
        CONFIG,
        "http://127.0.0.1:1",
        &sqlite_store(dir.path()),
    )
    .await;
    let h = [JSON, AUTH, ("idempotency-key", "down")];
    for _ in 0..2 {
        let a = gw.post("/v1/payments", &h, "{}").await;
        assert_eq!(
            (a.status, a.problem_type().as_str()),
            (StatusCode::BAD_GATEWAY, "upstream-unreachable"),
            "released, so the retry is tried again (not 409)"
        );
    }
    assert!(gw.terminate().await.success());
}

/// HTTP/2 clients (prior knowledge, cleartext): pass-through and protected
/// requests reach the upstream over HTTP/1.1, and the replay comes back
/// over HTTP/2 with the first answer's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_are_proxied_and_replayed() {
    use http_body_util::{BodyExt, Full};
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), CONFIG, &up.url(), &sqlite_store(dir.path())).await;
    let mut h2 = idem_testkit::client::h2c(gw.addr).await;
    let mut call = async |method: Method, key: Option<&str>| {
        let mut req = http::Request::builder()
            .method(method)
            .uri(format!("http://{}/v1/payments", gw.addr))
            .header(JSON.0, JSON.1)
            .header(AUTH.0, AUTH.1);
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        let req = req
            .body(Full::new(bytes::Bytes::from_static(b"{}")))
            .expect("request");
        let resp = h2.send_request(req).await.expect("HTTP/2 answer");
        assert_eq!(resp.version(), http::Version::HTTP_2);
        let (parts, body) = resp.into_parts();
        (parts, body.collect().await.expect("body").to_bytes())
    };
    let (get, _) = call(Method::GET, None).await;
    assert_eq!(get.status, StatusCode::CREATED, "passed through");
    let (first, first_body) = call(Method::POST, Some("h2-once")).await;
    let (again, again_body) = call(Method::POST, Some("h2-once")).await;
    assert_eq!(
        (first.status, again.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_eq!(
        again
            .headers
            .get("idempotent-replayed")
            .map(|v| v.as_bytes()),
        Some(&b"true"[..])
    );
    assert_eq!(
        first_body, again_body,
        "the replay carries the first answer's bytes"
    );
    assert_eq!(up.executions("h2-once"), 1);
    assert_eq!(up.total(), 2);
    assert!(gw.terminate().await.success());
}

/// A `GET` passed through, then after `pause` a protected `POST` with `key`.
async fn pass_through_then_protected(
    gw: &Gateway,
    key: &str,
    pause: Duration,
) -> (idem_testkit::client::Answer, idem_testkit::client::Answer) {
    let get = send(gw.addr, Method::GET, "/v1/things", &[], "").await;
    tokio::time::sleep(pause).await;
    let post = gw
        .post(
            "/v1/payments",
            &[JSON, AUTH, ("idempotency-key", key)],
            "{}",
        )
        .await;
    (get, post)
}

/// The gateway keeps its upstream connections open and reuses them, for
/// pass-through and protected requests alike; a large answer and a large
/// upload stream through whole and leave their connection reusable.
/// Each serving thread keeps connections of its own, so with one thread
/// one connection carries every request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_connections_are_reused_and_large_answers_stream_whole() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let config = format!("workers = 1\n{CONFIG}");
    let gw = start(dir.path(), &config, &up.url(), &sqlite_store(dir.path())).await;
    for i in 0..10 {
        let (get, post) =
            pass_through_then_protected(&gw, &format!("reuse-{i}"), Duration::ZERO).await;
        assert_eq!(
            (get.status, post.status),
            (StatusCode::CREATED, StatusCode::CREATED),
            "{i}"
        );
    }
    let size = 3 << 20;
    let big = send(
        gw.addr,
        Method::GET,
        "/v1/things",
        &[("x-size", &size.to_string())],
        "",
    )
    .await;
    assert_eq!((big.status, big.body.len()), (StatusCode::CREATED, size));
    // A large upload without a key streams through to the upstream whole.
    let upload = send(gw.addr, Method::POST, "/v1/uploads", &[], vec![b'u'; size]).await;
    assert_eq!(upload.status, StatusCode::CREATED);
    let echoed = String::from_utf8_lossy(&upload.body).into_owned();
    assert!(echoed.contains(&format!("\"body_len\":{size}")), "{echoed}");
    assert!(
        big.body.iter().all(|&b| b == b'x'),
        "the bytes the upstream sent"
    );
    let a = send(gw.addr, Method::GET, "/v1/things", &[], "").await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(up.total(), 23);
    assert_eq!(up.connections(), 1, "one connection carried them all");
    assert!(gw.terminate().await.success());
}

/// An upstream that closes keep-alive connections soon after answering
/// (as many servers do after an idle time-out): each next request finds
/// its pooled connection closed and gets a fresh one, never a `502`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_closing_idle_connections_costs_no_request() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    tokio::spawn({
        let accepted = std::sync::Arc::clone(&accepted);
        async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                tokio::spawn(async move {
                    // One request (head and body), one answer, then the
                    // connection closes 20 ms later.
                    let mut seen = Vec::new();
                    let mut buf = [0u8; 4096];
                    loop {
                        if let Some(end) = seen.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&seen[..end]).to_ascii_lowercase();
                            let length: usize = head
                                .lines()
                                .find_map(|l| l.strip_prefix("content-length:"))
                                .and_then(|v| v.trim().parse().ok())
                                .unwrap_or(0);
                            if seen.len() >= end + 4 + length {
                                break;
                            }
                        }
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => seen.extend_from_slice(&buf[..n]),
                        }
                    }
                    let _ = stream
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .await;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                });
            }
        }
    });
    let dir = tempfile::tempdir().expect("temp dir");
    let gw = start(dir.path(), CONFIG, &url, "memory://").await;
    let pause = Duration::from_millis(150);
    for i in 0..4 {
        let (get, post) = pass_through_then_protected(&gw, &format!("closing-{i}"), pause).await;
        for a in [get, post] {
            assert_eq!((a.status, &a.body[..]), (StatusCode::OK, &b"ok"[..]), "{i}");
        }
        tokio::time::sleep(pause).await;
    }
    assert_eq!(
        accepted.load(std::sync::atomic::Ordering::SeqCst),
        8,
        "one connection each"
    );
    assert!(gw.terminate().await.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_fails_closed_or_open_per_route() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let db = dir.path().join("idem.db");
    let store = format!("sqlite://{}?busy_timeout_ms=100", db.display());
    let gw = start(dir.path(), CONFIG, &up.url(), &store).await;
    // Another process holds the database's write lock: the store cannot
    // record reservations.
    let lock = rusqlite_lock(&db);
    let closed = gw
        .post(
            "/v1/payments",
            &[JSON, AUTH, ("idempotency-key", "c1")],
            "{}",
        )
        .await;
    assert_eq!(
        (closed.status, closed.problem_type().as_str()),
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "idempotency-store-unavailable"
        )
    );
    assert!(closed.header("retry-after").is_some());
    assert_eq!(up.total(), 0, "fail-closed forwards nothing");
    let open = gw
        .post("/v1/open", &[JSON, AUTH, ("idempotency-key", "o1")], "{}")
        .await;
    assert_eq!(open.status, StatusCode::CREATED);
    assert_eq!(open.header("idempotency-status"), Some("unprotected"));
    assert_eq!(up.total(), 1);
    let ready = send(gw.admin, Method::GET, "/readyz", &[], "").await;
    assert_eq!(
        ready.status,
        StatusCode::OK,
        "reads still work while writes are locked"
    );
    drop(lock);
    // Protection resumes without a restart.
    let back = gw
        .post(
            "/v1/payments",
            &[JSON, AUTH, ("idempotency-key", "c1")],
            "{}",
        )
        .await;
    assert_eq!(back.status, StatusCode::CREATED);
    let replay = gw
        .post(
            "/v1/payments",
            &[JSON, AUTH, ("idempotency-key", "c1")],
            "{}",
        )
        .await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert!(gw.terminate().await.success());
}

/// Holds an exclusive write transaction on the database until dropped,
/// from a child `sqlite3`-free helper: a second process would do the same.
fn rusqlite_lock(db: &Path) -> LockHolder {
    let conn = idem_sqlite::rusqlite::Connection::open(db).expect("open");
    conn.execute_batch("BEGIN EXCLUSIVE").expect("lock");
    LockHolder(conn)
}

struct LockHolder(idem_sqlite::rusqlite::Connection);

impl Drop for LockHolder {
    fn drop(&mut self) {
        let _ = self.0.execute_batch("ROLLBACK");
    }
}

async fn run_idem(args: &[&str], config: Option<(&Path, &str)>) -> (i32, String) {
    let mut cmd = Command::new(IDEM);
    cmd.args(args);
    if let Some((path, text)) = config {
        std::fs::write(path, text).expect("write config");
        cmd.arg("--config").arg(path);
    }
    let out = tokio::time::timeout(
        Duration::from_secs(20),
        cmd.env_remove("IDEM_UPSTREAM").output(),
    )
    .await
    .expect("exits")
    .expect("runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn bad_configuration_is_refused_with_the_line_that_is_wrong() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cfg: PathBuf = dir.path().join("bad.toml");
    let (code, err) = run_idem(
        &["serve"],
        Some((
            &cfg,
            "upstream = \"http://127.0.0.1:3000\"\n[defaults]\nlease = \"soon\"\n",
        )),
    )
    .await;
    assert_ne!(code, 0);
    assert!(
        err.contains("bad.toml:3: defaults.lease = \"soon\": not a duration"),
        "{err}"
    );
    let (code, err) = run_idem(
        &["serve"],
        Some((&cfg, "upstream = \"http://127.0.0.1:3000\"\nretries = 3\n")),
    )
    .await;
    assert_ne!(code, 0);
    assert!(
        err.contains("unknown field") && err.contains("retries"),
        "{err}"
    );
    let (code, err) = run_idem(&["serve"], None).await;
    assert_ne!(code, 0);
    assert!(err.contains("no upstream"), "{err}");
    let (code, err) = run_idem(
        &[
            "serve",
            "--upstream",
            "http://127.0.0.1:3000",
            "--store",
            "oracle://app:hunter2@db/idem",
        ],
        None,
    )
    .await;
    assert_ne!(code, 0);
    assert!(
        err.contains("app:***@db") && !err.contains("hunter2"),
        "password redacted: {err}"
    );
    let (code, err) = run_idem(
        &[
            "serve",
            "--upstream",
            "http://127.0.0.1:3000",
            "--store",
            "postgres://app:hunter2@db/idem?max_connections=none",
        ],
        None,
    )
    .await;
    assert_ne!(code, 0);
    assert!(
        err.contains("max_connections") && !err.contains("hunter2"),
        "{err}"
    );
}

/// The README's first command: quiet by default (its summary is its
/// output; no log line, no progress line when not on a terminal, no colour
/// codes), and the summary's rows add up to the requests sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_runs_clean_and_its_summary_adds_up() {
    let out = tokio::time::timeout(
        Duration::from_secs(120),
        Command::new(IDEM)
            .args([
                "demo",
                "--payments",
                "20",
                "--duplicates",
                "4",
                "--latency-ms",
                "60",
            ])
            .env_remove("IDEM_LOG")
            .output(),
    )
    .await
    .expect("demo finishes")
    .expect("runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.trim().is_empty(), "quiet by default: {stderr}");
    assert!(
        !stdout.contains('\u{1b}') && !stdout.contains('\r'),
        "{stdout:?}"
    );
    let value = |row: &str| -> u64 {
        let line = stdout
            .lines()
            .find(|l| l.trim_start().starts_with(row))
            .unwrap_or_else(|| panic!("no row {row:?} in {stdout}"));
        line.split_whitespace()
            .last()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{line}"))
    };
    let parts: u64 = stdout
        .lines()
        .filter(|l| l.starts_with("    "))
        .map(|l| {
            l.split_whitespace()
                .last()
                .and_then(|v| v.parse::<u64>().ok())
                .expect(l)
        })
        .sum();
    assert_eq!(parts, value("requests sent to the gateway"), "{stdout}");
    assert_eq!(value("charges made upstream"), 20, "{stdout}");
    assert_eq!(value("DOUBLE CHARGES"), 0, "{stdout}");
    assert_eq!(value("422: key reused"), 20, "{stdout}");
    assert!(stdout.contains("OK: 20 payments"), "{stdout}");
}

/// Writes raw bytes on a fresh connection, half-closes it, and returns
/// whatever the gateway answers (possibly nothing).
async fn raw_exchange(addr: SocketAddr, request: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request).await.expect("write");
    stream.shutdown().await.expect("half-close");
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), stream.read_to_end(&mut answer)).await;
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn truncated_bodies_and_oversized_headers_forward_nothing_and_leave_no_record() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), CONFIG, &up.url(), &sqlite_store(dir.path())).await;
    // A body cut short: Content-Length says 100, 10 bytes arrive, the
    // client goes away.
    let truncated = format!(
        "POST /v1/payments HTTP/1.1\r\nhost: {}\r\nauthorization: Bearer sk_test_caller\r\ncontent-type: application/json\r\nidempotency-key: cut-1\r\ncontent-length: 100\r\n\r\n{{\"amount\":",
        gw.addr
    );
    let answer = raw_exchange(gw.addr, truncated.as_bytes()).await;
    assert!(
        answer.is_empty() || answer.starts_with("HTTP/1.1 400"),
        "{answer}"
    );
    // Far too many headers: refused by the HTTP parser.
    let mut huge = format!(
        "POST /v1/payments HTTP/1.1\r\nhost: {}\r\nidempotency-key: hdr-1\r\ncontent-length: 2\r\n",
        gw.addr
    );
    for i in 0..300 {
        huge.push_str(&format!("x-filler-{i}: {}\r\n", "v".repeat(64)));
    }
    huge.push_str("\r\n{}");
    let answer = raw_exchange(gw.addr, huge.as_bytes()).await;
    assert!(
        answer.starts_with("HTTP/1.1 431"),
        "oversized headers: {answer:.80}"
    );
    assert_eq!(up.total(), 0, "nothing forwarded");
    // No record was left: the same keys, sent properly, execute now.
    for key in ["cut-1", "hdr-1"] {
        let a = gw
            .post(
                "/v1/payments",
                &[JSON, ("idempotency-key", key)],
                r#"{"amount":1}"#,
            )
            .await;
        assert_eq!(a.status, StatusCode::CREATED);
        assert_eq!(a.header("idempotent-replayed"), None);
    }
    assert_eq!(up.total(), 2);
    assert!(gw.terminate().await.success());
}

/// A SIGTERM sent the moment the gateway says it listens stops it cleanly:
/// its handler is installed before that line, not when the serving loop
/// first looks at it (a relay in CI was once killed by a SIGTERM sent in
/// that gap).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigterm_right_after_the_ready_line_stops_cleanly() {
    let up = CountingUpstream::start().await;
    for _ in 0..5 {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = sqlite_store(dir.path());
        let gw = Gateway::builder(IDEM, dir.path())
            .upstream(&up.url())
            .store(&store)
            .log("error")
            .start()
            .await;
        let status = gw.terminate().await;
        assert!(
            status.success(),
            "stopped by its handler, not killed: {status}"
        );
    }
}

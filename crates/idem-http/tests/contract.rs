//! The HTTP contract, end to end: a real axum server on loopback with the
//! layer, real HTTP requests, handler executions counted.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::routing::post;
use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use idem::{FailMode, InFlight, MemoryStore, Policy};
use idem_http::{Hashing, IdempotencyLayer, MissingTenant, RoutePolicy, Routes, TenantSource};
use idem_testkit::client::send;
use idem_testkit::wait::eventually;
use idem_testkit::{Op, faulty};

#[derive(Clone, Default)]
struct Counter(Arc<AtomicU64>);

impl Counter {
    fn get(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}

async fn charge(
    State(c): State<Counter>,
    headers: HeaderMap,
    body: Bytes,
) -> (StatusCode, [(&'static str, String); 2], String) {
    let n = c.0.fetch_add(1, Ordering::SeqCst) + 1;
    let delay = headers
        .get("x-delay-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(delay)).await;
    let status = headers
        .get("x-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::CREATED);
    let size: usize = headers
        .get("x-size")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let body = if size > 0 {
        "x".repeat(size)
    } else {
        format!("{{\"charge\":{n},\"len\":{}}}", body.len())
    };
    (
        status,
        [
            ("location", format!("/v1/payments/{n}")),
            ("set-cookie", format!("s={n}")),
        ],
        body,
    )
}

fn app<S: idem::Store>(store: Arc<S>, routes: Routes, counter: Counter) -> Router {
    app_with(store, routes, counter, Hashing::unkeyed())
}

fn app_with<S: idem::Store>(
    store: Arc<S>,
    routes: Routes,
    counter: Counter,
    hashing: Hashing,
) -> Router {
    Router::new()
        .route("/v1/payments", post(charge).get(|| async { "list" }))
        .route("/v1/orders/{id}/capture", post(charge))
        .route("/v1/big", post(charge))
        .layer(
            IdempotencyLayer::from_arc(store)
                .with_routes(routes)
                .with_tenant(TenantSource::Authorization)
                .with_hashing(hashing),
        )
        .with_state(counter)
}

fn keyed(byte: u8) -> Hashing {
    Hashing::keyed(Arc::new(
        idem::HashSecret::from_bytes(&[byte; 32]).expect("32 bytes"),
    ))
}

fn routes() -> Routes {
    let strict = RoutePolicy::default()
        .with_require_key(true)
        .with_max_request_body(1024);
    Routes::default()
        .route(Method::POST, "/v1/payments", strict.clone())
        .and_then(|r| {
            r.route(
                Method::POST,
                "/v1/big",
                strict.with_max_stored_response(100),
            )
        })
        .expect("routes")
}

async fn serve(router: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, router).await.expect("serve") });
    addr
}

const JSON: (&str, &str) = ("content-type", "application/json");
const AUTH: (&str, &str) = ("authorization", "Bearer tenant-one");

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn first_request_executes_and_retries_replay_the_same_bytes() {
    let counter = Counter::default();
    let addr = serve(app(Arc::new(MemoryStore::new()), routes(), counter.clone())).await;
    let h = [JSON, AUTH, ("idempotency-key", "k-1")];
    let first = send(
        addr,
        Method::POST,
        "/v1/payments",
        &h,
        r#"{"amount":100,"currency":"EUR"}"#,
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(first.headers.get("idempotent-replayed").is_none());
    let again = send(
        addr,
        Method::POST,
        "/v1/payments",
        &h,
        r#"{"amount":100,"currency":"EUR"}"#,
    )
    .await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(again.body, first.body);
    assert_eq!(again.headers["location"], first.headers["location"]);
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert!(
        again.headers.get("set-cookie").is_none(),
        "cookies are not stored"
    );
    // Same JSON, other key order and white space: the same request.
    let reordered = send(
        addr,
        Method::POST,
        "/v1/payments",
        &h,
        "{ \"currency\" : \"EUR\",\n \"amount\": 100 }",
    )
    .await;
    assert_eq!(reordered.status, StatusCode::CREATED);
    assert_eq!(reordered.body, first.body);
    // Another amount under the same key: refused, not executed.
    let changed = send(
        addr,
        Method::POST,
        "/v1/payments",
        &h,
        r#"{"amount":101,"currency":"EUR"}"#,
    )
    .await;
    assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(changed.headers["content-type"], "application/problem+json");
    assert_eq!(changed.problem_type(), "idempotency-key-reused");
    assert_eq!(counter.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_concurrent_duplicates_execute_once() {
    let counter = Counter::default();
    let store = Arc::new(MemoryStore::new());
    let wait = RoutePolicy::default()
        .with_require_key(true)
        .with_engine(Policy::default().with_on_in_flight(InFlight::Wait(Duration::from_secs(10))));
    let routes = Routes::default()
        .route(Method::POST, "/v1/payments", wait)
        .expect("route");
    let addr = serve(app(store, routes, counter.clone())).await;
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..64 {
        tasks.spawn(async move {
            send(
                addr,
                Method::POST,
                "/v1/payments",
                &[
                    JSON,
                    AUTH,
                    ("idempotency-key", "storm"),
                    ("x-delay-ms", "100"),
                ],
                r#"{"amount":1}"#,
            )
            .await
        });
    }
    let mut bodies = std::collections::HashSet::new();
    let mut replayed = 0;
    while let Some(done) = tasks.join_next().await {
        let a = done.expect("task");
        assert_eq!(a.status, StatusCode::CREATED);
        replayed += usize::from(a.headers.contains_key("idempotent-replayed"));
        bodies.insert(a.body);
    }
    assert_eq!(counter.get(), 1, "exactly one execution");
    assert_eq!(bodies.len(), 1, "every answer byte-identical");
    assert_eq!(replayed, 63);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_duplicate_during_the_first_gets_409_with_retry_after() {
    let counter = Counter::default();
    let addr = serve(app(Arc::new(MemoryStore::new()), routes(), counter.clone())).await;
    let slow = tokio::spawn(async move {
        send(
            addr,
            Method::POST,
            "/v1/payments",
            &[
                JSON,
                AUTH,
                ("idempotency-key", "slow"),
                ("x-delay-ms", "500"),
            ],
            "{}",
        )
        .await
    });
    // In flight once the handler has it (it counts, then waits 500 ms).
    eventually("the first reaching the handler", async || counter.get() > 0).await;
    let dup = send(
        addr,
        Method::POST,
        "/v1/payments",
        &[
            JSON,
            AUTH,
            ("idempotency-key", "slow"),
            ("x-delay-ms", "500"),
        ],
        "{}",
    )
    .await;
    assert_eq!(dup.status, StatusCode::CONFLICT);
    assert!(
        dup.headers["retry-after"]
            .to_str()
            .expect("ascii")
            .parse::<u64>()
            .expect("seconds")
            >= 1
    );
    assert_eq!(dup.problem_type(), "idempotency-request-in-progress");
    // A different body under the same key is a mismatch even in flight.
    let other = send(
        addr,
        Method::POST,
        "/v1/payments",
        &[JSON, AUTH, ("idempotency-key", "slow")],
        r#"{"x":1}"#,
    )
    .await;
    assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(slow.await.expect("task").status, StatusCode::CREATED);
    assert_eq!(counter.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_keys_and_bodies_are_refused_without_forwarding_or_records() {
    let counter = Counter::default();
    let store = Arc::new(MemoryStore::new());
    let addr = serve(app(Arc::clone(&store), routes(), counter.clone())).await;
    let long = "k".repeat(256);
    type Case<'a> = (Vec<(&'a str, &'a str)>, String, StatusCode, &'a str);
    let cases: Vec<Case<'_>> = vec![
        (
            vec![JSON, AUTH],
            "{}".into(),
            StatusCode::BAD_REQUEST,
            "idempotency-key-missing",
        ),
        (
            vec![JSON, AUTH, ("idempotency-key", "\"\"")],
            "{}".into(),
            StatusCode::BAD_REQUEST,
            "idempotency-key-invalid",
        ),
        (
            vec![JSON, AUTH, ("idempotency-key", &long)],
            "{}".into(),
            StatusCode::BAD_REQUEST,
            "idempotency-key-invalid",
        ),
        (
            vec![JSON, AUTH, ("idempotency-key", "\"unterminated")],
            "{}".into(),
            StatusCode::BAD_REQUEST,
            "idempotency-key-invalid",
        ),
        (
            vec![
                JSON,
                AUTH,
                ("idempotency-key", "a"),
                ("idempotency-key", "a"),
            ],
            "{}".into(),
            StatusCode::BAD_REQUEST,
            "idempotency-key-ambiguous",
        ),
        (
            vec![JSON, AUTH, ("idempotency-key", "big")],
            "x".repeat(2048),
            StatusCode::PAYLOAD_TOO_LARGE,
            "request-body-too-large",
        ),
    ];
    for (headers, body, status, kind) in cases {
        let a = send(addr, Method::POST, "/v1/payments", &headers, body).await;
        assert_eq!(a.status, status, "{kind}");
        assert_eq!(a.problem_type(), kind);
    }
    // Invalid UTF-8 in a JSON body.
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let req = http::Request::post(format!("http://{addr}/v1/payments"))
        .header("content-type", "application/json")
        .header(AUTH.0, AUTH.1)
        .header("idempotency-key", "utf8")
        .body(Full::new(Bytes::from_static(b"{\"a\":\"\xff\xfe\"}")))
        .expect("request");
    let resp = client.request(req).await.expect("response");
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    assert_eq!(counter.get(), 0, "nothing forwarded");
    assert!(store.is_empty(), "no record left behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unprotected_methods_and_keyless_posts_pass_through() {
    let counter = Counter::default();
    let addr = serve(app(Arc::new(MemoryStore::new()), routes(), counter.clone())).await;
    let list = send(
        addr,
        Method::GET,
        "/v1/payments",
        &[("idempotency-key", "k")],
        "",
    )
    .await;
    assert_eq!(
        (list.status, &list.body[..]),
        (StatusCode::OK, &b"list"[..])
    );
    // Default policy: a POST without a key is forwarded unprotected, twice.
    for _ in 0..2 {
        let a = send(addr, Method::POST, "/v1/orders/1/capture", &[JSON], "{}").await;
        assert_eq!(a.status, StatusCode::CREATED);
    }
    assert_eq!(counter.get(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_independent() {
    let counter = Counter::default();
    let addr = serve(app(Arc::new(MemoryStore::new()), routes(), counter.clone())).await;
    for auth in ["Bearer a", "Bearer b", "Bearer a"] {
        let a = send(
            addr,
            Method::POST,
            "/v1/payments",
            &[JSON, ("authorization", auth), ("idempotency-key", "same")],
            "{}",
        )
        .await;
        assert_eq!(a.status, StatusCode::CREATED);
    }
    assert_eq!(counter.get(), 2, "one execution per tenant");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transient_statuses_release_and_deterministic_failures_replay() {
    let counter = Counter::default();
    let addr = serve(app(Arc::new(MemoryStore::new()), routes(), counter.clone())).await;
    let busy = [JSON, AUTH, ("idempotency-key", "t"), ("x-status", "503")];
    assert_eq!(
        send(addr, Method::POST, "/v1/payments", &busy, "{}")
            .await
            .status,
        503
    );
    let ok = [JSON, AUTH, ("idempotency-key", "t")];
    assert_eq!(
        send(addr, Method::POST, "/v1/payments", &ok, "{}")
            .await
            .status,
        201
    );
    assert_eq!(counter.get(), 2, "503 released the key");
    let declined = [JSON, AUTH, ("idempotency-key", "d"), ("x-status", "402")];
    assert_eq!(
        send(addr, Method::POST, "/v1/payments", &declined, "{}")
            .await
            .status,
        402
    );
    let again = send(addr, Method::POST, "/v1/payments", &declined, "{}").await;
    assert_eq!(
        (
            again.status,
            again.headers.contains_key("idempotent-replayed")
        ),
        (StatusCode::PAYMENT_REQUIRED, true)
    );
    assert_eq!(counter.get(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_responses_are_recorded_as_tombstones() {
    let counter = Counter::default();
    let addr = serve(app(Arc::new(MemoryStore::new()), routes(), counter.clone())).await;
    let h = [JSON, AUTH, ("idempotency-key", "big"), ("x-size", "5000")];
    let first = send(addr, Method::POST, "/v1/big", &h, "{}").await;
    assert_eq!(
        (first.status, first.body.len()),
        (StatusCode::CREATED, 5000),
        "the client gets the whole body"
    );
    let replay = send(addr, Method::POST, "/v1/big", &h, "{}").await;
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.headers["idempotent-replayed"], "true");
    assert_eq!(replay.problem_type(), "idempotency-response-not-retained");
    assert_eq!(counter.get(), 1, "never executed twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_does_not_cancel_the_work_or_its_record() {
    let counter = Counter::default();
    let addr = serve(app(Arc::new(MemoryStore::new()), routes(), counter.clone())).await;
    let h = [
        JSON,
        AUTH,
        ("idempotency-key", "gone"),
        ("x-delay-ms", "300"),
    ];
    hang_up_after(addr, "/v1/payments", &h, Duration::from_millis(50)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let retry = send(addr, Method::POST, "/v1/payments", &h, "{}").await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(retry.headers["idempotent-replayed"], "true");
    assert_eq!(counter.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_down_fails_closed_or_open_by_policy() {
    let counter = Counter::default();
    let store = Arc::new(faulty(MemoryStore::new()));
    let open = RoutePolicy::default().with_engine(Policy::default().with_fail_mode(FailMode::Open));
    let routes = Routes::default()
        .route(Method::POST, "/v1/payments", RoutePolicy::default())
        .and_then(|r| r.route(Method::POST, "/v1/orders/{id}/capture", open))
        .expect("routes");
    let addr = serve(app(Arc::clone(&store), routes, counter.clone())).await;
    store.hook().fail_next(Op::Reserve, 1);
    let closed = send(
        addr,
        Method::POST,
        "/v1/payments",
        &[JSON, AUTH, ("idempotency-key", "c")],
        "{}",
    )
    .await;
    assert_eq!(closed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(closed.headers.contains_key("retry-after"));
    assert_eq!(closed.problem_type(), "idempotency-store-unavailable");
    assert_eq!(counter.get(), 0, "fail-closed forwards nothing");
    store.hook().fail_next(Op::Reserve, 1);
    let opened = send(
        addr,
        Method::POST,
        "/v1/orders/9/capture",
        &[JSON, AUTH, ("idempotency-key", "o")],
        "{}",
    )
    .await;
    assert_eq!(opened.status, StatusCode::CREATED);
    assert_eq!(opened.headers["idempotency-status"], "unprotected");
    assert_eq!(counter.get(), 1);
    // The store is back: protection resumes.
    let protected = send(
        addr,
        Method::POST,
        "/v1/payments",
        &[JSON, AUTH, ("idempotency-key", "c")],
        "{}",
    )
    .await;
    assert_eq!(protected.status, StatusCode::CREATED);
    assert!(!protected.headers.contains_key("idempotency-status"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_axum_example_runs_and_dedupes() {
    let exe = std::env::current_exe().expect("test exe");
    let example = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target dir")
        .join("examples")
        .join("axum_payments");
    assert!(
        example.exists(),
        "cargo test builds examples: {}",
        example.display()
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let mut child = tokio::process::Command::new(&example)
        .env("ADDR", "127.0.0.1:0")
        .env("IDEM_DB", dir.path().join("p.db"))
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn example");
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let line = lines.next_line().await.expect("read").expect("a line");
    let addr: SocketAddr = line
        .strip_prefix("listening on ")
        .expect("banner")
        .parse()
        .expect("addr");
    let h = [JSON, AUTH, ("idempotency-key", "ex-1")];
    let body = r#"{"amount_cents":500,"currency":"EUR"}"#;
    let first = send(addr, Method::POST, "/v1/payments", &h, body).await;
    let second = send(addr, Method::POST, "/v1/payments", &h, body).await;
    assert_eq!(
        (first.status, second.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert_eq!(first.body, second.body);
    let count = send(addr, Method::GET, "/v1/charges/count", &[], "").await;
    assert_eq!(&count.body[..], br#"{"charges":1}"#);
    let missing = send(addr, Method::POST, "/v1/payments", &[JSON], body).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    child.kill().await.expect("kill");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_gone_while_its_key_is_being_reserved_leaves_no_stuck_key() {
    let counter = Counter::default();
    let store = Arc::new(faulty(MemoryStore::new()));
    // The reservation takes effect at once but is acknowledged late, as
    // with a slow durable commit; the client gives up in between.
    store.hook().delay(Op::Reserve, Duration::from_millis(200));
    let addr = serve(app(Arc::clone(&store), routes(), counter.clone())).await;
    let h = [JSON, AUTH, ("idempotency-key", "slow-store")];
    hang_up_after(addr, "/v1/payments", &h, Duration::from_millis(50)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    store.hook().delay(Op::Reserve, Duration::ZERO);
    let retry = send(addr, Method::POST, "/v1/payments", &h, "{}").await;
    assert_eq!(
        retry.status,
        StatusCode::CREATED,
        "not stuck in progress for a whole lease"
    );
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(counter.get(), 1);
}

/// Sends a POST over a raw TCP connection and closes the socket after
/// `after`, before the answer: a client that really goes away (a pooled
/// HTTP client would keep the connection open in the background).
async fn hang_up_after(addr: SocketAddr, path: &str, headers: &[(&str, &str)], after: Duration) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let mut req = format!("POST {path} HTTP/1.1\r\nhost: {addr}\r\ncontent-length: 2\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n{}");
    stream.write_all(req.as_bytes()).await.expect("write");
    let mut buf = [0u8; 64];
    let early = tokio::time::timeout(after, stream.read(&mut buf)).await;
    assert!(early.is_err(), "no answer is expected this early");
    drop(stream);
}

/// A handler that records its answer itself (as a service does inside its
/// own database transaction) with the lease the layer hands it, and says so
/// with `UpstreamOutcome::Recorded`: the layer leaves that record alone, and
/// retries replay what the handler recorded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_may_record_its_own_answer() {
    use axum::Extension;
    use axum::response::IntoResponse;
    use idem::{FinalOutcome, Store, StoredResponse, Verdict};
    use idem_http::{Reserved, UpstreamOutcome};

    let store = Arc::new(MemoryStore::new());
    let counter = Counter::default();
    let handler = {
        let (store, counter) = (Arc::clone(&store), counter.clone());
        move |Extension(reserved): Extension<Reserved>| {
            let (store, counter) = (Arc::clone(&store), counter.clone());
            async move {
                let n = counter.0.fetch_add(1, Ordering::SeqCst) + 1;
                let body = format!(r#"{{"payment":{n},"operation":"{}"}}"#, reserved.key);
                let stored = StoredResponse::new(201, body.clone())
                    .with_header("content-type", "application/json");
                store
                    .resolve(
                        &reserved.scope,
                        &reserved.key,
                        &reserved.lease,
                        &FinalOutcome {
                            verdict: Verdict::Completed,
                            response: stored,
                            resource_id: Some(n.to_string()),
                            error_code: None,
                            retention: Duration::from_secs(3600),
                        },
                    )
                    .await
                    .expect("recorded by the handler");
                let mut resp = (
                    StatusCode::CREATED,
                    [("content-type", "application/json")],
                    body,
                )
                    .into_response();
                resp.extensions_mut().insert(UpstreamOutcome::Recorded);
                resp
            }
        }
    };
    let router = Router::new().route("/v1/payments", post(handler)).layer(
        IdempotencyLayer::from_arc(Arc::clone(&store))
            .with_routes(routes())
            .with_tenant(TenantSource::Authorization),
    );
    let addr = serve(router).await;
    let headers = [JSON, AUTH, ("idempotency-key", "self-recorded-1")];
    let first = send(addr, Method::POST, "/v1/payments", &headers, "{}").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(first.headers.get("idempotent-replayed").is_none());
    let again = send(addr, Method::POST, "/v1/payments", &headers, "{}").await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert_eq!(
        again.body, first.body,
        "the handler's own record is replayed"
    );
    assert_eq!(
        again
            .headers
            .get("idempotent-replayed")
            .and_then(|v| v.to_str().ok()),
        Some("true")
    );
    assert_eq!(counter.get(), 1);
}

/// A panic in the inner service, at once or after the work went pending,
/// is answered `502` with the outcome unknown (the request's task catches
/// it), and the key is not run again: the retry finds it in progress.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_handler_leaves_its_outcome_unknown_and_is_not_rerun() {
    use std::convert::Infallible;
    use tower::{Layer, ServiceExt};

    for pending_first in [false, true] {
        let runs = Counter::default();
        let inner = tower::service_fn({
            let runs = runs.clone();
            move |_req: http::Request<Full<Bytes>>| {
                let runs = runs.clone();
                async move {
                    runs.0.fetch_add(1, Ordering::SeqCst);
                    if pending_first {
                        tokio::task::yield_now().await;
                    }
                    panic!("handler bug (pending_first = {pending_first})");
                    #[allow(unreachable_code)]
                    Ok::<_, Infallible>(http::Response::new(Full::new(Bytes::new())))
                }
            }
        });
        let svc = IdempotencyLayer::new(MemoryStore::new())
            .with_routes(routes())
            .layer(inner);
        let request = || {
            http::Request::post("/v1/payments")
                .header(JSON.0, JSON.1)
                .header(AUTH.0, AUTH.1)
                .header("idempotency-key", "panics")
                .body(Full::new(Bytes::from_static(b"{}")))
                .expect("request")
        };
        let first = svc.clone().oneshot(request()).await.expect("answered");
        assert_eq!(first.status(), StatusCode::BAD_GATEWAY, "{pending_first}");
        assert_eq!(
            first.extensions().get::<idem_http::Decision>(),
            Some(&idem_http::Decision::OutcomeUnknown)
        );
        let retry = svc.oneshot(request()).await.expect("answered");
        assert_eq!(retry.status(), StatusCode::CONFLICT, "{pending_first}");
        assert_eq!(runs.get(), 1, "run once ({pending_first})");
    }
}

/// A payment service whose answer to a charge is lost after the charge is
/// made (`lost-*` keys) or before (`void-*`), with a lookup by key: the
/// held records are reconciled through it, and nothing runs twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_records_are_reconciled_through_the_route_s_lookup() {
    use std::collections::HashMap;
    use std::convert::Infallible;
    use std::sync::Mutex;

    use idem::reconcile::Schedule;
    use idem_http::{Lookup, UpstreamOutcome};
    use tower::{Layer, ServiceExt};

    let ledger: Arc<Mutex<HashMap<String, u32>>> = Arc::default();
    let lookups = Counter::default();
    let inner = tower::service_fn({
        let (ledger, lookups) = (Arc::clone(&ledger), lookups.clone());
        move |req: http::Request<Full<Bytes>>| {
            let (ledger, lookups) = (Arc::clone(&ledger), lookups.clone());
            async move {
                let key = req
                    .headers()
                    .get("idempotency-key")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                let mut resp = if req.method() == Method::GET {
                    lookups.0.fetch_add(1, Ordering::SeqCst);
                    assert_eq!(
                        req.headers()["authorization"],
                        AUTH.1,
                        "the tenant's credentials"
                    );
                    assert!(req.uri().path().ends_with(&key), "{}", req.uri());
                    match ledger.lock().expect("ledger").get(&key) {
                        Some(n) => {
                            http::Response::new(Full::new(Bytes::from(format!("charge {n}"))))
                        }
                        None => {
                            let mut r = http::Response::new(Full::new(Bytes::new()));
                            *r.status_mut() = StatusCode::NOT_FOUND;
                            r
                        }
                    }
                } else {
                    let mut ledger = ledger.lock().expect("ledger");
                    // The first POST of a key is recorded under "#key".
                    let first = ledger.insert(format!("#{key}"), 1).is_none();
                    if !key.starts_with("void") || !first {
                        *ledger.entry(key.clone()).or_default() += 1;
                    }
                    let mut r = http::Response::new(Full::new(Bytes::from("charged")));
                    *r.status_mut() = StatusCode::CREATED;
                    if first && (key.starts_with("lost") || key.starts_with("void")) {
                        // The answer broke off after sending: outcome unknown.
                        *r.status_mut() = StatusCode::BAD_GATEWAY;
                        r.extensions_mut().insert(UpstreamOutcome::MaybeSent);
                    }
                    if first && key.starts_with("lb") {
                        // A load balancer's time-out after the charge: a
                        // plain 502, which proves nothing either way.
                        *r.status_mut() = StatusCode::BAD_GATEWAY;
                    }
                    r
                };
                resp.headers_mut()
                    .insert("x-from", http::HeaderValue::from_static("inner"));
                Ok::<_, Infallible>(resp)
            }
        }
    });
    let lookup = Lookup::new(Method::GET, "/v1/payments/by-key/{key}")
        .expect("lookup")
        .with_status(StatusCode::CREATED)
        .with_schedule(
            Schedule::default()
                .with_first(Duration::from_millis(50))
                .with_settle(Duration::from_millis(600)),
        );
    let reconciled = Routes::default()
        .route(
            Method::POST,
            "/v1/payments",
            RoutePolicy::default()
                .with_require_key(true)
                .with_lookup(lookup),
        )
        .and_then(|r| r.route(Method::POST, "/v1/held", RoutePolicy::default()))
        .expect("routes");
    let svc = IdempotencyLayer::new(MemoryStore::new())
        .with_routes(reconciled)
        .layer(inner);
    let request = |path: &str, key: &str| {
        http::Request::post(path)
            .header(JSON.0, JSON.1)
            .header(AUTH.0, AUTH.1)
            .header("idempotency-key", key)
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    };
    // Retries `key` until it is answered 201, each answer before that 409.
    let until_created = |key: &'static str, tries: usize| {
        let svc = svc.clone();
        async move {
            for _ in 0..tries {
                let r = svc
                    .clone()
                    .oneshot(request("/v1/payments", key))
                    .await
                    .expect("answer");
                if r.status() == StatusCode::CREATED {
                    return r;
                }
                assert_eq!(r.status(), StatusCode::CONFLICT, "{key}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            panic!("{key}: no 201 after {tries} tries");
        }
    };
    // Lost after charging: the client is told the outcome is unknown and
    // when to come back; meanwhile it is being reconciled.
    let first = svc
        .clone()
        .oneshot(request("/v1/payments", "lost-1"))
        .await
        .expect("answer");
    assert_eq!(first.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(first.headers()["retry-after"], "1");
    let retry = svc
        .clone()
        .oneshot(request("/v1/payments", "lost-1"))
        .await
        .expect("answer");
    let (parts, problem) = read(retry).await;
    if parts.status == StatusCode::CONFLICT {
        assert!(String::from_utf8_lossy(&problem).contains("idempotency-outcome-reconciling"));
        assert!(parts.headers.contains_key("retry-after"));
    }
    let replay = until_created("lost-1", 100).await;
    let (parts, bytes) = read(replay).await;
    assert_eq!(parts.headers["idempotent-replayed"], "true");
    assert_eq!(parts.headers["x-from"], "inner");
    assert_eq!(
        &bytes[..],
        b"charge 1",
        "the lookup's answer, under the configured status"
    );
    assert_eq!(ledger.lock().expect("ledger")["lost-1"], 1, "charged once");

    // An intermediary's 502 after the charge: held and settled the same
    // way, never released to run again.
    let first = svc
        .clone()
        .oneshot(request("/v1/payments", "lb-1"))
        .await
        .expect("answer");
    assert_eq!(first.status(), StatusCode::BAD_GATEWAY);
    assert_eq!(first.headers()["retry-after"], "1");
    let settled = until_created("lb-1", 100).await;
    let (parts, bytes) = read(settled).await;
    assert_eq!(parts.headers["idempotent-replayed"], "true");
    assert_eq!(&bytes[..], b"charge 1");
    assert_eq!(ledger.lock().expect("ledger")["lb-1"], 1, "charged once");

    // Lost before charging: "not found" is believed after the settle time;
    // then the retry runs the charge, once.
    let first = svc
        .clone()
        .oneshot(request("/v1/payments", "void-1"))
        .await
        .expect("answer");
    assert_eq!(first.status(), StatusCode::BAD_GATEWAY);
    let started = std::time::Instant::now();
    let ran = until_created("void-1", 200).await;
    assert!(
        started.elapsed() >= Duration::from_millis(500),
        "not before the settle time"
    );
    assert!(
        ran.headers().get("idempotent-replayed").is_none(),
        "run, not replayed"
    );
    assert_eq!(ledger.lock().expect("ledger")["void-1"], 1, "charged once");
    assert!(lookups.get() >= 3);

    // No lookup: held for an operator, never run again, no Retry-After.
    let first = svc
        .clone()
        .oneshot(request("/v1/held", "lost-2"))
        .await
        .expect("answer");
    assert_eq!(first.status(), StatusCode::BAD_GATEWAY);
    assert!(first.headers().get("retry-after").is_none());
    let (parts, problem) = read(
        svc.clone()
            .oneshot(request("/v1/held", "lost-2"))
            .await
            .expect("answer"),
    )
    .await;
    assert_eq!(parts.status, StatusCode::CONFLICT);
    assert!(parts.headers.get("retry-after").is_none());
    assert!(
        String::from_utf8_lossy(&problem).contains("idempotency-outcome-held"),
        "{problem:?}"
    );
    assert_eq!(ledger.lock().expect("ledger")["lost-2"], 1);
}

async fn read<B>(resp: http::Response<B>) -> (http::response::Parts, Bytes)
where
    B: http_body::Body<Data = Bytes>,
    B::Error: std::fmt::Debug,
{
    use http_body_util::BodyExt;
    let (parts, body) = resp.into_parts();
    let bytes = body.collect().await.expect("body").to_bytes();
    (parts, bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_without_its_tenant_s_credential_is_refused_or_passed_unprotected() {
    let counter = Counter::default();
    let store = Arc::new(MemoryStore::new());
    let passing = Routes::default()
        .route(
            Method::POST,
            "/v1/big",
            RoutePolicy::default().with_on_missing_tenant(MissingTenant::Pass),
        )
        .expect("routes");
    let addr = serve(app(Arc::clone(&store), passing, counter.clone())).await;
    // No shared "anonymous" tenant: a caller without credentials can
    // neither read another's answer nor claim its key.
    let h = [JSON, ("idempotency-key", "k-anon")];
    let refused = send(addr, Method::POST, "/v1/payments", &h, "{}").await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    assert_eq!(refused.problem_type(), "tenant-missing");
    assert_eq!(counter.get(), 0, "nothing forwarded");
    assert!(store.is_empty(), "nothing recorded");
    // A route that passes such requests: forwarded, said so, not recorded.
    for _ in 0..2 {
        let passed = send(addr, Method::POST, "/v1/big", &h, "{}").await;
        assert_eq!(passed.status, StatusCode::CREATED);
        assert_eq!(passed.headers["idempotency-status"], "unprotected");
    }
    assert_eq!(counter.get(), 2);
    assert!(store.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authentication_failure_is_not_recorded() {
    let counter = Counter::default();
    let addr = serve(app(Arc::new(MemoryStore::new()), routes(), counter.clone())).await;
    for status in ["401", "403", "407"] {
        let key = format!("auth-{status}");
        let h = [JSON, AUTH, ("idempotency-key", key.as_str())];
        let denied = [
            JSON,
            AUTH,
            ("idempotency-key", key.as_str()),
            ("x-status", status),
        ];
        let first = send(addr, Method::POST, "/v1/payments", &denied, "{}").await;
        assert_eq!(first.status.as_str(), status);
        // The key is free again: the retry runs, and its answer is the one kept.
        let retry = send(addr, Method::POST, "/v1/payments", &h, "{}").await;
        assert_eq!(retry.status, StatusCode::CREATED, "{status}");
        assert!(
            retry.headers.get("idempotent-replayed").is_none(),
            "{status}"
        );
    }
    assert_eq!(counter.get(), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_key_is_one_request_on_one_resource() {
    let counter = Counter::default();
    let capture = Routes::default()
        .route(
            Method::POST,
            "/v1/orders/{id}/capture",
            RoutePolicy::default().with_require_key(true),
        )
        .and_then(|r| {
            r.route(
                Method::POST,
                "/v1/payments",
                RoutePolicy::default().with_require_key(true),
            )
        })
        .expect("routes");
    let addr = serve(app_with(
        Arc::new(MemoryStore::new()),
        capture,
        counter.clone(),
        keyed(3),
    ))
    .await;
    let h = [JSON, AUTH, ("idempotency-key", "capture-1")];
    let a = send(addr, Method::POST, "/v1/orders/ord_A/capture", &h, "{}").await;
    assert_eq!(a.status, StatusCode::CREATED);
    // The same key on order B: not A's answer replayed (B was never
    // captured), but a key reused for another request.
    let b = send(addr, Method::POST, "/v1/orders/ord_B/capture", &h, "{}").await;
    assert_eq!(b.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(b.problem_type(), "idempotency-key-reused");
    // A's own retry, spelled otherwise, is A's request.
    let again = send(addr, Method::POST, "/v1/orders//ord_A/capture/", &h, "{}").await;
    assert_eq!(again.headers["idempotent-replayed"], "true");
    assert_eq!(counter.get(), 1);
    // No spelling of a protected path skips its route's policy.
    for path in [
        "/v1/payments/",
        "//v1/payments",
        "/v1/./payments",
        "/v1/%70ayments",
    ] {
        let keyless = send(addr, Method::POST, path, &[JSON, AUTH], "{}").await;
        assert_eq!(keyless.status, StatusCode::BAD_REQUEST, "{path}");
        assert_eq!(keyless.problem_type(), "idempotency-key-missing", "{path}");
    }
    assert_eq!(counter.get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_across_the_keyed_hash_upgrade_gets_its_original_answer() {
    let counter = Counter::default();
    let store = Arc::new(MemoryStore::new());
    let body = r#"{"amount":100}"#;
    let h = [JSON, AUTH, ("idempotency-key", "before-upgrade")];
    // Before: the record as versions before this one wrote it (unkeyed
    // tenant; fingerprint of method, operation, sorted query, headers and
    // body, without the path).
    let scope = idem::Scope::new(
        &idem::fingerprint::unkeyed_tenant(AUTH.1.as_bytes()),
        "POST /v1/payments",
    )
    .expect("scope");
    let earlier_fp = idem::Fingerprint::builder()
        .part("method", b"POST")
        .part("operation", b"POST /v1/payments")
        .part("query", b"")
        .part("content-type", JSON.1.as_bytes())
        .json_body(body.as_bytes())
        .finish();
    let key: idem::IdempotencyKey = "before-upgrade".parse().expect("key");
    let engine = idem::Engine::from_arc(Arc::clone(&store));
    let idem::Begin::Execute(guard) = engine.begin(&scope, &key, earlier_fp).await.expect("begin")
    else {
        panic!("executes");
    };
    guard
        .complete(idem::StoredResponse::new(201, r#"{"charge":"before"}"#))
        .await
        .expect("recorded");
    let until = std::time::SystemTime::now() + Duration::from_secs(3600);
    // After, keyed (the gateway) or not (a library user without a
    // secret), still looking for records from before: the original answer.
    for (i, hashing) in [keyed(9), Hashing::unkeyed()].into_iter().enumerate() {
        let after = serve(app_with(
            Arc::clone(&store),
            routes(),
            counter.clone(),
            hashing.accept_v1_until(until),
        ))
        .await;
        let retry = send(after, Method::POST, "/v1/payments", &h, body).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{i}");
        assert_eq!(
            &retry.body[..],
            br#"{"charge":"before"}"#,
            "the original answer ({i})"
        );
        assert_eq!(retry.headers["idempotent-replayed"], "true");
        let other = send(after, Method::POST, "/v1/payments", &h, r#"{"amount":200}"#).await;
        assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY, "{i}");
        // A new key after the upgrade runs, and its retry replays as usual.
        let k = format!("after-upgrade-{i}");
        let fresh = [JSON, AUTH, ("idempotency-key", k.as_str())];
        let new = send(after, Method::POST, "/v1/payments", &fresh, body).await;
        let new_retry = send(after, Method::POST, "/v1/payments", &fresh, body).await;
        assert_eq!(new_retry.body, new.body);
    }
    assert_eq!(
        counter.get(),
        2,
        "charged once per new key, never for the old one"
    );
}

/// A route keyed on `X-Request-Id` (or `X-Idempotency-Key`), then on the
/// body's `/order/id`, with `sent_at` out of the fingerprint; another
/// whose fingerprint covers only `/amount` and `/currency`.
fn routes_keyed_where_clients_keep_keys() -> Routes {
    let p = |text: &str| text.parse::<idem_http::JsonPointer>().expect("pointer");
    let payments = RoutePolicy::default()
        .with_require_key(true)
        .with_key_headers(vec![
            http::HeaderName::from_static("x-request-id"),
            http::HeaderName::from_static("x-idempotency-key"),
        ])
        .with_key_from(p("/order/id"))
        .with_fingerprint_body(idem_http::BodyFields::Exclude(vec![p("/sent_at")]));
    let capture = RoutePolicy::default()
        .with_key_from(p("/ref"))
        .with_fingerprint_body(idem_http::BodyFields::Include(vec![
            p("/amount"),
            p("/currency"),
        ]));
    Routes::default()
        .route(Method::POST, "/v1/payments", payments)
        .and_then(|r| r.route(Method::POST, "/v1/orders/{id}/capture", capture))
        .expect("routes")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_and_fingerprints_come_from_where_the_route_says() {
    let counter = Counter::default();
    let store = Arc::new(MemoryStore::new());
    let routes = routes_keyed_where_clients_keep_keys();
    let addr = serve(app(Arc::clone(&store), routes, counter.clone())).await;
    let pay = async |headers: &[(&str, &str)], body: &str| {
        let mut h = vec![JSON, AUTH];
        h.extend_from_slice(headers);
        send(addr, Method::POST, "/v1/payments", &h, body.to_owned()).await
    };

    // The first configured header the request carries is the key; a retry
    // that stamps another `sent_at` is the same request.
    let first = pay(&[("x-request-id", "r-1")], r#"{"amount":5,"sent_at":1}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = pay(&[("x-request-id", "r-1")], r#"{"sent_at":2,"amount":5}"#).await;
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.body, first.body);
    // The second header name is the same key space.
    let other_name = pay(
        &[("x-idempotency-key", "r-1")],
        r#"{"amount":5,"sent_at":3}"#,
    )
    .await;
    assert_eq!(other_name.body, first.body);
    // Both sent: the first in the list wins.
    let both = pay(
        &[("x-idempotency-key", "r-2"), ("x-request-id", "r-1")],
        r#"{"amount":5}"#,
    )
    .await;
    assert_eq!(both.body, first.body);
    // What the fingerprint covers still counts.
    let changed = pay(&[("x-request-id", "r-1")], r#"{"amount":6,"sent_at":1}"#).await;
    assert_eq!(changed.problem_type(), "idempotency-key-reused");
    assert_eq!(counter.get(), 1);

    // No configured header: the body's field is the key.
    let by_body = pay(&[], r#"{"order":{"id":"ord_9"},"amount":7}"#).await;
    assert_eq!(by_body.status, StatusCode::CREATED);
    let by_body_again = pay(&[], r#"{"amount":7,"order":{"id":"ord_9"}}"#).await;
    assert_eq!(by_body_again.body, by_body.body);
    // An integer field is its text.
    let numeric = pay(&[], r#"{"order":{"id":42},"amount":1}"#).await;
    assert_eq!(numeric.status, StatusCode::CREATED);
    let numeric_as_header = pay(
        &[("x-request-id", "42")],
        r#"{"order":{"id":42},"amount":1}"#,
    )
    .await;
    assert_eq!(numeric_as_header.body, numeric.body);
    assert_eq!(counter.get(), 3);

    // `Idempotency-Key` is not one of this route's headers, and the body
    // lacks the field: the key is missing, and the answer says where to put it.
    let missing = pay(&[("idempotency-key", "k")], r#"{"amount":5}"#).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.problem_type(), "idempotency-key-missing");
    let detail = String::from_utf8_lossy(&missing.body).into_owned();
    for named in ["X-Request-Id", "X-Idempotency-Key", "/order/id"] {
        assert!(detail.contains(named), "{named} in {detail}");
    }
    // A field that is no key, and a header sent twice, are refused.
    for (headers, body, kind) in [
        (
            vec![],
            r#"{"order":{"id":{"n":1}}}"#,
            "idempotency-key-invalid",
        ),
        (vec![], r#"{"order":{"id":""}}"#, "idempotency-key-invalid"),
        (
            vec![("x-request-id", "a"), ("x-request-id", "b")],
            "{}",
            "idempotency-key-ambiguous",
        ),
        (
            vec![],
            r#"{"order":{"id":"a"},"order":{"id":"b"}}"#,
            "request-body-ambiguous-json",
        ),
    ] {
        let a = pay(&headers, body).await;
        assert_eq!(a.status, StatusCode::BAD_REQUEST, "{body}");
        assert_eq!(a.problem_type(), kind, "{body}");
    }
    assert_eq!(counter.get(), 3, "nothing refused was forwarded");

    // Only `/amount` and `/currency` are covered: a note is not, and a
    // field that goes missing is another request.
    let capture = async |headers: &[(&str, &str)], body: &str| {
        let mut h = vec![JSON, AUTH];
        h.extend_from_slice(headers);
        send(
            addr,
            Method::POST,
            "/v1/orders/1/capture",
            &h,
            body.to_owned(),
        )
        .await
    };
    let key = [("idempotency-key", "c-1")];
    let captured = capture(&key, r#"{"amount":5,"currency":"eur","note":"a"}"#).await;
    assert_eq!(captured.status, StatusCode::CREATED);
    let noted = capture(&key, r#"{"note":"b","currency":"eur","amount":5}"#).await;
    assert_eq!(noted.body, captured.body);
    let without_currency = capture(&key, r#"{"amount":5}"#).await;
    assert_eq!(without_currency.problem_type(), "idempotency-key-reused");
    let null_currency = capture(&key, r#"{"amount":5,"currency":null}"#).await;
    assert_eq!(null_currency.problem_type(), "idempotency-key-reused");
    assert_eq!(counter.get(), 4);
    // Keyless, and no `/ref` in the body: not required here, so forwarded.
    for _ in 0..2 {
        assert_eq!(
            capture(&[], r#"{"amount":1}"#).await.status,
            StatusCode::CREATED
        );
    }
    // A body that is not JSON holds no field: forwarded unread.
    let plain = send(
        addr,
        Method::POST,
        "/v1/orders/1/capture",
        &[("content-type", "text/plain"), AUTH],
        "ref=r-9".to_owned(),
    )
    .await;
    assert_eq!(plain.status, StatusCode::CREATED);
    assert!(plain.header("idempotency-status").is_none());
    // The body's `/ref` keys it (once).
    for _ in 0..2 {
        capture(&[], r#"{"ref":"r-9","amount":1}"#).await;
    }
    assert_eq!(counter.get(), 8);
}

/// Amounts differing in the 17th significant digit are one double but two
/// amounts to a Decimal upstream: the second is a key reused for another
/// request. A 64-bit id sent as a JSON number is an ordinary request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numbers_are_compared_as_the_decimals_a_payment_service_reads() {
    let counter = Counter::default();
    let addr = serve(app_with(
        Arc::new(MemoryStore::new()),
        routes(),
        counter.clone(),
        keyed(9),
    ))
    .await;
    let h = [JSON, AUTH, ("idempotency-key", "amount-1")];
    let first = send(addr, Method::POST, "/v1/payments", &h, r#"{"amount":0.1}"#).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let other = send(
        addr,
        Method::POST,
        "/v1/payments",
        &h,
        r#"{"amount":0.10000000000000001}"#,
    )
    .await;
    assert_eq!(
        other.status,
        StatusCode::UNPROCESSABLE_ENTITY,
        "{:?}",
        other.body
    );
    // The same amount spelled another way is the same request.
    let same = send(addr, Method::POST, "/v1/payments", &h, r#"{"amount":1e-1}"#).await;
    assert_eq!(same.status, StatusCode::CREATED);
    assert_eq!(same.headers["idempotent-replayed"], "true");
    let id = [JSON, AUTH, ("idempotency-key", "id-64")];
    let body = r#"{"account":18446744073709551617,"amount":100}"#;
    let created = send(addr, Method::POST, "/v1/payments", &id, body).await;
    assert_eq!(created.status, StatusCode::CREATED, "{:?}", created.body);
    let retry = send(addr, Method::POST, "/v1/payments", &id, body).await;
    assert_eq!(retry.body, created.body);
    let neighbour = r#"{"account":18446744073709551616,"amount":100}"#;
    let reused = send(addr, Method::POST, "/v1/payments", &id, neighbour).await;
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(counter.get(), 2, "one charge per request");
}

/// Records written before numbers were read exactly (their `v2:`
/// fingerprints, taken from the version before) answer their retries:
/// replayed, never run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_across_the_exact_numbers_upgrade_gets_its_original_answer() {
    let counter = Counter::default();
    let store = Arc::new(MemoryStore::new());
    let secret = idem::HashSecret::from_bytes(&[9; 32]).expect("32 bytes");
    let scope =
        idem::Scope::new(&secret.tenant(AUTH.1.as_bytes()), "POST /v1/payments").expect("scope");
    let engine = idem::Engine::from_arc(Arc::clone(&store));
    // What the version before wrote for these requests under keyed(9).
    let before = [
        (
            "v2-plain",
            r#"{"amount":100,"currency":"EUR"}"#,
            "22ed78f022f8018f6d92b020d31d6c49379e178423aa90c03c818c1e4deca833",
        ),
        (
            "v2-long",
            r#"{"amount":0.10000000000000001}"#,
            "4ad24c301c339f3335b918ca98c2ca490327b9dde14ddbc90ad883a06917ceef",
        ),
    ];
    for (key, _, digest) in before {
        let digest = idem::fingerprint::from_hex(digest)
            .and_then(|d| <[u8; 32]>::try_from(d).ok())
            .expect("32 bytes");
        let key: idem::IdempotencyKey = key.parse().expect("key");
        let idem::Begin::Execute(guard) = engine
            .begin(&scope, &key, idem::Fingerprint::from_digest(digest))
            .await
            .expect("begin")
        else {
            panic!("executes");
        };
        guard
            .complete(idem::StoredResponse::new(201, r#"{"charge":"before"}"#))
            .await
            .expect("recorded");
    }
    let after = serve(app_with(
        Arc::clone(&store),
        routes(),
        counter.clone(),
        keyed(9),
    ))
    .await;
    for (key, body, _) in before {
        let h = [JSON, AUTH, ("idempotency-key", key)];
        let retry = send(after, Method::POST, "/v1/payments", &h, body).await;
        assert_eq!(retry.status, StatusCode::CREATED, "{key}: {:?}", retry.body);
        assert_eq!(&retry.body[..], br#"{"charge":"before"}"#, "{key}");
        assert_eq!(retry.headers["idempotent-replayed"], "true", "{key}");
        let other = send(after, Method::POST, "/v1/payments", &h, r#"{"amount":7}"#).await;
        assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY, "{key}");
    }
    assert_eq!(counter.get(), 0, "nothing ran again");
}

/// `with_mismatch_status(400)`: a key reused with another request gets
/// 400 on that route, as Stripe answers; a route left at the default
/// answers 422. Neither runs the handler again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_key_gets_the_route_s_mismatch_status() {
    let counter = Counter::default();
    let routes = Routes::default()
        .route(
            Method::POST,
            "/v1/payments",
            RoutePolicy::default().with_mismatch_status(StatusCode::BAD_REQUEST),
        )
        .and_then(|r| r.route(Method::POST, "/v1/big", RoutePolicy::default()))
        .expect("routes");
    let addr = serve(app(Arc::new(MemoryStore::new()), routes, counter.clone())).await;
    for (path, mismatch) in [
        ("/v1/payments", StatusCode::BAD_REQUEST),
        ("/v1/big", StatusCode::UNPROCESSABLE_ENTITY),
    ] {
        let h = [JSON, AUTH, ("idempotency-key", "reused")];
        let first = send(addr, Method::POST, path, &h, r#"{"amount":1}"#).await;
        assert_eq!(first.status, StatusCode::CREATED, "{path}");
        let other = send(addr, Method::POST, path, &h, r#"{"amount":2}"#).await;
        assert_eq!(other.status, mismatch, "{path}");
        assert_eq!(other.problem_type(), "idempotency-key-reused", "{path}");
    }
    assert_eq!(counter.get(), 2, "each route ran its first request only");
}

/// `with_path_spelling(Refuse)`: a path the route matches only once
/// normalised (a doubled slash, an escaped letter) is refused with `400
/// request-path-not-canonical`, keyed or not: nothing is forwarded or
/// recorded, and the route's own spelling is served. A route left at the
/// default (`Normalise`) forwards such a path in its normal form.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_spelled_otherwise_is_refused_only_where_the_route_says() {
    use std::convert::Infallible;
    use std::sync::Mutex;

    use idem_http::PathSpelling;
    use tower::{Layer, ServiceExt};

    let forwarded: Arc<Mutex<Vec<String>>> = Arc::default();
    let inner = tower::service_fn({
        let forwarded = Arc::clone(&forwarded);
        move |req: http::Request<Full<Bytes>>| {
            forwarded
                .lock()
                .expect("paths")
                .push(req.uri().path().to_owned());
            let mut created = http::Response::new(Full::new(Bytes::from_static(b"made")));
            *created.status_mut() = StatusCode::CREATED;
            std::future::ready(Ok::<_, Infallible>(created))
        }
    });
    let store = Arc::new(MemoryStore::new());
    let routes = Routes::default()
        .route(
            Method::POST,
            "/v1/payments",
            RoutePolicy::default().with_path_spelling(PathSpelling::Refuse),
        )
        .and_then(|r| {
            r.route(
                Method::POST,
                "/v1/orders/{id}/capture",
                RoutePolicy::default(),
            )
        })
        .expect("routes");
    let svc = IdempotencyLayer::from_arc(Arc::clone(&store))
        .with_routes(routes)
        .layer(inner);
    let post = |path: &str, key: Option<&str>| {
        let mut req = http::Request::post(path)
            .header(JSON.0, JSON.1)
            .header(AUTH.0, AUTH.1);
        if let Some(key) = key {
            req = req.header("idempotency-key", key);
        }
        req.body(Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    };
    for (path, key) in [
        ("/v1//payments", Some("spelled")),
        ("/v1/%70ayments", Some("spelled")),
        ("/v1//payments", None),
    ] {
        let refused = svc.clone().oneshot(post(path, key)).await.expect("answer");
        let (parts, problem) = read(refused).await;
        assert_eq!(parts.status, StatusCode::BAD_REQUEST, "{path}");
        assert!(
            String::from_utf8_lossy(&problem).contains("request-path-not-canonical"),
            "{path}: {problem:?}"
        );
    }
    assert!(
        forwarded.lock().expect("paths").is_empty(),
        "nothing forwarded"
    );
    let listed = idem::ListRecords::list(&*store, &idem::ListFilter::default())
        .await
        .expect("list");
    assert!(listed.records.is_empty(), "nothing recorded");
    for path in ["/v1/payments", "/v1//orders/42/capture"] {
        let served = svc
            .clone()
            .oneshot(post(path, Some("spelled")))
            .await
            .expect("answer");
        assert_eq!(served.status(), StatusCode::CREATED, "{path}");
    }
    assert_eq!(
        *forwarded.lock().expect("paths"),
        ["/v1/payments", "/v1/orders/42/capture"],
        "the normal form forwarded"
    );
}

/// `with_reconcile_scans`: a record held by another process (its outcome
/// unknown, its client gone) that no request of this layer ever named is
/// found by listing the store, looked up through the route's lookup and
/// settled with its answer, which the client's retry then gets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scans_find_and_settle_a_record_another_process_left_held() {
    use std::convert::Infallible;

    use idem::reconcile::Schedule;
    use idem::{ListFilter, ListRecords, RecordState};
    use idem_http::{Lookup, UpstreamOutcome};
    use tower::{Layer, ServiceExt};

    let charges = Counter::default();
    let inner = tower::service_fn({
        let charges = charges.clone();
        move |req: http::Request<Full<Bytes>>| {
            let charges = charges.clone();
            async move {
                let path = req.uri().path().to_owned();
                let resp = if req.method() == Method::POST {
                    // Charged, and the answer lost after sending.
                    charges.0.fetch_add(1, Ordering::SeqCst);
                    let mut r = http::Response::new(Full::new(Bytes::new()));
                    *r.status_mut() = StatusCode::BAD_GATEWAY;
                    r.extensions_mut().insert(UpstreamOutcome::MaybeSent);
                    r
                } else if path == "/v1/payments/by-key/orphan-1" {
                    http::Response::new(Full::new(Bytes::from("charge 1")))
                } else {
                    let mut r = http::Response::new(Full::new(Bytes::new()));
                    *r.status_mut() = StatusCode::NOT_FOUND;
                    r
                };
                Ok::<_, Infallible>(resp)
            }
        }
    });
    let store = Arc::new(MemoryStore::new());
    let tenant = || TenantSource::Single("acme".to_owned());
    let request = || {
        http::Request::post("/v1/payments")
            .header(JSON.0, JSON.1)
            .header("idempotency-key", "orphan-1")
            .body(Full::new(Bytes::from_static(b"{}")))
            .expect("request")
    };
    // The process that died: no lookup, its record held (with a short
    // lease, which lapses before anyone else may settle the record).
    let short_lease = Routes::default()
        .route(
            Method::POST,
            "/v1/payments",
            RoutePolicy::default()
                .with_engine(Policy::default().with_lease(Duration::from_millis(200))),
        )
        .expect("routes");
    let gone = IdempotencyLayer::from_arc(Arc::clone(&store))
        .with_routes(short_lease)
        .with_tenant(tenant())
        .layer(inner.clone());
    let lost = gone.oneshot(request()).await.expect("answer");
    assert_eq!(lost.status(), StatusCode::BAD_GATEWAY);
    let processing = ListFilter {
        state: Some(RecordState::Processing),
        limit: 10,
        ..ListFilter::default()
    };
    let held = store.list(&processing).await.expect("list").records;
    assert!(held.len() == 1 && held[0].is_outcome_unknown(), "{held:?}");

    let lookup = Lookup::new(Method::GET, "/v1/payments/by-key/{key}")
        .expect("lookup")
        .with_status(StatusCode::CREATED)
        .with_schedule(Schedule::default().with_first(Duration::from_millis(50)));
    let routes = Routes::default()
        .route(
            Method::POST,
            "/v1/payments",
            RoutePolicy::default().with_lookup(lookup),
        )
        .expect("routes");
    let svc = IdempotencyLayer::from_arc(Arc::clone(&store))
        .with_routes(routes)
        .with_tenant(tenant())
        .with_reconcile_scans(Some(Duration::from_millis(50)))
        .layer(inner);
    // Lookups reach the inner service from the layer's first request on:
    // one that has nothing to do with the held record.
    let unrelated = svc
        .clone()
        .oneshot(
            http::Request::get("/v1/health")
                .body(Full::new(Bytes::new()))
                .expect("request"),
        )
        .await
        .expect("answer");
    assert_eq!(unrelated.status(), StatusCode::NOT_FOUND);
    let completed = ListFilter {
        state: Some(RecordState::Completed),
        limit: 10,
        ..ListFilter::default()
    };
    eventually("a scan finds and settles the held record", async || {
        store.list(&completed).await.expect("list").records.len() == 1
    })
    .await;
    let (parts, body) = read(svc.oneshot(request()).await.expect("answer")).await;
    assert_eq!(parts.status, StatusCode::CREATED);
    assert_eq!(parts.headers["idempotent-replayed"], "true");
    assert_eq!(&body[..], b"charge 1");
    assert_eq!(charges.get(), 1, "charged once");
}

/// A JSON-RPC service behind the layer: each call counted, answered with
/// the call's own id; a tool named `broken` answers a server error, one
/// named `strict` an invalid-params error.
async fn rpc(
    State(c): State<Counter>,
    body: Bytes,
) -> (StatusCode, [(&'static str, &'static str); 2], String) {
    let n = c.0.fetch_add(1, Ordering::SeqCst) + 1;
    let call: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let id = call["id"].to_string();
    let answer = match call["params"]["name"].as_str() {
        Some("broken") => format!(
            r#"{{"jsonrpc":"2.0","id":{id},"error":{{"code":-32603,"message":"run {n}"}}}}"#
        ),
        Some("strict") => format!(
            r#"{{"jsonrpc":"2.0","id":{id},"error":{{"code":-32602,"message":"run {n}"}}}}"#
        ),
        _ => format!(
            r#"{{"jsonrpc":"2.0","id":{id},"result":{{"content":[{{"type":"text","text":"run {n}"}}],"isError":false}}}}"#
        ),
    };
    (
        StatusCode::OK,
        [
            ("content-type", "application/json"),
            ("mcp-session-id", "session-of-the-first-call"),
        ],
        answer,
    )
}

#[tokio::test]
async fn json_rpc_calls_run_once_and_answer_in_json_rpc() {
    use idem_http::jsonrpc::{JsonRpc, MethodRule, TOOLS_CALL};
    let counter = Counter::default();
    let routes = Routes::default()
        .route(
            Method::POST,
            "/mcp",
            RoutePolicy::default().with_jsonrpc(JsonRpc::new(vec![
                MethodRule::new(TOOLS_CALL).with_require_key(true),
            ])),
        )
        .expect("route");
    let router = Router::new()
        .route("/mcp", post(rpc))
        .with_state(counter.clone())
        .layer(IdempotencyLayer::new(MemoryStore::new()).with_routes(routes));
    let addr = serve(router).await;
    let call = |id: &str, name: &str, cents: u32, key: &str| {
        format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/call","params":{{"name":"{name}","arguments":{{"cents":{cents}}},"_meta":{{"idempotencyKey":"{key}","progressToken":{id}}}}}}}"#
        )
    };
    let post = |body: String| async move {
        let answer = send(
            addr,
            Method::POST,
            "/mcp",
            &[
                ("content-type", "application/json"),
                ("authorization", "Bearer agent-1"),
            ],
            body,
        )
        .await;
        let json: serde_json::Value = serde_json::from_slice(&answer.body).expect("json");
        (answer, json)
    };
    let (first, v) = post(call("1", "charge", 500, "k-1")).await;
    assert_eq!(first.status, StatusCode::OK);
    assert_eq!(
        (v["id"].clone(), v["result"]["content"][0]["text"].clone()),
        (serde_json::json!(1), serde_json::json!("run 1"))
    );
    // The retry, with its own id and progress token: the stored answer,
    // given the retry's id; the session id of the first call not handed on.
    let (retry, v) = post(call("\"retry-2\"", "charge", 500, "k-1")).await;
    assert_eq!(retry.header("idempotent-replayed"), Some("true"));
    assert_eq!(retry.header("mcp-session-id"), None);
    assert_eq!(v["id"], "retry-2");
    assert_eq!(v["result"]["content"][0]["text"], "run 1");
    assert_eq!(counter.get(), 1);
    // The same key with other arguments: an error object, not a run.
    let (reused, v) = post(call("3", "charge", 501, "k-1")).await;
    assert_eq!(reused.status, StatusCode::OK);
    assert_eq!(v["id"], 3);
    assert_eq!(v["error"]["code"], -31003);
    assert_eq!(v["error"]["data"]["code"], "idempotency-key-reused");
    // No key where one is required: refused, in JSON-RPC.
    let (_, v) = post(r#"{"jsonrpc":"2.0","id":4,"method":"tools/call","params":{"name":"charge","arguments":{}}}"#.to_owned()).await;
    assert_eq!(
        (v["id"].clone(), v["error"]["code"].clone()),
        (serde_json::json!(4), serde_json::json!(-31001))
    );
    // Unprotected methods run every time.
    for id in [5, 6] {
        let (_, v) = post(format!(
            r#"{{"jsonrpc":"2.0","id":{id},"method":"tools/list"}}"#
        ))
        .await;
        assert_eq!(v["id"], id);
    }
    assert_eq!(counter.get(), 3);
    // Invalid params are final: stored and replayed. A server error is
    // stored too by default (on_server_error = "store"), as a 500 would be.
    for name in ["strict", "broken"] {
        let (_, first) = post(call("7", name, 1, &format!("k-{name}"))).await;
        let (again, v) = post(call("8", name, 1, &format!("k-{name}"))).await;
        assert_eq!(again.header("idempotent-replayed"), Some("true"), "{name}");
        assert_eq!(v["id"], 8);
        assert_eq!(v["error"]["message"], first["error"]["message"], "{name}");
    }
    assert_eq!(counter.get(), 5);
}

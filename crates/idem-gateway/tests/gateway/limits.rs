//! `[limits]` through the real gateway binary: slow clients, oversized
//! heads, a connection cap, and overload shed with `503` + `Retry-After`
//! before anything is recorded or forwarded.

use std::path::Path;
use std::time::{Duration, Instant};

use http::{Method, StatusCode};
use idem_testkit::client::{metric, send, try_send, until_status};
use idem_testkit::gateway::{GatewayProcess as Gateway, sqlite_store};
use idem_testkit::upstream::CountingUpstream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const IDEM: &str = env!("CARGO_BIN_EXE_idem");

const ROUTES: &str = r#"
[[route]]
method = "POST"
path = "/v1/payments"
require_key = true
"#;

async fn start(dir: &Path, limits: &str, up: &CountingUpstream) -> Gateway {
    let config = format!("{ROUTES}\n[limits]\n{limits}");
    Gateway::builder(IDEM, dir)
        .config(&config)
        .upstream(&up.url())
        .store(&sqlite_store(dir))
        .start()
        .await
}

/// Writes `head` (and `body`) on a fresh connection and returns what the
/// gateway answered before closing or within `wait`.
async fn raw(addr: std::net::SocketAddr, bytes: &[u8], wait: Duration) -> String {
    let mut conn = TcpStream::connect(addr).await.expect("connect");
    conn.write_all(bytes).await.expect("write");
    read_for(&mut conn, wait).await
}

/// Reads until the peer closes, or until `wait` passes.
async fn read_for(conn: &mut TcpStream, wait: Duration) -> String {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(wait, conn.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

fn status_of(answer: &str) -> Option<u16> {
    answer.split(' ').nth(1)?.parse().ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_and_oversized_heads_get_their_answers_and_forward_nothing() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(
        dir.path(),
        "header_read_timeout = \"1s\"\nbody_read_timeout = \"1s\"\nmax_headers = 20\nmax_header_bytes = \"16KiB\"\n",
        &up,
    )
    .await;

    // A head that never ends: the connection is closed once the header
    // time-out passes, long before the test gives up.
    let started = Instant::now();
    let answer = raw(
        gw.addr,
        b"POST /v1/payments HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk_test_caller\r\nidempotency-key: slow-head\r\n",
        Duration::from_secs(20),
    )
    .await;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(20),
        "closed after {took:?}: {answer:?}"
    );

    // Too many header fields, and too many header bytes: 431.
    let mut many = String::from(
        "POST /v1/payments HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk_test_caller\r\nidempotency-key: many\r\n",
    );
    for i in 0..30 {
        many.push_str(&format!("x-filler-{i}: {i}\r\n"));
    }
    many.push_str("content-length: 0\r\n\r\n");
    let answer = raw(gw.addr, many.as_bytes(), Duration::from_secs(10)).await;
    assert_eq!(status_of(&answer), Some(431), "{answer:?}");
    let big = format!(
        "POST /v1/payments HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk_test_caller\r\nidempotency-key: big\r\nx-big: {}\r\ncontent-length: 0\r\n\r\n",
        "a".repeat(20 << 10)
    );
    let answer = raw(gw.addr, big.as_bytes(), Duration::from_secs(10)).await;
    assert_eq!(status_of(&answer), Some(431), "{answer:?}");

    // A body that stalls half-way: 408 with its problem type, nothing
    // recorded, so the same key with the whole body then runs once.
    let mut conn = TcpStream::connect(gw.addr).await.expect("connect");
    conn.write_all(
        b"POST /v1/payments HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk_test_caller\r\nidempotency-key: slow-body\r\ncontent-type: application/json\r\ncontent-length: 20\r\n\r\n{\"amount\":",
    )
    .await
    .expect("write");
    let answer = read_for(&mut conn, Duration::from_secs(20)).await;
    assert_eq!(status_of(&answer), Some(408), "{answer:?}");
    assert!(answer.contains("request-body-timeout"), "{answer:?}");
    assert_eq!(up.total(), 0, "nothing reached the upstream");

    let retry = gw
        .post(
            "/v1/payments",
            &[
                ("idempotency-key", "slow-body"),
                ("content-type", "application/json"),
            ],
            "{\"amount\": 1234567}",
        )
        .await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    assert_eq!(up.executions("slow-body"), 1);
    assert_eq!(up.total(), 1);
    gw.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_max_connections_new_connections_wait_for_a_free_one() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(
        dir.path(),
        "max_connections = 2\nmax_connections_per_peer = 0\n",
        &up,
    )
    .await;

    let mut held = Vec::new();
    for _ in 0..2 {
        let mut conn = TcpStream::connect(gw.addr).await.expect("connect");
        conn.write_all(b"GET /held HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .expect("write");
        let mut buf = [0u8; 12];
        conn.read_exact(&mut buf).await.expect("answered");
        assert_eq!(&buf, b"HTTP/1.1 201", "upstream answers GET 201");
        held.push(conn);
    }
    // The third connection is made by the kernel, but the gateway does not
    // take it while two are open.
    let mut third = TcpStream::connect(gw.addr).await.expect("connect");
    third
        .write_all(b"GET /third HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .expect("write");
    let early = read_for(&mut third, Duration::from_millis(700)).await;
    assert_eq!(early, "", "answered while the gateway was full");
    assert_eq!(up.total(), 2);

    drop(held.pop());
    let answer = read_for(&mut third, Duration::from_secs(20)).await;
    assert_eq!(status_of(&answer), Some(201), "{answer:?}");
    assert_eq!(up.total(), 3);
    gw.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ten_times_the_capacity_is_shed_with_503_and_retries_run_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(
        dir.path(),
        "max_in_flight = 4\nmax_in_flight_per_peer = 0\nqueue_wait = \"20ms\"\n",
        &up,
    )
    .await;
    let pid = gw.child.id().expect("running");

    // 40 clients at once against 4 slots, each request holding its slot
    // for 300 ms upstream: ten times what the gateway takes on.
    let keys: Vec<String> = (0..40).map(|i| format!("storm-{i}")).collect();
    let addr = gw.addr;
    let first: Vec<_> = keys
        .iter()
        .map(|key| {
            let key = key.clone();
            tokio::spawn(async move {
                let answer = send(
                    addr,
                    Method::POST,
                    "/v1/payments",
                    &[
                        ("authorization", "Bearer sk_test_caller"),
                        ("idempotency-key", &key),
                        ("x-delay-ms", "300"),
                    ],
                    "{}",
                )
                .await;
                (key, answer)
            })
        })
        .collect();
    let mut shed = Vec::new();
    let mut served = 0;
    for task in first {
        let (key, answer) = task.await.expect("join");
        match answer.status {
            StatusCode::CREATED => served += 1,
            StatusCode::SERVICE_UNAVAILABLE => {
                assert_eq!(answer.problem_type(), "server-overloaded");
                assert_eq!(answer.header("retry-after"), Some("1"));
                shed.push(key);
            }
            other => panic!("{key}: unexpected {other}: {:?}", answer.body),
        }
    }
    assert!(served >= 4, "every slot served: {served}");
    assert!(!shed.is_empty(), "ten times the capacity was all admitted");
    assert_eq!(
        up.total(),
        served,
        "a shed request never reaches the upstream"
    );
    let counted = metric(gw.admin, "idem_requests_shed_total", "").await;
    assert_eq!(counted, shed.len() as f64);

    // The gateway recovers on its own: each shed key, retried as its hint
    // says, runs exactly once, and no served key runs again.
    tokio::time::sleep(Duration::from_secs(1)).await;
    for key in &keys {
        let answer = try_send(
            addr,
            Method::POST,
            "/v1/payments",
            &[
                ("authorization", "Bearer sk_test_caller"),
                ("idempotency-key", key),
                ("x-delay-ms", "300"),
            ],
            "{}",
        )
        .await
        .expect("answered");
        assert_eq!(answer.status, StatusCode::CREATED, "{key}");
        assert_eq!(up.executions(key), 1, "{key} ran once");
    }
    assert_eq!(up.total(), 40);

    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("proc status");
    let hwm_kib: u64 = status
        .lines()
        .find(|l| l.starts_with("VmHWM"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .expect("VmHWM");
    eprintln!(
        "overload: {served} served, {} shed, peak RSS {} MiB",
        shed.len(),
        hwm_kib / 1024
    );
    gw.terminate().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_kept_going_for_a_client_that_left_still_holds_its_slot() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(
        dir.path(),
        "max_in_flight = 1\nmax_in_flight_per_peer = 0\nqueue_wait = \"0s\"\n",
        &up,
    )
    .await;

    // A client sends a slow protected request and hangs up.
    let mut conn = TcpStream::connect(gw.addr).await.expect("connect");
    conn.write_all(
        b"POST /v1/payments HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk_test_caller\r\nidempotency-key: left\r\nx-delay-ms: 1500\r\ncontent-length: 2\r\n\r\n{}",
    )
    .await
    .expect("write");
    // Hung up once the upstream has it: its 1.5 s of work has begun.
    let deadline = Instant::now() + Duration::from_secs(30);
    while up.executions("left") == 0 {
        assert!(
            Instant::now() < deadline,
            "the upstream never got the request"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop(conn);

    // Its work goes on, and still counts against max_in_flight.
    let busy = send(
        gw.addr,
        Method::POST,
        "/v1/payments",
        &[
            ("authorization", "Bearer sk_test_caller"),
            ("idempotency-key", "other"),
        ],
        "{}",
    )
    .await;
    assert_eq!(
        busy.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{:?}",
        busy.body
    );
    assert_eq!(busy.problem_type(), "server-overloaded");

    // Once it is recorded, the slot is free and the answer is kept (until
    // then a retry is shed: the work still holds the only slot).
    let replay = until_status(
        async || {
            send(
                gw.addr,
                Method::POST,
                "/v1/payments",
                &[
                    ("authorization", "Bearer sk_test_caller"),
                    ("idempotency-key", "left"),
                    ("x-delay-ms", "1500"),
                ],
                "{}",
            )
            .await
        },
        StatusCode::CREATED,
    )
    .await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(up.executions("left"), 1);
    assert_eq!(up.executions("other"), 0);
    gw.terminate().await;
}

/// Connections that never send a byte (part of the trust work, item 3):
/// each is closed once `header_read_timeout` passes, so a crowd of them
/// cannot hold every place under `max_connections` and a real client is
/// still served; on the admin listener as on the client one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_are_closed_and_cannot_crowd_out_a_client() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(
        dir.path(),
        "max_connections = 20\nmax_connections_per_peer = 0\nheader_read_timeout = \"1s\"\n",
        &up,
    )
    .await;
    let mut silent = Vec::new();
    for _ in 0..40 {
        silent.push(TcpStream::connect(gw.addr).await.expect("connect"));
    }
    // A client behind them all: answered once the silent ones are closed.
    let answer = tokio::time::timeout(
        Duration::from_secs(30),
        send(gw.addr, Method::GET, "/after-the-crowd", &[], ""),
    )
    .await
    .expect("a real client is served despite 40 silent connections");
    assert_eq!(answer.status, StatusCode::CREATED);
    // The admin listener too: a cap of its own, the same deadline.
    let mut silent_admin = Vec::new();
    for _ in 0..80 {
        silent_admin.push(TcpStream::connect(gw.admin).await.expect("connect admin"));
    }
    let health = tokio::time::timeout(
        Duration::from_secs(30),
        send(gw.admin, Method::GET, "/healthz", &[], ""),
    )
    .await
    .expect("the admin listener answers despite 80 silent connections");
    assert_eq!(health.status, StatusCode::OK);
    // And the silent ones were closed by the gateway, not left open.
    for conn in &mut silent[..20] {
        let closed = read_for(conn, Duration::from_secs(10)).await;
        assert_eq!(closed, "", "closed without an answer");
        let mut buf = [0u8; 1];
        assert_eq!(
            conn.read(&mut buf).await.unwrap_or(0),
            0,
            "closed by the gateway"
        );
    }
    gw.terminate().await;
}

/// Clients that dribble a body one byte at a time, each byte within
/// `body_read_timeout` (part of the trust work, item 3): `body_total_timeout`
/// ends each one with `408`, so they cannot hold every in-flight slot and a
/// real client gets its answer instead of `503`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dribbling_bodies_are_cut_and_cannot_hold_every_slot() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(
        dir.path(),
        "max_in_flight = 2\nmax_in_flight_per_peer = 0\nqueue_wait = \"0s\"\nbody_read_timeout = \"2s\"\nbody_total_timeout = \"2s\"\n",
        &up,
    )
    .await;
    let mut dribblers = Vec::new();
    for i in 0..2 {
        let addr = gw.addr;
        dribblers.push(tokio::spawn(async move {
            let mut conn = TcpStream::connect(addr).await.expect("connect");
            let head = format!(
                "POST /v1/payments HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk_test_caller\r\nidempotency-key: drip-{i}\r\n\
                 content-type: application/json\r\ncontent-length: 100\r\n\r\n"
            );
            conn.write_all(head.as_bytes()).await.expect("head");
            // A byte every 500 ms: never a pause of 2 s, 50 s in all.
            for _ in 0..100 {
                if conn.write_all(b" ").await.is_err() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
                let mut buf = [0u8; 64];
                if let Ok(Ok(n)) =
                    tokio::time::timeout(Duration::from_millis(1), conn.read(&mut buf)).await
                {
                    return String::from_utf8_lossy(&buf[..n]).into_owned();
                }
            }
            String::new()
        }));
    }
    for d in dribblers {
        let answer = tokio::time::timeout(Duration::from_secs(30), d)
            .await
            .expect("the dribbler is cut off, not served for 50 s")
            .expect("task");
        assert_eq!(status_of(&answer), Some(408), "{answer:?}");
    }
    let real = send(
        gw.addr,
        Method::POST,
        "/v1/payments",
        &[
            ("authorization", "Bearer sk_test_caller"),
            ("idempotency-key", "real"),
            ("content-type", "application/json"),
        ],
        "{}",
    )
    .await;
    assert_eq!(real.status, StatusCode::CREATED);
    assert_eq!(
        up.total(),
        1,
        "nothing of the dribbled bodies was forwarded"
    );
    gw.terminate().await;
}

/// A connection from `source` (any 127/8 address is this machine) that
/// sends `bytes`, and what came back within `wait`.
async fn raw_from(
    source: &str,
    addr: std::net::SocketAddr,
    bytes: &[u8],
    wait: Duration,
) -> (TcpStream, String) {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(format!("{source}:0").parse().expect("source"))
        .expect("bind the source address");
    let mut conn = socket.connect(addr).await.expect("connect");
    conn.write_all(bytes).await.expect("write");
    // The first bytes back (an answer's head), or "" once it is closed.
    let mut buf = vec![0u8; 4096];
    let n = match tokio::time::timeout(wait, conn.read(&mut buf)).await {
        Ok(Ok(n)) => n,
        _ => 0,
    };
    (conn, String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// One address (a hostile client, a crowd behind one NAT) gets its share
/// of connections and in-flight slots, never all of them: past its share
/// its connections are closed and its requests shed at once, while
/// another address is still served promptly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_cannot_take_every_connection_or_slot() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(
        dir.path(),
        "max_connections = 8\nmax_connections_per_peer = 4\nmax_in_flight = 4\nmax_in_flight_per_peer = 2\nqueue_wait = \"2s\"\n",
        &up,
    )
    .await;
    let slow = |key: &str| {
        format!(
            "POST /v1/payments HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk_test_caller\r\nidempotency-key: {key}\r\nx-delay-ms: 3000\r\ncontent-length: 2\r\n\r\n{{}}"
        )
    };
    // The hostile peer: two slow requests hold its two slots.
    let mut held = Vec::new();
    for i in 0..2 {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket
            .bind("127.0.0.2:0".parse().expect("src"))
            .expect("bind");
        let mut conn = socket.connect(gw.addr).await.expect("connect");
        conn.write_all(slow(&format!("hog-{i}")).as_bytes())
            .await
            .expect("write");
        held.push(conn);
    }
    up.until_received("hog-0").await;
    up.until_received("hog-1").await;
    // Its third request is shed at once, not queued for the 2 s wait.
    let started = std::time::Instant::now();
    let (_c, third) = raw_from(
        "127.0.0.2",
        gw.addr,
        slow("hog-2").as_bytes(),
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(status_of(&third), Some(503), "{third}");
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    // Its fifth connection is closed without an answer (three open: two
    // held, the one above, plus one idle).
    let (_idle, _) = raw_from("127.0.0.2", gw.addr, b"", Duration::from_millis(200)).await;
    let (_d, refused) = raw_from(
        "127.0.0.2",
        gw.addr,
        b"GET / HTTP/1.1\r\nhost: x\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(refused, "", "closed at once: {refused}");
    // Another address is served at once, with every slot of its own share.
    let started = std::time::Instant::now();
    let (_e, other) = raw_from(
        "127.0.0.3",
        gw.addr,
        b"POST /v1/payments HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk_test_caller\r\nidempotency-key: fair\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}",
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(status_of(&other), Some(201), "{other}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert!(metric(gw.admin, "idem_connections_refused_total", "").await >= 1.0);
    drop(held);
}

/// An HTTP/2 connection that sends no request but answers the gateway's
/// pings (hyper's client does) is closed after `idle_timeout`; one whose
/// request takes longer than that is not cut while it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_http2_connections_are_closed_busy_ones_are_not() {
    use http_body_util::{BodyExt, Full};
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), "idle_timeout = \"1s\"\n", &up).await;
    let connect = async || {
        let stream = TcpStream::connect(gw.addr).await.expect("connect");
        let (h2, conn) =
            hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .timer(hyper_util::rt::TokioTimer::new())
                .handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .expect("HTTP/2 handshake");
        (h2, tokio::spawn(conn))
    };
    let get = |delay: &str| {
        http::Request::get(format!("http://{}/v1/things", gw.addr))
            .header("x-delay-ms", delay)
            .body(Full::new(bytes::Bytes::new()))
            .expect("request")
    };
    // Busy for 2.5 s, twice the idle time: answered.
    let (mut busy, _busy_conn) = connect().await;
    let slow = busy
        .send_request(get("2500"))
        .await
        .expect("answered while busy");
    assert_eq!(slow.status(), StatusCode::CREATED);
    slow.into_body().collect().await.expect("body");
    // Idle: one quick request, then silence. Closed by the gateway.
    let (mut idle, idle_conn) = connect().await;
    let quick = idle.send_request(get("0")).await.expect("answered");
    assert_eq!(quick.status(), StatusCode::CREATED);
    quick.into_body().collect().await.expect("body");
    let ended = tokio::time::timeout(Duration::from_secs(10), idle_conn).await;
    assert!(
        ended.is_ok(),
        "the idle connection was closed by the gateway"
    );
    let started = Instant::now();
    let again = tokio::time::timeout(Duration::from_secs(5), idle.send_request(get("0"))).await;
    assert!(
        matches!(again, Ok(Err(_))),
        "a closed connection carries no request"
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    // The admin listener too.
    let stream = TcpStream::connect(gw.admin).await.expect("connect admin");
    let (mut admin, admin_conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .timer(hyper_util::rt::TokioTimer::new())
            .handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .expect("HTTP/2 handshake");
    let admin_conn = tokio::spawn(admin_conn);
    let health = http::Request::get(format!("http://{}/healthz", gw.admin))
        .body(Full::new(bytes::Bytes::new()))
        .expect("request");
    let health = admin.send_request(health).await.expect("answered");
    assert_eq!(health.status(), StatusCode::OK);
    health.into_body().collect().await.expect("body");
    let ended = tokio::time::timeout(Duration::from_secs(10), admin_conn).await;
    assert!(ended.is_ok(), "the idle admin connection was closed too");
}

/// A connection from `source` (any 127/8 address is this machine).
async fn connect_from(source: &str, addr: std::net::SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(format!("{source}:0").parse().expect("source"))
        .expect("bind the source address");
    socket.connect(addr).await.expect("connect")
}

/// Clients that dribble a body a byte at a time from two addresses, each
/// address within its share of `max_in_flight` (four each of eight): the
/// bodies still arriving hold no in-flight slot, so a client elsewhere is
/// answered every time, and nothing of a dribbled body is forwarded. A
/// fifth body in progress from one address is refused at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_dribbled_from_two_addresses_leave_the_in_flight_slots_free() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), "max_in_flight = 8\n", &up).await;
    let (started, mut heads_sent) = tokio::sync::mpsc::channel::<()>(8);
    let mut dribblers = Vec::new();
    for i in 0..8 {
        let source = if i % 2 == 0 { "127.0.0.2" } else { "127.0.0.3" };
        let mut conn = connect_from(source, gw.addr).await;
        let started = started.clone();
        dribblers.push(tokio::spawn(async move {
            let head = format!(
                "POST /v1/payments HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk_test_caller\r\nidempotency-key: drip-{i}\r\n\
                 content-type: application/json\r\ncontent-length: 100\r\n\r\n{{"
            );
            conn.write_all(head.as_bytes()).await.expect("head");
            let _ = started.send(()).await;
            // A byte every 300 ms: within every per-chunk time-out.
            for _ in 0..99 {
                tokio::time::sleep(Duration::from_millis(300)).await;
                if conn.write_all(b" ").await.is_err() {
                    break;
                }
            }
        }));
    }
    for _ in 0..8 {
        heads_sent.recv().await.expect("a dribbler started");
    }
    // The dribblers' heads are in; whatever they hold, they hold now.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut statuses = Vec::new();
    for i in 0..8 {
        let answer = gw
            .post(
                "/v1/payments",
                &[
                    ("idempotency-key", &format!("legit-{i}")),
                    ("content-type", "application/json"),
                ],
                "{}",
            )
            .await;
        statuses.push(answer.status.as_u16());
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(statuses, [201; 8], "the client behind the dribblers");
    // A fifth body in progress from one address: refused at once.
    let (_fifth, answer) = raw_from(
        "127.0.0.2",
        gw.addr,
        b"POST /v1/payments HTTP/1.1\r\nhost: x\r\nauthorization: Bearer sk_test_caller\r\nidempotency-key: drip-9\r\ncontent-length: 100\r\n\r\n{",
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(status_of(&answer), Some(503), "{answer}");
    assert!(answer.contains("retry-after: 1"), "{answer}");
    assert_eq!(metric(gw.admin, "idem_requests_shed_total", "").await, 1.0);
    for d in dribblers {
        d.abort();
    }
    assert_eq!(up.total(), 8, "only the client's requests were forwarded");
    gw.terminate().await;
}

/// HTTP/1.1 clients that ask for an answer larger than the socket buffers
/// and never read it, as many as `max_connections`: each connection is
/// closed once its answer has made no progress for `idle_timeout`, so a
/// client behind them is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http1_clients_that_never_read_are_closed_and_cannot_crowd_out_a_client() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(
        dir.path(),
        "max_connections = 4\nidle_timeout = \"2s\"\n",
        &up,
    )
    .await;
    let mut stalled = Vec::new();
    for i in 0..4 {
        let source = if i % 2 == 0 { "127.0.0.2" } else { "127.0.0.3" };
        let mut conn = connect_from(source, gw.addr).await;
        // 32 MiB: more than the kernel buffers on both sides hold.
        conn.write_all(
            format!(
                "GET /big HTTP/1.1\r\nhost: x\r\nidempotency-key: big-{i}\r\nx-size: 33554432\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .expect("write");
        up.until_received(&format!("big-{i}")).await;
        stalled.push(conn);
    }
    let answer = tokio::time::timeout(
        Duration::from_secs(30),
        send(gw.addr, Method::GET, "/v1/things", &[], ""),
    )
    .await
    .expect("a client behind four that never read is answered");
    assert_eq!(answer.status, StatusCode::CREATED);
    // Each stalled one is closed by the gateway...
    idem_testkit::wait::eventually("four stalled connections closed", async || {
        metric(gw.admin, "idem_connections_stalled_total", "").await >= 4.0
    })
    .await;
    // ...before its answer's end.
    for conn in &mut stalled {
        let mut got = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(30), conn.read_to_end(&mut got))
            .await
            .expect("closed by the gateway");
        assert!(got.len() < 32 << 20, "got the whole answer: {}", got.len());
    }
    gw.terminate().await;
}

/// An HTTP/2 connection from `source` that advertises a zero receive
/// window: it asks for `path`, gets the answer's head and never lets a
/// byte of its body come. The connection lives while the answer is held.
async fn never_reading_h2(
    source: &str,
    addr: std::net::SocketAddr,
    path: &str,
) -> http::Response<hyper::body::Incoming> {
    let mut h2 = zero_window_h2(source, addr).await;
    let req = http::Request::get(format!("http://{addr}{path}"))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .expect("request");
    h2.send_request(req).await.expect("the answer's head")
}

/// An HTTP/2 connection from `source` whose receive window is zero: the
/// gateway may send it heads, never a byte of a body.
async fn zero_window_h2<B>(
    source: &str,
    addr: std::net::SocketAddr,
) -> hyper::client::conn::http2::SendRequest<B>
where
    B: http_body::Body + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let stream = connect_from(source, addr).await;
    let (h2, conn) = hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
        .timer(hyper_util::rt::TokioTimer::new())
        .initial_stream_window_size(0)
        .handshake(hyper_util::rt::TokioIo::new(stream))
        .await
        .expect("HTTP/2 handshake");
    tokio::spawn(conn);
    h2
}

/// Waits for each held answer's body to end, and asserts that it broke
/// off (its connection closed) rather than arrive.
async fn broke_off(answers: Vec<http::Response<hyper::body::Incoming>>) {
    use http_body_util::BodyExt;
    for answer in answers {
        let frame = tokio::time::timeout(Duration::from_secs(30), answer.into_body().frame())
            .await
            .expect("the answer ended");
        assert!(
            matches!(frame, Some(Err(_))),
            "the answer broke off: {frame:?}"
        );
    }
}

/// HTTP/2 clients with a zero receive window hold a request in flight on
/// every connection place (sixteen, from two addresses): each connection
/// is closed once its answers have waited on the client for
/// `idle_timeout`, so a client behind them is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http2_clients_with_a_zero_window_are_closed_and_cannot_crowd_out_a_client() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(
        dir.path(),
        "max_connections = 16\nidle_timeout = \"2s\"\n",
        &up,
    )
    .await;
    let mut stalled = Vec::new();
    for i in 0..16 {
        let source = if i % 2 == 0 { "127.0.0.2" } else { "127.0.0.3" };
        stalled.push(never_reading_h2(source, gw.addr, "/v1/things").await);
    }
    let answer = tokio::time::timeout(
        Duration::from_secs(30),
        send(gw.addr, Method::GET, "/v1/things", &[], ""),
    )
    .await
    .expect("a client behind sixteen zero windows is answered");
    assert_eq!(answer.status, StatusCode::CREATED);
    idem_testkit::wait::eventually("sixteen stalled connections closed", async || {
        metric(gw.admin, "idem_connections_stalled_total", "").await >= 16.0
    })
    .await;
    broke_off(stalled).await;
    gw.terminate().await;
}

/// HTTP/2 clients that hold an answer behind a zero window and, on the
/// same connection, keep a request body coming a byte a second (within
/// every body time-out) are closed all the same: each answer has its own
/// deadline, and another stream's activity does not extend it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dribbled_body_does_not_keep_a_stalled_http2_answer_alive() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(
        dir.path(),
        "max_connections = 8\nidle_timeout = \"2s\"\n",
        &up,
    )
    .await;
    let mut stalled = Vec::new();
    let mut dribblers = Vec::new();
    for i in 0..8 {
        let source = if i % 2 == 0 { "127.0.0.2" } else { "127.0.0.3" };
        let (answer, dribbler) = never_reading_h2_while_dribbling(source, gw.addr).await;
        stalled.push(answer);
        dribblers.push(dribbler);
    }
    let answer = tokio::time::timeout(
        Duration::from_secs(30),
        send(gw.addr, Method::GET, "/v1/things", &[], ""),
    )
    .await
    .expect("a client behind eight stalled answers is answered");
    assert_eq!(answer.status, StatusCode::CREATED);
    broke_off(stalled).await;
    for d in dribblers {
        d.abort();
    }
    gw.terminate().await;
}

/// As [`never_reading_h2`], and on the same connection a POST whose body
/// comes a byte a second for a minute (the task sending it is returned).
async fn never_reading_h2_while_dribbling(
    source: &str,
    addr: std::net::SocketAddr,
) -> (
    http::Response<hyper::body::Incoming>,
    tokio::task::JoinHandle<()>,
) {
    let mut h2 = zero_window_h2(source, addr).await;
    let get = http::Request::get(format!("http://{addr}/v1/things"))
        .body(http_body_util::Either::Left(http_body_util::Empty::<
            bytes::Bytes,
        >::new()))
        .expect("request");
    let answer = h2.send_request(get).await.expect("the answer's head");
    let drip = futures_util::stream::unfold(0, async |sent| {
        if sent > 0 {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let byte = http_body::Frame::data(bytes::Bytes::from_static(b" "));
        (sent < 60).then_some((Ok::<_, std::convert::Infallible>(byte), sent + 1))
    });
    let post = http::Request::post(format!("http://{addr}/v1/things"))
        .header("content-length", "60")
        .body(http_body_util::Either::Right(
            http_body_util::StreamBody::new(Box::pin(drip)),
        ))
        .expect("request");
    let dribbler = tokio::spawn(async move {
        let _ = h2.send_request(post).await;
    });
    (answer, dribbler)
}

/// On the admin listener, tokenless HTTP/2 clients with a zero receive
/// window on a dashboard file, as many as it serves at once, are closed
/// once `idle_timeout` passes, so an operator's readiness check with the
/// token is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_clients_with_a_zero_window_cannot_keep_an_operator_out() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = Gateway::builder(IDEM, dir.path())
        .config(&format!("{ROUTES}\n[limits]\nidle_timeout = \"2s\"\n"))
        .upstream(&up.url())
        .store(&sqlite_store(dir.path()))
        .args(&["--admin-token", "s3cret-admin-0123456789abcdef0123"])
        .start()
        .await;
    let mut stalled = Vec::new();
    for _ in 0..64 {
        stalled.push(never_reading_h2("127.0.0.2", gw.admin, "/dashboard/app.js").await);
    }
    let ready = tokio::time::timeout(
        Duration::from_secs(30),
        send(
            gw.admin,
            Method::GET,
            "/readyz",
            &[("authorization", "Bearer s3cret-admin-0123456789abcdef0123")],
            "",
        ),
    )
    .await
    .expect("the admin listener answers behind 64 zero windows");
    assert_eq!(ready.status, StatusCode::OK);
    let token = ("authorization", "Bearer s3cret-admin-0123456789abcdef0123");
    idem_testkit::wait::eventually("64 stalled admin connections closed", async || {
        let page = send(gw.admin, Method::GET, "/metrics", &[token], "").await;
        String::from_utf8_lossy(&page.body)
            .lines()
            .find_map(|l| l.strip_prefix("idem_connections_stalled_total "))
            .and_then(|v| v.parse::<f64>().ok())
            .is_some_and(|n| n >= 64.0)
    })
    .await;
    broke_off(stalled).await;
    gw.terminate().await;
}

/// A slow HTTP/2 client (a 16 KiB window, a frame taken every 200 ms)
/// takes far longer than `idle_timeout` over an answer much larger than
/// its window, and is not cut: each piece it takes counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_http2_client_gets_its_whole_answer() {
    use http_body_util::BodyExt;
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = start(dir.path(), "idle_timeout = \"1s\"\n", &up).await;
    let stream = TcpStream::connect(gw.addr).await.expect("connect");
    let (mut h2, conn) =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
            .timer(hyper_util::rt::TokioTimer::new())
            .initial_stream_window_size(16 << 10)
            .handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .expect("HTTP/2 handshake");
    tokio::spawn(conn);
    let req = http::Request::get(format!("http://{}/v1/things", gw.addr))
        .header("x-size", "262144")
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .expect("request");
    let mut body = h2.send_request(req).await.expect("head").into_body();
    let mut got = 0;
    while let Some(frame) = body.frame().await {
        let frame = frame.expect("the answer is not cut");
        got += frame.data_ref().map_or(0, |d| d.len());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(got, 262_144);
    assert_eq!(
        metric(gw.admin, "idem_connections_stalled_total", "").await,
        0.0
    );
    gw.terminate().await;
}

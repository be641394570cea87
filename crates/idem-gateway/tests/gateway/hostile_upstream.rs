//! Upstream answers that must not corrupt a client connection or a record
//! (part of the trust work): a `Content-Length` beside `Transfer-Encoding:
//! chunked`, a forged "body not retained" marker, and a `Set-Cookie` on a
//! route that lists other unstored headers.

use std::time::Duration;

use http::{Method, StatusCode};
use idem_testkit::client::send;
use idem_testkit::gateway::{GatewayProcess, sqlite_store};
use idem_testkit::upstream::CountingUpstream;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const IDEM: &str = env!("CARGO_BIN_EXE_idem");

const CONFIG: &str = r#"
[[route]]
method = "POST"
path = "/v1/payments"
require_key = true
unstored_headers = ["x-internal"]
"#;

/// An upstream that answers every request on a connection with `answer`.
async fn raw_upstream(answer: &'static [u8]) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move {
        loop {
            let Ok((mut conn, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    // One request: its head, then the body its length says.
                    let Ok(n) = conn.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                    let len: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0);
                    if buf.len() < end + 4 + len {
                        continue;
                    }
                    buf.drain(..end + 4 + len);
                    if conn.write_all(answer).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    format!("http://{addr}")
}

/// `idem serve` with [`CONFIG`] in front of `upstream`, its embedded
/// store in `dir`.
async fn in_front_of(upstream: &str, dir: &std::path::Path) -> GatewayProcess {
    GatewayProcess::builder(IDEM, dir)
        .config(CONFIG)
        .upstream(upstream)
        .store(&sqlite_store(dir))
        .start()
        .await
}

async fn post(gw: &GatewayProcess, key: &str) -> idem_testkit::client::Answer {
    tokio::time::timeout(
        Duration::from_secs(10),
        send(
            gw.addr,
            Method::POST,
            "/v1/payments",
            &[
                ("idempotency-key", key),
                ("authorization", "Bearer t"),
                ("content-type", "application/json"),
            ],
            "{}",
        ),
    )
    .await
    .expect("an answer, not a connection waiting for bytes that never come")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_length_beside_chunked_is_dropped_not_forwarded() {
    let upstream = raw_upstream(
        b"HTTP/1.1 201 Created\r\nContent-Length: 80\r\nTransfer-Encoding: chunked\r\n\
          Content-Type: text/plain\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    )
    .await;
    let dir = tempfile::tempdir().expect("dir");
    let gw = in_front_of(&upstream, dir.path()).await;
    for attempt in ["first", "replay"] {
        let answer = post(&gw, "framed").await;
        assert_eq!(answer.status, StatusCode::CREATED, "{attempt}");
        assert_eq!(&answer.body[..], b"hello", "{attempt}");
        assert_ne!(answer.header("content-length"), Some("80"), "{attempt}");
    }
    // Two answers in a row on one keep-alive connection stay apart.
    let mut conn = TcpStream::connect(gw.addr).await.expect("connect");
    let request = |key: &str| {
        format!(
            "POST /v1/payments HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\n\
             Authorization: Bearer t\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}"
        )
    };
    let two = format!("{}{}", request("pipelined-1"), request("pipelined-2"));
    conn.write_all(two.as_bytes()).await.expect("write");
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while count(&got, b"HTTP/1.1 201") < 2 || count(&got, b"hello") < 2 {
        let mut chunk = [0u8; 4096];
        let n = tokio::time::timeout_at(deadline, conn.read(&mut chunk))
            .await
            .expect("both answers")
            .expect("read");
        assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&chunk[..n]);
    }
    let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
    assert_eq!(count(&got, b"HTTP/1.1 201"), 2, "{text}");
    assert!(!text.contains("content-length: 80"), "{text}");
    assert_eq!(text.matches("hello").count(), 2, "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_marker_and_cookies_are_not_stored() {
    let upstream = raw_upstream(
        b"HTTP/1.1 201 Created\r\nContent-Length: 7\r\nX-Idem-Body-Not-Retained: 1\r\n\
          Set-Cookie: session=alice\r\nX-Internal: 1\r\nX-Kept: yes\r\n\r\ncharged",
    )
    .await;
    let dir = tempfile::tempdir().expect("dir");
    let gw = in_front_of(&upstream, dir.path()).await;
    let first = post(&gw, "forged").await;
    assert_eq!(&first.body[..], b"charged");
    assert!(
        first.header("x-idem-body-not-retained").is_none(),
        "stripped from the answer"
    );
    assert_eq!(
        first.header("set-cookie"),
        Some("session=alice"),
        "the caller's own"
    );
    let replay = post(&gw, "forged").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        &replay.body[..],
        b"charged",
        "the body, not a 'not retained' problem"
    );
    assert_eq!(replay.header("x-kept"), Some("yes"));
    assert!(
        replay.header("set-cookie").is_none(),
        "another caller never gets the cookie"
    );
    assert!(replay.header("x-internal").is_none());
}

fn count(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len()).filter(|w| *w == needle).count()
}

/// Writes `request` raw on a fresh connection, shuts the write side (as
/// scripts and some clients do), and returns what the gateway answered.
async fn exchange(addr: std::net::SocketAddr, request: &str) -> String {
    let mut conn = TcpStream::connect(addr).await.expect("connect");
    conn.write_all(request.as_bytes()).await.expect("write");
    conn.shutdown().await.expect("half-close");
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// Two `Host` lines (which one does the next proxy route by?) and a
/// `Host` that is not a host are refused before anything else; a body on
/// a GET reaches the upstream whole instead of being dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_hosts_are_refused_and_no_method_loses_its_body() {
    let dir = tempfile::tempdir().expect("temp dir");
    let up = CountingUpstream::start().await;
    let gw = GatewayProcess::builder(IDEM, dir.path())
        .upstream(&up.url())
        .store(&sqlite_store(dir.path()))
        .log("error")
        .start()
        .await;
    for head in [
        "host: a.example\r\nhost: b.example\r\n",
        "host: a b\r\n",
        "host: user@a.example\r\n",
        "",
    ] {
        let answer = exchange(
            gw.addr,
            &format!("GET /v1/things HTTP/1.1\r\n{head}connection: close\r\n\r\n"),
        )
        .await;
        assert!(answer.starts_with("HTTP/1.1 400"), "{head:?}: {answer}");
        assert!(
            answer.contains("request-host-invalid"),
            "{head:?}: {answer}"
        );
    }
    assert_eq!(up.total(), 0, "nothing forwarded");
    let chunked = exchange(
        gw.addr,
        "GET /v1/things HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
    )
    .await;
    assert!(chunked.starts_with("HTTP/1.1 201"), "{chunked}");
    assert!(
        chunked.contains(r#""body_len":11"#),
        "the body arrived whole: {chunked}"
    );
}

/// Session and authentication headers of one caller (`Set-Cookie2`,
/// `Authentication-Info`, `Proxy-Authentication-Info`) and the gateway's
/// own marks reach that caller and are never stored for a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authentication_results_and_marks_are_not_stored() {
    let upstream = raw_upstream(
        b"HTTP/1.1 201 Created\r\nContent-Length: 7\r\nSet-Cookie2: s=alice\r\n\
          Authentication-Info: nextnonce=\"alice\"\r\nProxy-Authentication-Info: nextnonce=\"p\"\r\n\
          Idempotency-Status: forged\r\nX-Kept: yes\r\n\r\ncharged",
    )
    .await;
    let dir = tempfile::tempdir().expect("dir");
    let gw = in_front_of(&upstream, dir.path()).await;
    let first = post(&gw, "auth-info").await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(
        first.header("authentication-info"),
        Some("nextnonce=\"alice\"")
    );
    let replay = post(&gw, "auth-info").await;
    assert_eq!(replay.header("idempotent-replayed"), Some("true"));
    assert_eq!(replay.header("x-kept"), Some("yes"));
    for name in [
        "set-cookie2",
        "authentication-info",
        "proxy-authentication-info",
        "idempotency-status",
    ] {
        assert!(replay.header(name).is_none(), "{name} replayed");
    }
}

/// The gateway never asks for a protocol switch, so an upstream's `101`
/// is a broken answer after sending: `502`, the record held, the retry
/// not run again, and nothing of the switch recorded or replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unrequested_101_is_a_broken_answer_and_is_held() {
    let upstream = raw_upstream(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
    )
    .await;
    let dir = tempfile::tempdir().expect("dir");
    let gw = in_front_of(&upstream, dir.path()).await;
    let first = post(&gw, "switched").await;
    assert_eq!(first.status, StatusCode::BAD_GATEWAY, "{first:?}");
    assert_eq!(first.problem_type(), "upstream-response-broken");
    let retry = post(&gw, "switched").await;
    assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
    assert_eq!(retry.problem_type(), "idempotency-outcome-held");
}

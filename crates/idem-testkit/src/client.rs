//! One-call HTTP requests for tests: send, read the whole answer.

use std::net::SocketAddr;

use bytes::Bytes;
use http::{HeaderMap, Method, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

/// A response, fully read.
#[derive(Debug, Clone)]
pub struct Answer {
    /// Status.
    pub status: StatusCode,
    /// Headers.
    pub headers: HeaderMap,
    /// Body bytes.
    pub body: Bytes,
}

impl Answer {
    /// The last segment of a problem+json `type` (panics if not a problem).
    pub fn problem_type(&self) -> String {
        let v: serde_json::Value = serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not a problem document ({e}): {:?}", self.body));
        v["type"]
            .as_str()
            .and_then(|t| t.rsplit('/').next())
            .unwrap_or_else(|| panic!("problem without type: {v}"))
            .to_owned()
    }

    /// A header as text, if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// Sends one request over a fresh connection and reads the whole answer.
pub async fn send(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Answer {
    try_send(addr, method, path, headers, body)
        .await
        .unwrap_or_else(|e| panic!("request to {addr}{path} failed: {e}"))
}

/// Like [`send`], returning the transport error instead of panicking.
pub async fn try_send(
    addr: SocketAddr,
    method: Method,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Result<Answer, String> {
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut req = http::Request::builder()
        .method(method)
        .uri(format!("http://{addr}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(Full::new(body.into()))
        .map_err(|e| e.to_string())?;
    let resp = client.request(req).await.map_err(|e| e.to_string())?;
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok(Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    })
}

/// Repeats `attempt` (every 100 ms, up to 100 times) until it answers
/// `want`; panics otherwise. For states that settle: a store coming back,
/// a gateway becoming ready.
pub async fn until_status(mut attempt: impl AsyncFnMut() -> Answer, want: StatusCode) -> Answer {
    let mut last = None;
    for _ in 0..100 {
        let a = attempt().await;
        if a.status == want {
            return a;
        }
        last = Some(a);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let last = last.map(|a| format!("{} {}", a.status, String::from_utf8_lossy(&a.body)));
    panic!("never answered {want}; the last answer: {last:?}");
}

/// The sum of the samples of the Prometheus metric `name` on an admin
/// listener's `/metrics` whose labels contain `label` (e.g.
/// `outcome="unprotected"`; empty: every sample); 0 when there is none.
pub async fn metric(admin: SocketAddr, name: &str, label: &str) -> f64 {
    let page = send(admin, Method::GET, "/metrics", &[], "").await;
    String::from_utf8_lossy(&page.body)
        .lines()
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with([' ', '{']))
                && l.contains(label)
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// A cleartext HTTP/2 connection to `addr` by prior knowledge, as a gRPC
/// client opens one; its driver runs in a task of its own.
pub async fn h2c(addr: SocketAddr) -> hyper::client::conn::http2::SendRequest<Full<Bytes>> {
    let stream = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (sender, conn) = hyper::client::conn::http2::handshake(
        TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .expect("HTTP/2 handshake");
    tokio::spawn(conn);
    sender
}

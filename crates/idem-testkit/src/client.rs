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

//! A counting HTTP upstream on loopback, for gateway and layer tests.
//!
//! Every request is counted (per `Idempotency-Key`, and in total) and its
//! headers kept, so tests assert on what really reached the upstream. The
//! request can steer the answer:
//!
//! * `x-delay-ms: N` — wait N ms before answering (slow upstream, timeouts);
//! * `x-status: N` — answer with status N (default 201);
//! * `x-size: N` — answer with an N-byte body instead of the JSON echo.
//!
//! The default answer is JSON: `{"execution":N,"key":…,"body_len":…}` with
//! a `Location` header, so replays are recognisable by their bytes.
//!
//! Requests answered `2xx` are also counted per body ([`applied`]): the
//! side effects of a receiver whose deliveries carry their ids inside
//! (webhooks), where no `Idempotency-Key` is sent.
//!
//! [`applied`]: CountingUpstream::applied
//!
//! [`CountingUpstream::start_tls`] serves the same over TLS (HTTP/2 when
//! the client offers it by ALPN), and keeps the server name each client
//! asked for and the HTTP version of the last request.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;

#[derive(Debug, Default)]
struct State {
    total: AtomicU64,
    connections: AtomicU64,
    per_key: Mutex<HashMap<String, u64>>,
    /// Body → requests with it answered 2xx.
    per_body: Mutex<HashMap<Bytes, u64>>,
    last_headers: Mutex<Option<HeaderMap>>,
    last_version: Mutex<Option<Version>>,
    server_names: Mutex<Vec<Option<String>>>,
    handshakes_failed: AtomicU64,
}

/// A running counting upstream; it stops when the test's runtime ends.
#[derive(Debug, Clone)]
pub struct CountingUpstream {
    addr: SocketAddr,
    state: Arc<State>,
}

impl CountingUpstream {
    /// Starts on `127.0.0.1:0`.
    pub async fn start() -> Self {
        let (listener, addr, state) = bind().await;
        let shared = Arc::clone(&state);
        serve(listener, move || {
            shared.connections.fetch_add(1, Ordering::SeqCst);
            let state = Arc::clone(&shared);
            move |req| handle(req, Arc::clone(&state))
        });
        Self { addr, state }
    }

    /// Starts on `127.0.0.1:0`, serving TLS with `tls` (its ALPN
    /// protocols are set here: `h2` and `http/1.1`). A connection is
    /// counted once its handshake succeeds; one that fails is counted in
    /// [`handshakes_failed`](Self::handshakes_failed).
    pub async fn start_tls(tls: rustls::ServerConfig) -> Self {
        let mut tls = tls;
        tls.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        let acceptor = TlsAcceptor::from(Arc::new(tls));
        let (listener, addr, state) = bind().await;
        let shared = Arc::clone(&state);
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (acceptor, state) = (acceptor.clone(), Arc::clone(&shared));
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(stream).await else {
                        state.handshakes_failed.fetch_add(1, Ordering::SeqCst);
                        return;
                    };
                    let name = tls.get_ref().1.server_name().map(str::to_owned);
                    lock(&state.server_names).push(name);
                    state.connections.fetch_add(1, Ordering::SeqCst);
                    let svc = service_fn(move |req| handle(req, Arc::clone(&state)));
                    serve_connection(TokioIo::new(tls), svc).await;
                });
            }
        });
        Self { addr, state }
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Requests received in total.
    pub fn total(&self) -> u64 {
        self.state.total.load(Ordering::SeqCst)
    }

    /// Connections accepted in total.
    pub fn connections(&self) -> u64 {
        self.state.connections.load(Ordering::SeqCst)
    }

    /// The bodies answered `2xx`, each with how many times it was.
    pub fn applied(&self) -> HashMap<Bytes, u64> {
        lock(&self.state.per_body).clone()
    }

    /// Requests received with this `Idempotency-Key` (as forwarded).
    pub fn executions(&self, key: &str) -> u64 {
        lock(&self.state.per_key).get(key).copied().unwrap_or(0)
    }

    /// Waits until a request with this `Idempotency-Key` has arrived
    /// ([`crate::wait::eventually`]): a test's "in flight" from here on is
    /// the upstream's, not a guess of how long the gateway takes to forward.
    pub async fn until_received(&self, key: &str) {
        let what = format!("a request with key {key:?} reaching the upstream");
        crate::wait::eventually(&what, async || self.executions(key) > 0).await;
    }

    /// The headers of the last request received.
    pub fn last_headers(&self) -> Option<HeaderMap> {
        lock(&self.state.last_headers).clone()
    }

    /// The HTTP version of the last request received.
    pub fn last_version(&self) -> Option<Version> {
        *lock(&self.state.last_version)
    }

    /// Under TLS, the server name (SNI) each connection asked for, in
    /// order (`None`: it sent none, as for an IP address).
    pub fn server_names(&self) -> Vec<Option<String>> {
        lock(&self.state.server_names).clone()
    }

    /// Under TLS, the handshakes that failed.
    pub fn handshakes_failed(&self) -> u64 {
        self.state.handshakes_failed.load(Ordering::SeqCst)
    }
}

/// A listener on `127.0.0.1:0`, its address and a fresh state.
async fn bind() -> (TcpListener, SocketAddr, Arc<State>) {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    (listener, addr, Arc::new(State::default()))
}

/// Serves HTTP/1 and HTTP/2 on `listener` until the runtime ends, a task
/// per connection; `accepted` runs for each connection and gives the
/// function that answers its requests. For the test servers of this crate.
pub(crate) fn serve<A, H, F, E>(listener: TcpListener, accepted: A)
where
    A: Fn() -> H + Send + 'static,
    H: Fn(Request<Incoming>) -> F + Send + Sync + 'static,
    F: std::future::Future<Output = Result<Response<Full<Bytes>>, E>> + Send + 'static,
    E: Into<Box<dyn std::error::Error + Send + Sync>> + 'static,
{
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let svc = service_fn(accepted());
            tokio::spawn(serve_connection(TokioIo::new(stream), svc));
        }
    });
}

/// Serves HTTP/1 or HTTP/2 (whichever the client speaks) on one connection.
async fn serve_connection<I, S>(io: I, svc: S)
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    S: hyper::service::Service<Request<Incoming>, Response = Response<Full<Bytes>>>
        + Send
        + 'static,
    S::Future: Send + 'static,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
        .serve_connection(io, svc)
        .await;
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn header_num(headers: &HeaderMap, name: &str) -> Option<u64> {
    headers.get(name)?.to_str().ok()?.parse().ok()
}

async fn handle(
    req: Request<Incoming>,
    state: Arc<State>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let key = parts
        .headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    let execution = state.total.fetch_add(1, Ordering::SeqCst) + 1;
    *lock(&state.per_key).entry(key.clone()).or_default() += 1;
    *lock(&state.last_headers) = Some(parts.headers.clone());
    *lock(&state.last_version) = Some(parts.version);
    if let Some(ms) = header_num(&parts.headers, "x-delay-ms") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let status = header_num(&parts.headers, "x-status")
        .and_then(|s| u16::try_from(s).ok())
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::CREATED);
    if status.is_success() {
        *lock(&state.per_body).entry(body.clone()).or_default() += 1;
    }
    let payload = match header_num(&parts.headers, "x-size") {
        Some(n) => Bytes::from(vec![b'x'; usize::try_from(n).unwrap_or(0)]),
        None => Bytes::from(format!(
            r#"{{"execution":{execution},"key":"{}","method":"{}","path":"{}","body_len":{}}}"#,
            key.replace('"', ""),
            parts.method,
            parts.uri.path(),
            body.len()
        )),
    };
    let resp = Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("location", format!("/v1/things/{execution}"))
        .header("set-cookie", format!("session={execution}"))
        .body(Full::new(payload))
        .expect("valid response");
    Ok(resp)
}

//! HTTP/1.1 keep-alive connections to the upstream, each driven by the
//! request that uses it.
//!
//! hyper's pooled client runs every connection in a task of its own: a
//! request travels to that task through a channel, its answer comes back
//! through another, and every step wakes the other task — two or three
//! wake-ups per request, often across the two worker threads. Here the
//! request's own task polls the connection while it waits for the answer,
//! and the response body polls it while the client reads, so a proxied
//! request stays on one task from the client's socket to the upstream's
//! and back (as an nginx worker does). A connection goes back to the idle
//! list when its response body has been read to the end; a body dropped
//! half-read closes it.
//!
//! Idle connections are not polled. One the upstream closed meanwhile is
//! found out when it is taken (its connection is polled once, without a
//! waker, and reports the close) and replaced by a fresh one; a request
//! refused by a connection before any of it was written is sent once more
//! on a fresh connection.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{HOST, HeaderValue};
use http::uri::{Authority, PathAndQuery};
use http::{Request, Response, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, Connection, SendRequest};
use hyper_util::rt::TokioIo;
use idem_http::BoxError;
use tokio::net::TcpStream;

use crate::serve::body::ClientBody;

/// How long a new connection may take to open.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Idle connections kept at most; beyond, the oldest is closed.
const MAX_IDLE: usize = 1024;
/// An idle connection older than this is closed instead of reused.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// Why an exchange with the upstream failed, as the idempotency layer
/// needs to know it.
#[derive(Debug)]
pub enum ExchangeError {
    /// Nothing of the request reached the upstream (connection refused,
    /// unreachable, or every connection closed before the request was
    /// written): retrying is safe.
    NotSent(String),
    /// The request was written, at least in part, and no complete answer
    /// came back: it may have taken effect.
    MaybeSent(String),
}

/// One open connection: the sending half and the connection itself.
struct Conn {
    sender: SendRequest<ProxyBody>,
    link: Link,
}

/// The connection future: it does the reading and writing for the sender
/// and the response body, whenever it is polled.
struct Link {
    conn: Connection<TokioIo<TcpStream>, ProxyBody>,
    /// It finished (the connection closed or failed).
    done: bool,
}

impl Link {
    fn poll(&mut self, cx: &mut Context<'_>) {
        if !self.done
            && let Poll::Ready(result) = Pin::new(&mut self.conn).poll(cx)
        {
            self.done = true;
            if let Err(err) = result {
                tracing::debug!(%err, "upstream connection ended with an error");
            }
        }
    }

    /// Runs `fut` while driving the connection.
    async fn drive<F: Future>(&mut self, fut: F) -> F::Output {
        let mut fut = pin!(fut);
        std::future::poll_fn(|cx| {
            self.poll(cx);
            fut.as_mut().poll(cx)
        })
        .await
    }
}

impl Conn {
    async fn open(authority: &Authority) -> Result<Box<Self>, String> {
        let addr = authority_addr(authority);
        let stream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&addr)).await {
            Ok(Ok(stream)) => stream,
            Ok(Err(err)) => return Err(format!("cannot connect to {addr}: {err}")),
            Err(_) => {
                return Err(format!(
                    "no connection to {addr} within {CONNECT_TIMEOUT:?}"
                ));
            }
        };
        let _ = stream.set_nodelay(true);
        let (sender, conn) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|err| format!("cannot start HTTP/1.1 with {addr}: {err}"))?;
        // Boxed once: it moves between the idle list, the request and its
        // response body as a pointer.
        Ok(Box::new(Self {
            sender,
            link: Link { conn, done: false },
        }))
    }

    /// Whether an idle connection can still carry a request: polled once
    /// without a waker, a connection the upstream closed finishes.
    fn still_open(&mut self) -> bool {
        self.link.poll(&mut Context::from_waker(Waker::noop()));
        self.usable()
    }

    /// Neither the connection nor its sending half has ended.
    fn usable(&self) -> bool {
        !self.link.done && !self.sender.is_closed()
    }
}

/// The upstream origin and its idle connections.
pub struct Upstream {
    authority: Authority,
    idle: Mutex<VecDeque<(Box<Conn>, Instant)>>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("authority", &self.authority)
            .field("idle", &self.idle.lock().map(|idle| idle.len()).ok())
            .finish()
    }
}

impl Upstream {
    /// Connections to `authority` (`host:port`).
    pub fn new(authority: Authority) -> Arc<Self> {
        Arc::new(Self {
            authority,
            idle: Mutex::new(VecDeque::new()),
        })
    }

    /// Sends `req` (its URI reduced to path and query) and returns the
    /// response head; the body drives the connection until it is read.
    pub async fn send(
        self: &Arc<Self>,
        mut req: Request<ProxyBody>,
    ) -> Result<Response<UpstreamBody>, ExchangeError> {
        let path = req
            .uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        *req.uri_mut() = Uri::from(path);
        // The upstream leg is always HTTP/1.1, whatever the client spoke.
        *req.version_mut() = Version::HTTP_11;
        if !req.headers().contains_key(HOST)
            && let Ok(host) = HeaderValue::from_str(self.authority.as_str())
        {
            req.headers_mut().insert(HOST, host);
        }
        // A reused connection may turn out closed before anything was
        // written; the request then goes once more, on a fresh one.
        loop {
            let (mut conn, reused) = match self.checkout() {
                Some(conn) => (conn, true),
                None => (
                    Conn::open(&self.authority)
                        .await
                        .map_err(ExchangeError::NotSent)?,
                    false,
                ),
            };
            if let Err(err) = conn.link.drive(conn.sender.ready()).await {
                if reused {
                    continue;
                }
                return Err(ExchangeError::NotSent(format!(
                    "the upstream closed a new connection at once: {err}"
                )));
            }
            let sent = conn.sender.try_send_request(req);
            match conn.link.drive(sent).await {
                Ok(resp) => {
                    return Ok(resp.map(|body| UpstreamBody {
                        body,
                        conn: Some(conn),
                        upstream: Arc::clone(self),
                    }));
                }
                Err(mut err) => match err.take_message() {
                    Some(unsent) if reused => req = unsent,
                    Some(_) => {
                        return Err(ExchangeError::NotSent(format!(
                            "the upstream closed the connection before the request was written: {}",
                            err.error()
                        )));
                    }
                    None => return Err(ExchangeError::MaybeSent(err.error().to_string())),
                },
            }
        }
    }

    /// The most recently used idle connection that is still open.
    fn checkout(&self) -> Option<Box<Conn>> {
        loop {
            let (mut conn, since) = self.idle.lock().ok()?.pop_back()?;
            if since.elapsed() < IDLE_TIMEOUT && conn.still_open() {
                return Some(conn);
            }
        }
    }

    /// Keeps a connection whose exchange ended cleanly for the next request.
    fn checkin(&self, conn: Box<Conn>) {
        if !conn.usable() {
            return;
        }
        let now = Instant::now();
        let Ok(mut idle) = self.idle.lock() else {
            return;
        };
        while idle
            .front()
            .is_some_and(|(_, since)| now.duration_since(*since) >= IDLE_TIMEOUT)
            || idle.len() >= MAX_IDLE
        {
            idle.pop_front();
        }
        idle.push_back((conn, now));
    }
}

/// `host:port` to connect to (port 80 when the authority has none).
fn authority_addr(authority: &Authority) -> String {
    format!(
        "{}:{}",
        authority.host(),
        authority.port_u16().unwrap_or(80)
    )
}

/// An upstream response body. Reading it drives its connection; read to
/// the end, the connection goes back to the idle list; dropped before, the
/// connection closes with it.
pub struct UpstreamBody {
    body: Incoming,
    conn: Option<Box<Conn>>,
    upstream: Arc<Upstream>,
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBody")
            .field("body", &self.body)
            .field("pooled", &self.conn.is_some())
            .finish()
    }
}

impl UpstreamBody {
    fn release(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.upstream.checkin(conn);
        }
    }
}

impl Drop for UpstreamBody {
    /// A body that was empty from the start (`204`, an answer to `HEAD`)
    /// is never polled; its connection is still good for the next request.
    fn drop(&mut self) {
        if self.body.is_end_stream() {
            self.release();
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(conn) = &mut this.conn {
            conn.link.poll(cx);
        }
        let frame = ready!(Pin::new(&mut this.body).poll_frame(cx));
        match &frame {
            None => this.release(),
            Some(Ok(_)) if this.body.is_end_stream() => this.release(),
            Some(Ok(_)) => {}
            Some(Err(_)) => this.conn = None,
        }
        Poll::Ready(frame.map(|f| f.map_err(Into::into)))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A request or response body on the gateway: straight from a connection,
/// or in memory (a buffered request, a problem answer).
#[derive(Debug)]
pub enum ProxyBody {
    /// A request body streamed from a client, with its read time-out.
    Client(ClientBody),
    /// Streamed from hyper without a read time-out.
    Incoming(Incoming),
    /// An upstream's response, driving its connection as it is read.
    Upstream(UpstreamBody),
    /// In memory.
    Full(Full<Bytes>),
}

impl From<Bytes> for ProxyBody {
    fn from(bytes: Bytes) -> Self {
        Self::Full(Full::new(bytes))
    }
}

impl Body for ProxyBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            Self::Client(b) => Pin::new(b).poll_frame(cx),
            Self::Incoming(b) => Pin::new(b).poll_frame(cx).map_err(Into::into),
            Self::Upstream(b) => Pin::new(b).poll_frame(cx),
            Self::Full(b) => Pin::new(b).poll_frame(cx).map_err(|never| match never {}),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Client(b) => b.is_end_stream(),
            Self::Incoming(b) => b.is_end_stream(),
            Self::Upstream(b) => b.is_end_stream(),
            Self::Full(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Client(b) => b.size_hint(),
            Self::Incoming(b) => b.size_hint(),
            Self::Upstream(b) => b.size_hint(),
            Self::Full(b) => b.size_hint(),
        }
    }
}

//! Keep-alive connections to the upstream, plain or TLS, each HTTP/1.1
//! connection driven by the request that uses it.
//!
//! hyper's pooled client runs every connection in a task of its own: a
//! request travels to that task through a channel, its answer comes back
//! through another, and every step wakes the other task — two or three
//! wake-ups per request, often across the two worker threads. Here the
//! request's own task polls an HTTP/1.1 connection while it waits for the
//! answer, and the response body polls it while the client reads, so a
//! proxied request stays on one task from the client's socket to the
//! upstream's and back (as an nginx worker does). A connection goes back to
//! the idle list when its response body has been read to the end; a body
//! dropped half-read closes it.
//!
//! Idle connections are kept per event loop. A connection's socket is
//! registered with the reactor of the runtime that opened it, and only that
//! reactor learns when the upstream answers: used from another serving
//! thread, every answer would wake that thread's loop, which then wakes the
//! request's (two wake-ups, and the other core roused, per response). So a
//! request takes an idle connection its own loop opened, or opens one; like
//! an nginx worker's keep-alive cache.
//!
//! Idle connections are not polled. One the upstream closed meanwhile is
//! found out when it is taken (its connection is polled once, without a
//! waker, and reports the close) and replaced by a fresh one; a request
//! refused by a connection before any of it was written is sent once more
//! on a fresh connection.
//!
//! An `https://` upstream is reached over TLS (SNI and the certificate's
//! name from the URL's host). When it offers HTTP/2 by ALPN (and
//! `upstream_http2` allows it), one HTTP/2 connection carries every request
//! at once; it runs in a task of its own, as HTTP/2's shared connection
//! must. A handshake that fails, or a TLS 1.3 server that refuses the
//! gateway's client certificate right after it, is
//! [`ExchangeError::Tls`]: nothing was sent.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker, ready};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::header::{HOST, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, Uri, Version};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::{TrySendError, http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use idem_http::BoxError;
use tokio::runtime;

use super::connect::{ConnectError, Connector, Refusal, Stream};
use crate::serve::body::ClientBody;

/// Idle connections kept at most per event loop; beyond, the oldest is
/// closed.
const MAX_IDLE: usize = 1024;
/// An idle connection older than this is closed instead of reused.
const IDLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How often a quiet HTTP/2 connection is pinged, and how long the answer
/// may take before the connection counts as dead (a silent peer is found
/// before a request waits on it).
const H2_PING_EVERY: Duration = Duration::from_secs(20);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(10);

/// Why an exchange with the upstream failed, as the idempotency layer
/// needs to know it.
#[derive(Debug)]
pub enum ExchangeError {
    /// Nothing of the request reached the upstream (connection refused,
    /// unreachable, or every connection closed before the request was
    /// written): retrying is safe.
    NotSent(String),
    /// No trusted TLS session with the upstream (its certificate cannot be
    /// verified, or it refused the gateway's): nothing was sent, and a
    /// retry fails the same way until the certificates are fixed.
    Tls(String),
    /// The request was written, at least in part, and no complete answer
    /// came back: it may have taken effect.
    MaybeSent(String),
}

/// One open HTTP/1.1 connection: the sending half and the connection
/// itself.
struct Conn {
    sender: http1::SendRequest<ProxyBody>,
    link: Link,
    /// The runtime whose reactor the socket is registered with.
    home: Option<runtime::Id>,
}

/// The runtime the caller runs on: on the gateway, one serving thread's
/// event loop (or the shared runtime).
fn current_home() -> Option<runtime::Id> {
    runtime::Handle::try_current().ok().map(|h| h.id())
}

/// The idle connections one runtime opened, most recently used last.
struct Idle {
    home: Option<runtime::Id>,
    conns: VecDeque<(Box<Conn>, Instant)>,
}

/// The connection future: it does the reading and writing for the sender
/// and the response body, whenever it is polled.
struct Link {
    conn: http1::Connection<TokioIo<Stream>, ProxyBody>,
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

    /// Runs `fut` while driving the connection. It takes the future
    /// pinned where the caller made it: taken by value, an async `drive`
    /// held it twice (the argument, and the pinned copy it moved to; the
    /// exchange's future was 2,032 bytes then, 1,680 without).
    fn drive<F: Future>(&mut self, mut fut: Pin<&mut F>) -> impl Future<Output = F::Output> {
        std::future::poll_fn(move |cx| {
            self.poll(cx);
            fut.as_mut().poll(cx)
        })
    }
}

impl Conn {
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

/// A connection a request can go on.
enum Channel {
    /// An HTTP/1.1 connection of its own (boxed once: it moves between the
    /// idle list, the request and its response body as a pointer).
    Http1(Box<Conn>),
    /// A stream on the shared HTTP/2 connection.
    Http2(http2::SendRequest<ProxyBody>),
}

/// How one try of a request on one connection ended.
enum Tried {
    Answered(Response<UpstreamBody>),
    /// The connection refused it before any of it was written.
    Unsent(Request<ProxyBody>, String),
    Failed(ExchangeError),
}

/// The upstream origin and its connections: idle HTTP/1.1 ones, or the
/// one HTTP/2 connection.
pub struct Upstream {
    authority: Authority,
    connector: Connector,
    /// Idle HTTP/1.1 connections, one list per runtime that opened them.
    idle: Mutex<Vec<Idle>>,
    /// HTTP/2 is offered by ALPN (an `https://` upstream with
    /// `upstream_http2 = "auto"`).
    http2: bool,
    /// A plain `http://` upstream: HTTP/2 is spoken to it only by prior
    /// knowledge.
    plain: bool,
    /// Every request to a plain upstream goes in HTTP/2 by prior
    /// knowledge (`upstream_http2 = "prior_knowledge"`); otherwise only
    /// gRPC calls do, which HTTP/1.1 cannot carry.
    prior_knowledge: bool,
    /// The one HTTP/2 connection, once opened.
    shared: Mutex<Option<http2::SendRequest<ProxyBody>>>,
}

impl std::fmt::Debug for Upstream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Upstream")
            .field("authority", &self.authority)
            .field("connector", &self.connector)
            .field(
                "idle",
                &self
                    .idle
                    .lock()
                    .map(|idle| idle.iter().map(|i| i.conns.len()).sum::<usize>())
                    .ok(),
            )
            .finish()
    }
}

impl Upstream {
    /// Connections to `authority` (`host:port`): over TLS with `tls`
    /// (an `https://` upstream), plain without; to a plain one, HTTP/2 by
    /// prior knowledge for every request with `prior_knowledge`, for gRPC
    /// calls only without.
    pub fn new(
        authority: Authority,
        tls: Option<Arc<rustls::ClientConfig>>,
        prior_knowledge: bool,
    ) -> Arc<Self> {
        let http2 = tls
            .as_ref()
            .is_some_and(|c| c.alpn_protocols.iter().any(|p| p == b"h2"));
        let plain = tls.is_none();
        Arc::new(Self {
            connector: Connector::new(&authority, tls),
            http2,
            plain,
            prior_knowledge: plain && prior_knowledge,
            authority,
            idle: Mutex::new(Vec::new()),
            shared: Mutex::new(None),
        })
    }

    /// Sends `req` (its URI reduced to path and query; `grpc`: a gRPC
    /// call) and returns the response head; the body drives the
    /// connection until it is read.
    pub async fn send(
        self: Arc<Self>,
        mut req: Request<ProxyBody>,
        grpc: bool,
    ) -> Result<Response<UpstreamBody>, ExchangeError> {
        let path = req
            .uri()
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        *req.uri_mut() = Uri::from(path);
        if !req.headers().contains_key(HOST)
            && let Ok(host) = HeaderValue::from_str(self.authority.as_str())
        {
            req.headers_mut().insert(HOST, host);
        }
        // A reused connection may turn out closed before anything was
        // written; the request then goes once more, on another idle
        // HTTP/1.1 connection or a fresh one (never the same HTTP/2
        // connection twice: each turn takes a connection off the idle list
        // or opens one, so this ends).
        //
        // Opening a connection (connect, TLS and HTTP/2 handshakes) and an
        // HTTP/2 exchange are boxed: inline, their state machines made this
        // future several times the size of the common case (a request on
        // an idle HTTP/1.1 connection), and every request copied all of it
        // from one wrapper to the next on its way into the gateway's box.
        let mut allow_shared = true;
        // HTTP/2 by prior knowledge to a plain upstream: for every request,
        // or for a gRPC call, which needs HTTP/2 end to end.
        let h2c = self.plain && (self.prior_knowledge || grpc);
        loop {
            let (channel, fresh) = match self.checkout(allow_shared, h2c) {
                Some(channel) => (channel, None),
                None => {
                    let (channel, refusal) = Box::pin(self.open(h2c)).await?;
                    (channel, Some(refusal))
                }
            };
            let tried = match channel {
                // In place, not in a function of its own: its future held
                // the request once more beside this one's (1,680 → 1,032
                // bytes for the whole exchange).
                Channel::Http1(mut conn) => {
                    *req.version_mut() = Version::HTTP_11;
                    let ready = conn.link.drive(pin!(conn.sender.ready())).await;
                    if let Err(err) = ready {
                        Tried::Unsent(
                            req,
                            format!(
                                "the upstream closed the connection before the request was written: {err}"
                            ),
                        )
                    } else {
                        let sent = conn
                            .link
                            .drive(pin!(conn.sender.try_send_request(req)))
                            .await;
                        match sent {
                            Ok(resp) => Tried::Answered(resp.map(|body| UpstreamBody {
                                body,
                                conn: Some(conn),
                                upstream: Arc::clone(&self),
                            })),
                            Err(err) => unanswered(err),
                        }
                    }
                }
                Channel::Http2(sender) => Box::pin(self.send_http2(sender, req)).await,
            };
            // A fresh TLS connection the upstream refused right after the
            // handshake: nothing was taken in, however the request failed.
            if !matches!(tried, Tried::Answered(_))
                && let Some(why) = fresh.as_ref().and_then(Refusal::get)
            {
                return Err(ExchangeError::Tls(why.to_owned()));
            }
            match tried {
                Tried::Answered(resp) => return Ok(resp),
                Tried::Unsent(unsent, _) if fresh.is_none() => {
                    req = unsent;
                    allow_shared = false;
                }
                Tried::Unsent(_, why) => return Err(ExchangeError::NotSent(why)),
                Tried::Failed(err) => return Err(err),
            }
        }
    }

    async fn send_http2(
        self: &Arc<Self>,
        mut sender: http2::SendRequest<ProxyBody>,
        mut req: Request<ProxyBody>,
    ) -> Tried {
        // HTTP/2 names the origin in :scheme and :authority, not in Host:
        // the authority is the Host HTTP/1.1 would carry.
        let authority = req
            .headers_mut()
            .remove(HOST)
            .and_then(|h| Authority::try_from(h.as_bytes()).ok())
            .unwrap_or_else(|| self.authority.clone());
        let scheme = if self.plain {
            Scheme::HTTP
        } else {
            Scheme::HTTPS
        };
        let mut uri = Uri::builder().scheme(scheme).authority(authority);
        if let Some(path) = req.uri().path_and_query() {
            uri = uri.path_and_query(path.clone());
        }
        match uri.build() {
            Ok(uri) => *req.uri_mut() = uri,
            Err(err) => {
                return Tried::Failed(ExchangeError::NotSent(format!(
                    "no HTTP/2 request target: {err}"
                )));
            }
        }
        *req.version_mut() = Version::HTTP_2;
        // HTTP/2 frames the body itself; a chunked marker set for HTTP/1.1
        // would only be dropped, with a warning, by the HTTP/2 client.
        req.headers_mut().remove(http::header::TRANSFER_ENCODING);
        if let Err(err) = sender.ready().await {
            self.forget_closed();
            return Tried::Unsent(
                req,
                format!(
                    "the upstream's HTTP/2 connection closed before the request was written: {err}"
                ),
            );
        }
        match sender.try_send_request(req).await {
            Ok(resp) => Tried::Answered(resp.map(|body| UpstreamBody {
                body,
                conn: None,
                upstream: Arc::clone(self),
            })),
            Err(err) => {
                self.forget_closed();
                unanswered(err)
            }
        }
    }

    /// A new connection: HTTP/2 when the upstream chose it by ALPN, or by
    /// prior knowledge when `h2c` says so (then shared by every request
    /// that speaks HTTP/2), HTTP/1.1 otherwise.
    async fn open(&self, h2c: bool) -> Result<(Channel, Refusal), ExchangeError> {
        let (stream, h2) = self.connector.connect().await.map_err(|err| match err {
            ConnectError::Unreachable(why) => ExchangeError::NotSent(why),
            ConnectError::Tls(why) => ExchangeError::Tls(why),
        })?;
        let addr = &self.authority;
        let refusal = stream.refusal();
        if h2 || h2c {
            let (sender, conn) = http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .keep_alive_interval(H2_PING_EVERY)
                .keep_alive_timeout(H2_PING_TIMEOUT)
                .handshake(TokioIo::new(stream))
                .await
                .map_err(|err| {
                    ExchangeError::NotSent(format!("cannot start HTTP/2 with {addr}: {err}"))
                })?;
            tokio::spawn(async move {
                if let Err(err) = conn.await {
                    tracing::debug!(%err, "upstream HTTP/2 connection ended with an error");
                }
            });
            if let Ok(mut shared) = self.shared.lock() {
                *shared = Some(sender.clone());
            }
            return Ok((Channel::Http2(sender), refusal));
        }
        let (sender, conn) = http1::Builder::new()
            .handshake(TokioIo::new(stream))
            .await
            .map_err(|err| {
                ExchangeError::NotSent(format!("cannot start HTTP/1.1 with {addr}: {err}"))
            })?;
        let conn = Conn {
            sender,
            link: Link { conn, done: false },
            home: current_home(),
        };
        Ok((Channel::Http1(Box::new(conn)), refusal))
    }

    /// The shared HTTP/2 connection if it is open (and `allow_shared`
    /// says so), else the most recently used idle HTTP/1.1 connection that
    /// the caller's runtime opened and that is still open; never an
    /// HTTP/1.1 one for a request that goes in HTTP/2 by prior knowledge
    /// (`h2c`).
    fn checkout(&self, allow_shared: bool, h2c: bool) -> Option<Channel> {
        if allow_shared
            && (self.http2 || h2c)
            && let Ok(shared) = self.shared.lock()
            && let Some(sender) = shared.as_ref().filter(|s| !s.is_closed())
        {
            return Some(Channel::Http2(sender.clone()));
        }
        if h2c {
            return None;
        }
        let home = current_home();
        loop {
            let (mut conn, since) = {
                let mut idle = self.idle.lock().ok()?;
                idle.iter_mut().find(|i| i.home == home)?.conns.pop_back()?
            };
            if since.elapsed() < IDLE_TIMEOUT && conn.still_open() {
                return Some(Channel::Http1(conn));
            }
        }
    }

    /// Stops handing out the shared HTTP/2 connection once it has closed
    /// (the next request opens a fresh one); a failed stream on a live
    /// connection leaves it shared.
    fn forget_closed(&self) {
        if let Ok(mut shared) = self.shared.lock()
            && shared.as_ref().is_some_and(http2::SendRequest::is_closed)
        {
            *shared = None;
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
        // Every list sheds what has been idle too long, so the connections
        // of a runtime that no longer takes any (one that was shut down)
        // are closed too; a list left empty goes, unless it is this one's.
        idle.retain_mut(|list| {
            while list
                .conns
                .front()
                .is_some_and(|(_, since)| now.duration_since(*since) >= IDLE_TIMEOUT)
            {
                list.conns.pop_front();
            }
            !list.conns.is_empty() || list.home == conn.home
        });
        let list = match idle.iter().position(|list| list.home == conn.home) {
            Some(at) => &mut idle[at],
            None => {
                idle.push(Idle {
                    home: conn.home,
                    conns: VecDeque::new(),
                });
                idle.last_mut().expect("just pushed")
            }
        };
        if list.conns.len() >= MAX_IDLE {
            list.conns.pop_front();
        }
        list.conns.push_back((conn, now));
    }
}

/// A request the connection gave back (nothing of it written), or the
/// failure of one it took.
fn unanswered(mut err: TrySendError<Request<ProxyBody>>) -> Tried {
    match err.take_message() {
        Some(unsent) => Tried::Unsent(
            unsent,
            format!(
                "the upstream closed the connection before the request was written: {}",
                err.error()
            ),
        ),
        None => Tried::Failed(ExchangeError::MaybeSent(err.error().to_string())),
    }
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

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::BodyExt;
    use hyper::service::service_fn;

    use super::*;

    /// An HTTP/1.1 upstream, on a thread of its own, that answers every
    /// request with `200 ok` and counts the connections it accepted.
    fn counting_upstream() -> (Authority, Arc<AtomicUsize>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let addr = listener.local_addr().expect("addr");
        let accepted = Arc::new(AtomicUsize::new(0));
        let counted = Arc::clone(&accepted);
        std::thread::spawn(move || {
            let rt = runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).expect("listener");
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        return;
                    };
                    counted.fetch_add(1, Ordering::SeqCst);
                    tokio::spawn(async move {
                        let answer = service_fn(|_req| async {
                            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"ok"))))
                        });
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), answer)
                            .await;
                    });
                }
            });
        });
        (addr.to_string().parse().expect("authority"), accepted)
    }

    /// One GET through `upstream`, its body read to the end (which puts
    /// the connection back on the idle list). A connection whose reactor
    /// is not running never hears its answer: that fails here, in time.
    async fn get(upstream: &Arc<Upstream>) {
        let exchange = async {
            let req = Request::get("/")
                .body(ProxyBody::from(Bytes::new()))
                .expect("request");
            let resp = Arc::clone(upstream)
                .send(req, false)
                .await
                .expect("answered");
            assert_eq!(resp.status(), 200);
            resp.into_body().collect().await.expect("body").to_bytes()
        };
        let body = tokio::time::timeout(Duration::from_secs(5), exchange)
            .await
            .expect("the answer reached this event loop");
        assert_eq!(&body[..], b"ok");
    }

    fn event_loop() -> runtime::Runtime {
        runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime")
    }

    #[test]
    fn an_idle_connection_is_taken_only_by_the_event_loop_that_opened_it() {
        let (authority, accepted) = counting_upstream();
        let upstream = Upstream::new(authority, None, false);
        let (one, two) = (event_loop(), event_loop());

        one.block_on(get(&upstream));
        one.block_on(get(&upstream));
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "the loop reuses its own"
        );

        // Another loop would have to be woken by the first one's reactor
        // for every answer on that connection: it opens its own.
        two.block_on(get(&upstream));
        assert_eq!(accepted.load(Ordering::SeqCst), 2);

        for _ in 0..3 {
            one.block_on(get(&upstream));
            two.block_on(get(&upstream));
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            2,
            "each loop keeps reusing the connection it opened"
        );
    }

    #[test]
    fn a_shut_down_loops_connections_are_never_handed_to_another() {
        let (authority, accepted) = counting_upstream();
        let upstream = Upstream::new(authority, None, false);
        let gone = event_loop();
        gone.block_on(get(&upstream));
        drop(gone);
        let live = event_loop();
        live.block_on(get(&upstream));
        live.block_on(get(&upstream));
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
        let homes = upstream.idle.lock().expect("idle").len();
        assert_eq!(
            homes, 2,
            "the gone loop's list stays until it has idled out"
        );
    }
}

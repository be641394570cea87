//! The reverse proxy the idempotency layer wraps: keep-alive connections
//! to one upstream origin, plain or TLS (`connect`), HTTP/1.1 ones each
//! driven by the request that uses it, or one shared HTTP/2 connection
//! when a TLS upstream offers it (`upstream`).
//!
//! It tells the layer what happened to a request it could not complete,
//! through [`UpstreamOutcome`]: refused or unreachable before sending, or
//! no trusted TLS session (`502 upstream-tls`) → `502` and
//! [`UpstreamOutcome::NotSent`] (the key is released); no answer
//! within the timeout, or a connection that broke after sending → `504` /
//! `502` and [`UpstreamOutcome::MaybeSent`] (the record stays
//! `outcome_unknown`).

mod connect;
mod upstream;

pub use upstream::{ExchangeError, ProxyBody, Upstream, UpstreamBody};

use std::cell::RefCell;
use std::convert::Infallible;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, Uri};
use http_body::Body;
use idem_http::{PeerAddr, Problem, ProblemKind, UpstreamOutcome, hop_by_hop_names, is_trusted};
use ipnet::IpNet;
use tokio::time::error::Elapsed;
use tower::Service;

use crate::serve::limits::Slot;
use crate::telemetry;

/// Forwards requests to one upstream origin. Cloned for every request
/// (tower's clone-and-swap): one `Arc`.
#[derive(Debug, Clone)]
pub struct Proxy {
    upstream: Arc<Upstream>,
    timeout: Duration,
    /// The peers whose `X-Forwarded-For` and `Forwarded` are passed on
    /// (the tenant's trusted proxies); anyone else's are removed, since a
    /// client can write any address there.
    trusted: Arc<[IpNet]>,
}

impl Proxy {
    /// A proxy to `upstream` (an `http://host:port` origin, spoken to in
    /// HTTP/2 by prior knowledge with `prior_knowledge`, or
    /// `https://host:port` with the TLS client `tls`).
    pub fn new(
        upstream: &Uri,
        tls: Option<Arc<rustls::ClientConfig>>,
        prior_knowledge: bool,
        timeout: Duration,
    ) -> Self {
        Self {
            upstream: Upstream::new(
                upstream
                    .authority()
                    .cloned()
                    .expect("validated upstream has an authority"),
                tls,
                prior_knowledge,
            ),
            timeout,
            trusted: Arc::new([]),
        }
    }

    /// Passes on the `X-Forwarded-For` and `Forwarded` headers of requests
    /// from these peers (compared by canonical address).
    pub fn with_trusted_proxies(mut self, proxies: &[IpNet]) -> Self {
        self.trusted = proxies.into();
        self
    }
}

impl Service<Request<ProxyBody>> for Proxy {
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = ResponseFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<ProxyBody>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        // The request's in-flight slot moves to the response, so that it is
        // held until whoever handles the answer (the idempotency layer,
        // recording it after the client left) is done with it.
        let slot = parts.extensions.remove::<Slot>();
        let grpc = idem_http::grpc::is_grpc(&parts.headers);
        // `TE: trailers` is the one TE HTTP/2 allows, and a gRPC server
        // refuses a call without it: a gRPC call's goes on, the rest of TE
        // does not.
        let trailers = grpc
            && parts
                .headers
                .get(http::header::TE)
                .is_some_and(|te| te.as_bytes().eq_ignore_ascii_case(b"trailers"));
        strip_hop_by_hop(&mut parts.headers);
        if trailers {
            parts
                .headers
                .insert(http::header::TE, HeaderValue::from_static("trailers"));
        }
        // A gRPC call's own deadline, when sooner than the gateway's.
        let timeout = match grpc.then(|| idem_http::grpc::timeout(&parts.headers)) {
            Some(Some(deadline)) => deadline.min(self.timeout),
            _ => self.timeout,
        };
        // A body of unknown length goes on chunked, whatever the method:
        // left to itself the HTTP/1 client sends a GET, HEAD or CONNECT
        // without it (RFC 9110 gives such a body no meaning, but it is the
        // client's to send and the upstream's to judge, not ours to drop).
        if !body.is_end_stream() && body.size_hint().exact().is_none() {
            parts.headers.insert(
                http::header::TRANSFER_ENCODING,
                HeaderValue::from_static("chunked"),
            );
        }
        let peer = parts.extensions.get::<PeerAddr>().copied();
        if !is_trusted(&self.trusted, peer.as_ref()) {
            parts.headers.remove(X_FORWARDED_FOR);
            parts.headers.remove(http::header::FORWARDED);
        }
        // The serving loop puts the canonical address in `PeerAddr`.
        if let Some(PeerAddr(peer)) = peer
            && let Some(v) = forwarded_for(peer.ip())
        {
            parts.headers.append(X_FORWARDED_FOR, v);
        }
        let span = telemetry::upstream_span(&parts.method);
        telemetry::propagate(&span, &mut parts.headers);
        let exchange = Arc::clone(&self.upstream).send(Request::from_parts(parts, body), grpc);
        ResponseFuture {
            exchange: Box::pin(tokio::time::timeout(timeout, exchange)),
            slot,
            timeout,
            span,
        }
    }
}

/// What an exchange with the upstream ends in: its answer, an error, or
/// the time-out.
type Sent = Result<Result<Response<UpstreamBody>, ExchangeError>, Elapsed>;

/// The answer to one proxied request: the exchange with the upstream, run
/// in its span, then turned into the client's response by `answer`.
///
/// The request is made ready in [`Proxy::call`], and only the exchange and
/// its time-out are boxed (1,144 bytes). An async block around them would
/// hold the exchange twice (the future, and the place it moves to when
/// awaited), and every request would copy the whole block into its box
/// (4,608 bytes) and the exchange once more for each wrapper.
pub struct ResponseFuture {
    exchange: Pin<Box<dyn Future<Output = Sent> + Send>>,
    slot: Option<Slot>,
    timeout: Duration,
    span: tracing::Span,
}

impl std::fmt::Debug for ResponseFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl Future for ResponseFuture {
    type Output = Result<Response<ProxyBody>, Infallible>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let sent = {
            let _in_span = this.span.enter();
            ready!(this.exchange.as_mut().poll(cx))
        };
        Poll::Ready(Ok(answer(sent, this.slot.take(), this.timeout, &this.span)))
    }
}

/// The client's answer to an exchange with the upstream: its response
/// with the connection-level headers removed, or the failure the layer
/// needs to know about. `slot` (the request's in-flight slot) goes with it.
fn answer(
    sent: Sent,
    slot: Option<Slot>,
    timeout: Duration,
    span: &tracing::Span,
) -> Response<ProxyBody> {
    if !matches!(sent, Ok(Ok(_))) && !span.is_disabled() {
        span.record("otel.status_code", "ERROR");
    }
    let mut resp = match sent {
        // The gateway never asks for a protocol switch (`Upgrade` is not
        // forwarded), so a `101` is a broken answer: the request was sent,
        // and what became of it is unknown.
        Ok(Ok(resp)) if resp.status() == http::StatusCode::SWITCHING_PROTOCOLS => {
            tracing::warn!(
                reason = "upstream_broken",
                "the upstream switched protocols unasked"
            );
            failure(
                Problem::new(
                    ProblemKind::UpstreamBroken,
                    "the upstream answered 101 Switching Protocols to a request that asked for no upgrade; its outcome is unknown",
                ),
                UpstreamOutcome::MaybeSent,
            )
        }
        Ok(Ok(resp)) => {
            if !span.is_disabled() {
                span.record("http.response.status_code", resp.status().as_u16());
            }
            let (mut parts, body) = resp.into_parts();
            // Framed by its chunked encoding (RFC 9112 §6.3): a
            // Content-Length beside it is wrong, and passed on it would
            // make the client read the next answer as body.
            if parts.headers.contains_key(http::header::TRANSFER_ENCODING) {
                parts.headers.remove(http::header::CONTENT_LENGTH);
            }
            strip_hop_by_hop(&mut parts.headers);
            Response::from_parts(parts, ProxyBody::Upstream(body))
        }
        Ok(Err(ExchangeError::NotSent(err))) => {
            tracing::warn!(reason = "upstream_unreachable", %err);
            failure(
                Problem::new(
                    ProblemKind::UpstreamUnreachable,
                    "the upstream could not be reached; nothing was sent, retrying is safe",
                ),
                UpstreamOutcome::NotSent,
            )
        }
        Ok(Err(ExchangeError::Tls(err))) => {
            tracing::warn!(reason = "upstream_tls", %err);
            failure(
                Problem::new(
                    ProblemKind::UpstreamTls,
                    "the gateway has no trusted TLS session with the upstream (its certificate could not be verified, or it refused the gateway's); nothing was sent",
                ),
                UpstreamOutcome::NotSent,
            )
        }
        Ok(Err(ExchangeError::MaybeSent(err))) => {
            tracing::warn!(reason = "upstream_broken", %err);
            failure(
                Problem::new(
                    ProblemKind::UpstreamBroken,
                    "the upstream connection broke after the request was sent; its outcome is unknown",
                ),
                UpstreamOutcome::MaybeSent,
            )
        }
        Err(_) => {
            tracing::warn!(
                reason = "upstream_timeout",
                timeout_ms = timeout.as_millis() as u64
            );
            failure(
                Problem::new(
                    ProblemKind::UpstreamTimeout,
                    format!(
                        "the upstream did not answer within {timeout:?}; the request may have taken effect"
                    ),
                ),
                UpstreamOutcome::MaybeSent,
            )
        }
    };
    if let Some(slot) = slot {
        resp.extensions_mut().insert(slot);
    }
    resp
}

/// Named once: `HeaderName::from_static` checks its text on every call
/// made at run time.
const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");

/// The `X-Forwarded-For` value naming `ip`. Each serving thread keeps the
/// last one it made: requests come in runs from one address (a keep-alive
/// connection, a load balancer in front), and formatting an address and
/// copying it into a header value cost more than the rest of the header
/// handling together (`callgrind`, pass-through).
fn forwarded_for(ip: IpAddr) -> Option<HeaderValue> {
    thread_local! {
        static LAST: RefCell<Option<(IpAddr, HeaderValue)>> = const { RefCell::new(None) };
    }
    LAST.with(|last| {
        let mut last = last.borrow_mut();
        if let Some((cached, value)) = last.as_ref()
            && *cached == ip
        {
            return Some(value.clone());
        }
        let value = HeaderValue::from_str(&ip.to_string()).ok()?;
        *last = Some((ip, value.clone()));
        Some(value)
    })
}

/// Removes connection-level headers, including those named by `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in hop_by_hop_names(headers) {
        headers.remove(name);
    }
}

/// The gateway's own answer when the upstream failed: the problem (also
/// in the extensions, for the layer to say it as a route's clients read
/// it, a gRPC status say) and what became of the request.
fn failure(problem: Problem, outcome: UpstreamOutcome) -> Response<ProxyBody> {
    let (parts, body) = problem.to_response().into_parts();
    let mut resp = Response::from_parts(parts, ProxyBody::Full(body));
    resp.extensions_mut().insert(outcome);
    resp.extensions_mut().insert(problem);
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(headers: &HeaderMap) -> Vec<&str> {
        headers.keys().map(HeaderName::as_str).collect()
    }

    #[test]
    fn connection_level_headers_are_stripped_and_the_rest_left_as_it_was() {
        let mut plain = HeaderMap::new();
        plain.insert(http::header::HOST, HeaderValue::from_static("api"));
        plain.insert("x-custom", HeaderValue::from_static("1"));
        plain.append("x-custom", HeaderValue::from_static("2"));
        let before = plain.clone();
        strip_hop_by_hop(&mut plain);
        assert_eq!(plain, before);

        // A Connection header names more: those go too, with every one of
        // the fixed set.
        let mut h = before.clone();
        h.insert(
            http::header::CONNECTION,
            HeaderValue::from_static("close, x-custom"),
        );
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(http::header::TE, HeaderValue::from_static("trailers"));
        h.insert(http::header::UPGRADE, HeaderValue::from_static("h2c"));
        strip_hop_by_hop(&mut h);
        assert_eq!(names(&h), ["host"]);

        // One of the fixed set alone, without a Connection header.
        let mut h = before.clone();
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(
            http::header::PROXY_AUTHORIZATION,
            HeaderValue::from_static("Basic x"),
        );
        strip_hop_by_hop(&mut h);
        assert_eq!(h, before);
    }

    #[test]
    fn forwarded_for_names_each_address_however_they_alternate() {
        let a: IpAddr = "192.0.2.7".parse().expect("address");
        let b: IpAddr = "2001:db8::1".parse().expect("address");
        for ip in [a, a, b, a, b, b] {
            assert_eq!(
                forwarded_for(ip).expect("a valid value").to_str().ok(),
                Some(ip.to_string().as_str())
            );
        }
    }

    /// The headers the upstream got for a request with a forwarding chain
    /// of its own (`X-Forwarded-For` and `Forwarded`), from `peer`,
    /// through `proxy`.
    async fn as_forwarded(
        up: &idem_testkit::upstream::CountingUpstream,
        mut proxy: Proxy,
        peer: &str,
    ) -> HeaderMap {
        let req = Request::post("/v1/public")
            .header(X_FORWARDED_FOR, "6.6.6.6")
            .header(http::header::FORWARDED, "for=6.6.6.6")
            .extension(PeerAddr(peer.parse().expect("peer address")))
            .body(ProxyBody::from(bytes::Bytes::from_static(b"{}")))
            .expect("request");
        let Ok(resp) = proxy.call(req).await;
        assert_eq!(resp.status(), http::StatusCode::CREATED);
        up.last_headers().expect("a request reached the upstream")
    }

    /// `with_trusted_proxies`: from a peer in the nets given (compared by
    /// canonical address, an IPv4-mapped one too), the request's own
    /// `X-Forwarded-For` and `Forwarded` go on, the peer appended to the
    /// chain; from any other peer, or with no trusted proxy, they are
    /// removed and the chain is the peer alone.
    #[tokio::test]
    async fn forwarding_headers_go_on_only_from_trusted_proxies() {
        let up = idem_testkit::upstream::CountingUpstream::start().await;
        let upstream: Uri = up.url().parse().expect("upstream URI");
        let proxy = || Proxy::new(&upstream, None, false, Duration::from_secs(10));
        let nets = |net: &str| -> Vec<IpNet> { vec![net.parse().expect("net")] };
        for (proxy, peer, chain, forwarded) in [
            (
                proxy().with_trusted_proxies(&nets("127.0.0.0/8")),
                "127.0.0.1:4000",
                &["6.6.6.6", "127.0.0.1"][..],
                Some("for=6.6.6.6"),
            ),
            (
                proxy().with_trusted_proxies(&nets("127.0.0.0/8")),
                "[::ffff:127.0.0.1]:4000",
                &["6.6.6.6", "::ffff:127.0.0.1"][..],
                Some("for=6.6.6.6"),
            ),
            (
                proxy().with_trusted_proxies(&nets("10.0.0.0/8")),
                "127.0.0.1:4000",
                &["127.0.0.1"][..],
                None,
            ),
            (proxy(), "127.0.0.1:4000", &["127.0.0.1"][..], None),
        ] {
            let trusted = format!("{:?}", proxy.trusted);
            let seen = as_forwarded(&up, proxy, peer).await;
            let got: Vec<_> = seen
                .get_all(X_FORWARDED_FOR)
                .iter()
                .map(|v| v.to_str().expect("ascii"))
                .collect();
            assert_eq!(got, chain, "{peer} through {trusted}");
            assert_eq!(
                seen.get(http::header::FORWARDED)
                    .map(|v| v.to_str().expect("ascii")),
                forwarded,
                "{peer} through {trusted}"
            );
        }
    }
}

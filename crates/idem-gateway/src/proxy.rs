//! The reverse proxy the idempotency layer wraps: a pooled HTTP/1.1
//! keep-alive client to one upstream origin.
//!
//! It tells the layer what happened to a request it could not complete,
//! through [`UpstreamOutcome`]: refused or unreachable before sending →
//! `502` and [`UpstreamOutcome::NotSent`] (the key is released); no answer
//! within the timeout, or a connection that broke after sending → `504` /
//! `502` and [`UpstreamOutcome::MaybeSent`] (the record stays
//! `outcome_unknown`).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_http::{BoxError, Problem, ProblemKind, UpstreamOutcome, hop_by_hop_names};
use tower::Service;

use crate::limits::{ClientBody, Slot};

/// A request or response body on the gateway: straight from a connection,
/// or in memory (a buffered request, a problem answer).
#[derive(Debug)]
pub enum ProxyBody {
    /// A request body streamed from a client, with its read time-out.
    Client(ClientBody),
    /// Streamed from hyper (an upstream's response).
    Incoming(Incoming),
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
            Self::Full(b) => Pin::new(b).poll_frame(cx).map_err(|never| match never {}),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Client(b) => b.is_end_stream(),
            Self::Incoming(b) => b.is_end_stream(),
            Self::Full(b) => b.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Client(b) => b.size_hint(),
            Self::Incoming(b) => b.size_hint(),
            Self::Full(b) => b.size_hint(),
        }
    }
}

/// The address of the client, put in request extensions by the server.
#[derive(Debug, Clone, Copy)]
pub struct PeerAddr(pub SocketAddr);

/// Forwards requests to one upstream origin.
#[derive(Debug, Clone)]
pub struct Proxy {
    client: Client<HttpConnector, ProxyBody>,
    scheme: Scheme,
    authority: Authority,
    timeout: Duration,
}

impl Proxy {
    /// A proxy to `upstream` (an `http://host:port` origin).
    pub fn new(upstream: &Uri, timeout: Duration) -> Self {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        let client = Client::builder(TokioExecutor::new())
            .pool_idle_timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(1024)
            .build(connector);
        Self {
            client,
            scheme: upstream.scheme().cloned().unwrap_or(Scheme::HTTP),
            authority: upstream
                .authority()
                .cloned()
                .expect("validated upstream has an authority"),
            timeout,
        }
    }
}

/// Removes connection-level headers, including those named by `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in hop_by_hop_names(headers) {
        headers.remove(name);
    }
}

fn failure(problem: Problem, outcome: UpstreamOutcome) -> Response<ProxyBody> {
    let (parts, body) = problem.to_response().into_parts();
    let mut resp = Response::from_parts(parts, ProxyBody::Full(body));
    resp.extensions_mut().insert(outcome);
    resp
}

impl Service<Request<ProxyBody>> for Proxy {
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<ProxyBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<ProxyBody>) -> Self::Future {
        let (mut parts, body) = req.into_parts();
        let path = parts
            .uri
            .path_and_query()
            .cloned()
            .unwrap_or_else(|| PathAndQuery::from_static("/"));
        let uri = Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(path)
            .build();
        let client = self.client.clone();
        let timeout = self.timeout;
        // The request's in-flight slot moves to the response, so that it is
        // held until whoever handles the answer (the idempotency layer,
        // recording it after the client left) is done with it.
        let slot = parts.extensions.remove::<Slot>();
        let forward = async move {
            parts.uri = match uri {
                Ok(uri) => uri,
                Err(e) => {
                    return Ok::<_, Infallible>(failure(
                        Problem::new(
                            ProblemKind::UpstreamUnreachable,
                            format!("cannot build the upstream URL: {e}"),
                        ),
                        UpstreamOutcome::NotSent,
                    ));
                }
            };
            strip_hop_by_hop(&mut parts.headers);
            if let Some(PeerAddr(peer)) = parts.extensions.get::<PeerAddr>().copied()
                && let Ok(v) = HeaderValue::from_str(&peer.ip().to_string())
            {
                parts
                    .headers
                    .append(HeaderName::from_static("x-forwarded-for"), v);
            }
            let req = Request::from_parts(parts, body);
            match tokio::time::timeout(timeout, client.request(req)).await {
                Ok(Ok(resp)) => {
                    let (mut parts, body) = resp.into_parts();
                    strip_hop_by_hop(&mut parts.headers);
                    Ok(Response::from_parts(parts, ProxyBody::Incoming(body)))
                }
                Ok(Err(err)) if err.is_connect() => {
                    tracing::warn!(reason = "upstream_unreachable", %err);
                    Ok(failure(
                        Problem::new(
                            ProblemKind::UpstreamUnreachable,
                            "the upstream could not be reached; nothing was sent, retrying is safe",
                        ),
                        UpstreamOutcome::NotSent,
                    ))
                }
                Ok(Err(err)) => {
                    tracing::warn!(reason = "upstream_broken", %err);
                    Ok(failure(
                        Problem::new(
                            ProblemKind::UpstreamBroken,
                            "the upstream connection broke after the request was sent; its outcome is unknown",
                        ),
                        UpstreamOutcome::MaybeSent,
                    ))
                }
                Err(_) => {
                    tracing::warn!(
                        reason = "upstream_timeout",
                        timeout_ms = timeout.as_millis() as u64
                    );
                    Ok(failure(
                        Problem::new(
                            ProblemKind::UpstreamTimeout,
                            format!(
                                "the upstream did not answer within {timeout:?}; the request may have taken effect"
                            ),
                        ),
                        UpstreamOutcome::MaybeSent,
                    ))
                }
            }
        };
        Box::pin(async move {
            let mut resp = forward.await?;
            if let Some(slot) = slot {
                resp.extensions_mut().insert(slot);
            }
            Ok(resp)
        })
    }
}

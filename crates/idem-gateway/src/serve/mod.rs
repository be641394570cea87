//! `idem serve`: the listener, the admin listener, graceful shutdown.

pub mod body;
mod contract;
pub mod deadlines;
pub mod limits;
pub mod workers;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use http_body::Body as _;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use idem_http::{
    Idempotency, IdempotencyLayer, PeerAddr, Problem, ProblemKind, ResponseBody, TenantSource,
};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower::{Layer, ServiceExt};
use tracing::Instrument;

use self::body::ClientBody;
use self::contract::Published;
use self::deadlines::{Activity, Deadlines, Tracked};
use self::limits::{Admission, ConnectionPlace, PerPeer};
use self::workers::{ServeConnection, Workers, close_within};
use crate::admin::AdminState;
use crate::config::LimitsSettings;
use crate::config::Settings;
use crate::error::GatewayError;
use crate::proxy::{Proxy, ProxyBody};
use crate::store::{GatewayStore, ServingLock, StoreUrl};
use crate::telemetry;
use idem::metrics::CONNECTIONS_REFUSED_TOTAL;

/// How often an HTTP/2 client is pinged, and how long its answer may take.
const HTTP2_PING_EVERY: Duration = Duration::from_secs(20);

/// Connections the admin listener serves at once; more wait in the listen
/// backlog.
const ADMIN_MAX_CONNECTIONS: usize = 64;

/// How often the store is listed for held records nobody follows.
const RECONCILE_SCAN_EVERY: Duration = Duration::from_secs(10);

/// The request pipeline: the idempotency layer around the proxy.
pub type Gateway = Idempotency<Proxy, GatewayStore, TenantSource>;

/// A bound, not yet running gateway.
#[derive(Debug)]
pub struct Server {
    listener: TcpListener,
    admin: TcpListener,
    gateway: Gateway,
    store: GatewayStore,
    admin_router: axum::Router,
    settings: Settings,
    /// Held while serving an embedded database (one gateway per file).
    _lock: Option<ServingLock>,
}

/// Opens the store and binds both listeners; errors name what failed.
pub async fn bind(settings: &Settings) -> Result<Server, GatewayError> {
    // Before anything records: the layer registers its counters when it
    // makes its service.
    crate::metrics::install();
    let retention = settings
        .routes
        .policies()
        .map(|p| p.engine.retention)
        .max()
        .unwrap_or(idem::Policy::default().retention);
    let url = StoreUrl::parse(&settings.store)?;
    let mut settings = settings.clone();
    settings.routes = url.fit_routes(settings.routes)?;
    settings.monitor.enabled = Some(settings.monitor.enabled.unwrap_or(url.lists_cheaply()));
    let lock = url.serving_lock()?;
    let hashing = url.hashing(
        settings.hash_secret.clone(),
        settings.accept_v1_until,
        retention,
    )?;
    let store = crate::store::open(
        &settings.store,
        settings.cache,
        settings.store_timeout,
        settings.seal.clone(),
        settings.workers,
    )
    .await?;
    let listener =
        TcpListener::bind(settings.listen)
            .await
            .map_err(|source| GatewayError::Listen {
                addr: settings.listen,
                admin: false,
                source,
            })?;
    let admin = TcpListener::bind(settings.admin_listen)
        .await
        .map_err(|source| GatewayError::Listen {
            addr: settings.admin_listen,
            admin: true,
            source,
        })?;
    let proxy = Proxy::new(
        &settings.upstream,
        settings.upstream_tls.clone(),
        settings.upstream_prior_knowledge,
        settings.upstream_timeout,
    )
    .with_trusted_proxies(settings.tenant.trusted_proxies());
    // Held records left by a gateway that died are found by listing the
    // store, where the monitor may list it (not on plain Redis); elsewhere
    // a client's retry brings them to the reconciliation.
    let scans = (settings.monitor.enabled == Some(true)).then_some(RECONCILE_SCAN_EVERY);
    let layer = IdempotencyLayer::new(store.clone())
        .with_routes(settings.routes.clone())
        .with_tenant(settings.tenant.clone())
        .with_hashing(hashing)
        .with_reconcile_scans(scans);
    // On the shared runtime, beside the store, not on a serving thread.
    layer.start_reconciliation();
    let gateway = layer.layer(proxy);
    let admin_router = crate::admin::router(AdminState {
        store: store.clone(),
        token: settings.admin_token.as_deref().map(Arc::from),
        default_retention: settings.routes.defaults().engine.retention,
    });
    Ok(Server {
        listener,
        admin,
        gateway,
        store,
        admin_router,
        settings,
        _lock: lock,
    })
}

impl Server {
    /// Where clients connect.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Where the admin API listens.
    pub fn admin_addr(&self) -> std::io::Result<SocketAddr> {
        self.admin.local_addr()
    }

    /// Serves until `shutdown` completes, then stops accepting, lets
    /// in-flight requests finish (up to the grace period) and closes the
    /// store, which flushes what it holds.
    pub async fn run(self, shutdown: impl Future<Output = ()>) {
        let Server {
            listener,
            admin,
            gateway,
            store,
            admin_router,
            settings,
            _lock: lock,
        } = self;
        let grace = settings.shutdown_grace;
        let limits = settings.limits;
        let mut jobs = crate::jobs::spawn(&store, settings.cleanup, settings.monitor);
        let builder = connection_builder(&limits);
        let admission = Admission::new(
            limits.max_in_flight,
            limits.max_in_flight_per_peer,
            limits.queue_wait,
        );
        let peer_connections = PerPeer::new(limits.max_connections_per_peer);
        let connections = Arc::new(Semaphore::new(limits.max_connections));
        let traces = telemetry::RequestTracing::new(settings.telemetry.as_ref());
        // Bodies a protected route reads whole anyway are read before
        // their request takes an in-flight slot.
        let read_ahead = settings
            .routes
            .policies()
            .map(|p| p.max_request_body)
            .max()
            .unwrap_or(0);
        let receiving = Receiving {
            up_to: read_ahead,
            all: Arc::new(Semaphore::new(limits.max_bodies.max(1))),
            per_peer: PerPeer::new(limits.max_bodies_per_peer),
        };
        let published =
            Published::new(settings.contract_path.as_deref(), &settings.routes).map(Arc::new);
        let serve = client_connections(
            gateway.clone(),
            published,
            admission,
            receiving,
            builder.clone(),
            &limits,
            traces,
        );
        let workers = match Workers::start(settings.workers, serve, grace) {
            Ok(workers) => workers,
            Err(err) => {
                tracing::error!(%err, "cannot start the serving threads");
                return;
            }
        };
        let admin_graceful = GracefulShutdown::new();
        let admin_connections = Arc::new(Semaphore::new(ADMIN_MAX_CONNECTIONS));
        let first_bytes = Some(limits.header_read_timeout).filter(|t| !t.is_zero());
        let idle = Some(limits.idle_timeout).filter(|t| !t.is_zero());
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            tokio::select! {
                // Past max_connections nothing is accepted: new connections
                // wait in the listen backlog until one closes.
                (accepted, open) = async {
                    let open = Arc::clone(&connections).acquire_owned().await;
                    (listener.accept().await, open)
                } => {
                    let (stream, peer) = match accepted {
                        Ok(conn) => conn,
                        Err(err) => {
                            tracing::warn!(%err, "accept failed");
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            continue;
                        }
                    };
                    // Once, here: every comparison of the address (per-peer
                    // shares, trusted_proxies, the forwarded address) then
                    // sees an IPv4 client of a dual-stack listener as
                    // a.b.c.d, not ::ffff:a.b.c.d.
                    let peer = canonical(peer);
                    // One address holds at most its share of connections:
                    // past it, a new one is closed at once.
                    let Some(mine) = peer_connections.take(peer.ip()) else {
                        metrics::counter!(CONNECTIONS_REFUSED_TOTAL.name).increment(1);
                        tracing::debug!(reason = "peer_connections", %peer, "connection closed: its peer holds max_connections_per_peer already");
                        drop(stream);
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    // The semaphore is never closed, so the permit is there.
                    if let Ok(open) = open {
                        workers.dispatch(stream, peer, ConnectionPlace::new(open, mine));
                    }
                }
                // A few connections at most (past them, new ones wait in
                // the listen backlog), each with the clients' time-outs:
                // the admin listener is no way around them.
                (accepted, place) = async {
                    let place = Arc::clone(&admin_connections).acquire_owned().await;
                    (admin.accept().await, place)
                } => {
                    let (Ok((stream, _)), Ok(place)) = (accepted, place) else { continue };
                    let (stream, activity) = Deadlines::for_connection(stream, first_bytes, idle);
                    let router = admin_router.clone();
                    let svc = service_fn(move |req: Request<Incoming>| {
                        // In flight until the answer's body is done (the
                        // dashboard's event stream keeps it busy).
                        let busy = activity.as_ref().map(Activity::start);
                        let router = router.clone();
                        async move {
                            let resp = router.oneshot(req).await?;
                            Ok::<_, std::convert::Infallible>(resp.map(|b| Tracked::new(b, busy)))
                        }
                    });
                    let conn = builder.serve_connection(TokioIo::new(stream), svc);
                    let conn = admin_graceful.watch(conn.into_owned());
                    tokio::spawn(async move {
                        let _ = conn.await;
                        drop(place);
                    });
                }
                () = &mut shutdown => break,
            }
        }
        drop(listener);
        drop(admin);
        jobs.abort_all();
        tracing::info!(
            grace_ms = grace.as_millis() as u64,
            "shutting down: finishing in-flight requests"
        );
        let (clients_closed, admin_closed) =
            tokio::join!(workers.stop(), close_within(admin_graceful, grace));
        if clients_closed && admin_closed {
            tracing::info!("all connections closed");
        } else {
            tracing::warn!("grace period over; closing remaining connections");
        }
        drop(gateway);
        // The last handle: dropping it closes the store (SQLite finishes its queue).
        drop(store);
        // Only then may another gateway serve the file.
        drop(lock);
    }
}

/// A client's address as the gateway compares it: an IPv4-mapped IPv6
/// address (`::ffff:a.b.c.d`, how a dual-stack listener sees IPv4
/// clients) is the IPv4 address.
fn canonical(peer: SocketAddr) -> SocketAddr {
    SocketAddr::new(peer.ip().to_canonical(), peer.port())
}

/// How request bodies are received before their request takes an
/// in-flight slot.
#[derive(Clone)]
struct Receiving {
    /// Bodies up to this many bytes (the largest `max_request_body`) are
    /// read whole first; a longer one streams after its first bytes.
    up_to: usize,
    /// Bodies arriving at once (`max_bodies`).
    all: Arc<Semaphore>,
    /// Bodies one address has arriving at once (`max_bodies_per_peer`).
    per_peer: Arc<PerPeer>,
}

impl Receiving {
    /// Whether a body is read ahead: one is still to come, and its
    /// announced length (if any; hyper has read `Content-Length` into the
    /// body's exact size) is within `up_to`.
    fn reads_ahead(&self, body: &ClientBody) -> bool {
        if body.is_end_stream() || self.up_to == 0 {
            return false;
        }
        let announced = body.size_hint().exact();
        announced.is_none_or(|n| n <= self.up_to as u64)
    }
}

/// How each worker serves a client connection: the request's body read
/// ahead (under the body time-outs and its peer's share), admission, then
/// the gateway.
///
/// A request takes its in-flight slot once its body is in: a client
/// dribbling its body holds a place among its address's bodies in
/// progress and its connections, never a slot, so the slots bound the
/// work the gateway and the upstream do.
fn client_connections(
    gateway: Gateway,
    published: Option<Arc<Published>>,
    admission: Admission,
    receiving: Receiving,
    builder: auto::Builder<TokioExecutor>,
    limits: &LimitsSettings,
    traces: telemetry::RequestTracing,
) -> ServeConnection {
    let body_timeout = Some(limits.body_read_timeout).filter(|t| !t.is_zero());
    let first_bytes = Some(limits.header_read_timeout).filter(|t| !t.is_zero());
    let body_total = Some(limits.body_total_timeout).filter(|t| !t.is_zero());
    let idle = Some(limits.idle_timeout).filter(|t| !t.is_zero());
    Arc::new(move |stream, peer, graceful| {
        let gateway = gateway.clone();
        let published = published.clone();
        let admission = admission.clone();
        let receiving = receiving.clone();
        let (stream, activity) = Deadlines::for_connection(stream, first_bytes, idle);
        let svc = service_fn(move |req: Request<Incoming>| {
            let gateway = gateway.clone();
            let published = published.clone();
            let admission = admission.clone();
            let receiving = receiving.clone();
            // In flight until the answer's body is done.
            let busy = activity.as_ref().map(Activity::start);
            async move {
                let track = |resp: Response<_>| resp.map(|b| Tracked::new(b, busy));
                // A gRPC call's refusals here are gRPC statuses too (the
                // layer says its own so).
                let grpc = idem_http::grpc::is_grpc(req.headers());
                let refused = |resp| {
                    if grpc {
                        idem_http::grpc::answer(resp)
                    } else {
                        resp
                    }
                };
                if let Some(problem) = host_problem(&req) {
                    tracing::debug!(reason = "host_invalid", %peer, detail = problem.detail());
                    return Ok(track(refused(ResponseBody::problem(&problem))));
                }
                if let Some(resp) = published.as_ref().and_then(|p| p.answer(&req)) {
                    return Ok(track(resp));
                }
                let (parts, body) = req.into_parts();
                let mut body = ClientBody::new(body, body_timeout, body_total);
                if receiving.reads_ahead(&body) {
                    let Some(place) = receiving.per_peer.take(peer.ip()) else {
                        tracing::debug!(reason = "peer_bodies", %peer, "request shed: its peer has max_bodies_per_peer bodies arriving");
                        return Ok(track(refused(limits::overloaded())));
                    };
                    let Ok(all) = Arc::clone(&receiving.all).try_acquire_owned() else {
                        tracing::debug!(reason = "bodies", %peer, "request shed: max_bodies bodies are arriving");
                        return Ok(track(refused(limits::overloaded())));
                    };
                    // A body that stalls is answered by whoever reads it
                    // (408 before anything is recorded or forwarded).
                    body.read_ahead(receiving.up_to).await;
                    drop((place, all));
                }
                let Some(slot) = admission.admit(peer.ip()).await else {
                    // Counted in idem_requests_shed_total; a warning per
                    // shed request would add work exactly when there is
                    // too much.
                    tracing::debug!(reason = "overloaded", %peer, "request shed: every in-flight slot is taken");
                    return Ok(track(refused(limits::overloaded())));
                };
                let body = if body_timeout.is_none() && body_total.is_none() && body.nothing_ahead()
                {
                    ProxyBody::Incoming(body.into_incoming())
                } else {
                    ProxyBody::Client(body)
                };
                let mut req = Request::from_parts(parts, body);
                req.extensions_mut().insert(PeerAddr(peer));
                req.extensions_mut().insert(slot.clone());
                let span = telemetry::request_span(req.method(), req.headers(), traces);
                let answer = gateway.oneshot(req).instrument(span.clone()).await;
                if let Ok(resp) = &answer {
                    telemetry::record_answer(&span, resp);
                }
                drop(slot);
                answer.map(track)
            }
        });
        let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), svc);
        let conn = graceful.watch(conn.into_owned());
        Box::pin(async move {
            if let Err(err) = conn.await {
                tracing::debug!(%err, %peer, "connection ended with an error");
            }
        })
    })
}

/// Why a request's `Host` makes it unsafe to route (RFC 9112 §3.2: an
/// HTTP/1.1 request carries exactly one, a host with an optional port),
/// or `None`. Two proxies in a row could otherwise each pick another one.
fn host_problem<B>(req: &Request<B>) -> Option<Problem> {
    let mut hosts = req.headers().get_all(http::header::HOST).iter();
    let bad = |why: &str| {
        Some(Problem::new(
            ProblemKind::HostInvalid,
            format!("{why}; nothing was forwarded"),
        ))
    };
    match (hosts.next(), hosts.next()) {
        (Some(_), Some(_)) => bad("the request has more than one Host header"),
        (Some(host), None) => {
            let text = host.as_bytes();
            let valid = !text.is_empty()
                && !text.contains(&b'@')
                && http::uri::Authority::try_from(text).is_ok();
            if valid {
                None
            } else {
                bad("the Host header is not a host[:port]")
            }
        }
        (None, _) if req.version() == http::Version::HTTP_11 => {
            bad("an HTTP/1.1 request must carry a Host header")
        }
        (None, _) => None,
    }
}

/// The HTTP/1 and HTTP/2 connection settings that enforce `[limits]` on
/// request heads.
fn connection_builder(limits: &LimitsSettings) -> auto::Builder<TokioExecutor> {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        // A client may shut its write side once its request is sent: it
        // still gets its answer (by default hyper closed the connection on
        // that EOF, unanswered, whenever the answer was not ready yet).
        .half_close(true)
        .header_read_timeout(Some(limits.header_read_timeout).filter(|t| !t.is_zero()))
        .max_headers(limits.max_headers)
        .max_buf_size(limits.max_header_bytes);
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX))
        // A peer that stops answering pings is gone: its connection closes.
        .keep_alive_interval(Some(HTTP2_PING_EVERY))
        .keep_alive_timeout(HTTP2_PING_EVERY);
    builder
}

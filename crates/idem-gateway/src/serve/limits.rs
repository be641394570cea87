//! What one gateway takes on at once, and how long it waits for a slow
//! client (`[limits]`).
//!
//! * Connections: past `max_connections` the gateway stops accepting; new
//!   connections wait in the kernel's listen backlog.
//! * Requests: past `max_in_flight` a request waits up to `queue_wait` for a
//!   slot, then is answered `503` + `Retry-After` (problem type
//!   `server-overloaded`) before anything is recorded or forwarded, so its
//!   retry starts clean. Work carried on for a client that went away still
//!   holds its slot until it ends.
//! * One peer (a client address) holds at most `max_connections_per_peer`
//!   connections (more are closed at once) and `max_in_flight_per_peer`
//!   requests (more are shed with `503` at once): by default half of each,
//!   so one address can never take every place from the others.
//! * Slow clients: the request head must arrive within
//!   `header_read_timeout` (hyper closes the connection otherwise, also an
//!   idle keep-alive one); the body may pause at most `body_read_timeout`
//!   between chunks (`408`, nothing recorded or forwarded).

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use idem_http::{BoxError, Problem, ProblemKind, ResponseBody};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError};
use tokio::time::Sleep;

/// Counter of requests answered `503` because the gateway was full.
pub const REQUESTS_SHED_TOTAL: &str = "idem_requests_shed_total";

/// Counter of connections closed at once because their peer held its
/// share already.
pub const CONNECTIONS_REFUSED_TOTAL: &str = "idem_connections_refused_total";

/// `[limits]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitsSettings {
    /// Client connections open at once.
    pub max_connections: usize,
    /// Requests handled at once.
    pub max_in_flight: usize,
    /// Connections one peer address may hold (0: no cap of its own).
    pub max_connections_per_peer: usize,
    /// Requests one peer address may have in flight (0: no cap of its own).
    pub max_in_flight_per_peer: usize,
    /// How long a request over `max_in_flight` waits for a slot before it
    /// is shed (zero: shed at once).
    pub queue_wait: Duration,
    /// Time allowed for a request head (also the idle keep-alive limit);
    /// zero: no limit (behind a proxy that enforces its own). Turning it
    /// off saved no measurable CPU (docs/BENCHMARKS.md, "What the limits
    /// cost").
    pub header_read_timeout: Duration,
    /// Longest pause allowed between chunks of a request body; zero: no
    /// limit.
    pub body_read_timeout: Duration,
    /// Longest time a request body may take in all, from its head on, so
    /// that a client dribbling a byte now and then cannot hold an
    /// in-flight slot for ever; zero: no limit.
    pub body_total_timeout: Duration,
    /// How long a connection may stay open with no request in flight
    /// (mostly for HTTP/2, whose pings keep a silent connection alive);
    /// zero: no limit.
    pub idle_timeout: Duration,
    /// Header fields allowed in a request head.
    pub max_headers: usize,
    /// Bytes allowed in a request head (start line and headers).
    pub max_header_bytes: usize,
}

impl Default for LimitsSettings {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            max_in_flight: 1024,
            max_connections_per_peer: 2048,
            max_in_flight_per_peer: 512,
            queue_wait: Duration::from_millis(100),
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(10),
            body_total_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
            max_headers: 100,
            max_header_bytes: 64 << 10,
        }
    }
}

/// Admission of requests: at most `max_in_flight` at once, and
/// `max_in_flight_per_peer` from one address.
#[derive(Debug, Clone)]
pub struct Admission {
    slots: Arc<Semaphore>,
    queue_wait: Duration,
    per_peer: Arc<PerPeer>,
}

/// Places held per peer address, for a per-peer cap.
///
/// A fixed table of counters (no lock, no allocation per request, bounded
/// whatever the number of addresses: an IPv6 client owns billions), each
/// address counted in the slot its keyed hash picks. Two addresses that
/// share a slot share its cap; with 65,536 slots and a per-process random
/// key, an address cannot aim at another's slot, and a given pair shares
/// one with a chance of 1 in 65,536.
#[derive(Debug)]
pub struct PerPeer {
    max: u32,
    key: u64,
    held: Box<[AtomicU32]>,
}

const PEER_SLOTS: usize = 1 << 16;

impl PerPeer {
    /// At most `max` places per address (0: no cap).
    pub fn new(max: usize) -> Arc<Self> {
        let slots = if max == 0 { 0 } else { PEER_SLOTS };
        Arc::new(Self {
            max: u32::try_from(max).unwrap_or(u32::MAX),
            // std's per-process random hash keys, as a seed.
            key: {
                use std::hash::{BuildHasher, Hasher};
                std::collections::hash_map::RandomState::new()
                    .build_hasher()
                    .finish()
            },
            held: (0..slots).map(|_| AtomicU32::new(0)).collect(),
        })
    }

    fn slot_of(&self, ip: IpAddr) -> usize {
        let bits: u128 = match ip {
            IpAddr::V4(v4) => u128::from(u32::from(v4)),
            // A client owns its whole /64: count the prefix.
            IpAddr::V6(v6) => u128::from(v6) >> 64,
        };
        // One multiply-xorshift round per half under the process's key.
        let mut h = self.key ^ (bits as u64) ^ ((bits >> 64) as u64).rotate_left(29);
        h = (h ^ (h >> 31)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h ^= h >> 29;
        (h as usize) & (PEER_SLOTS - 1)
    }

    /// A place for `ip`, or `None` when it holds its share already.
    pub fn take(self: &Arc<Self>, ip: IpAddr) -> Option<PeerPlace> {
        if self.max == 0 {
            return Some(PeerPlace(None));
        }
        let slot = self.slot_of(ip);
        self.held[slot]
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.max).then_some(n + 1)
            })
            .ok()?;
        Some(PeerPlace(Some((Arc::clone(self), slot))))
    }

    /// Places `ip` holds now (with any address sharing its slot).
    pub fn held(&self, ip: IpAddr) -> usize {
        if self.max == 0 {
            return 0;
        }
        self.held[self.slot_of(ip)].load(Ordering::Acquire) as usize
    }
}

/// One place of a peer, given back when dropped.
#[derive(Debug)]
pub struct PeerPlace(Option<(Arc<PerPeer>, usize)>);

impl PeerPlace {
    /// A place under no cap.
    pub fn uncapped() -> Self {
        Self(None)
    }
}

impl Drop for PeerPlace {
    fn drop(&mut self) {
        if let Some((of, slot)) = self.0.take() {
            of.held[slot].fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// A client connection's place: among all connections, and among its
/// peer's.
#[derive(Debug)]
pub struct ConnectionPlace {
    _all: OwnedSemaphorePermit,
    _peer: PeerPlace,
}

impl ConnectionPlace {
    /// Holds both until dropped.
    pub fn new(all: OwnedSemaphorePermit, peer: PeerPlace) -> Self {
        Self {
            _all: all,
            _peer: peer,
        }
    }
}

/// One request's place among those in flight, released when the last
/// clone drops. The server holds one until the answer is ready and puts a
/// clone in the request's extensions, which the proxy moves to the
/// response: work the idempotency layer finishes after its client left
/// (reading and recording the answer) keeps the slot until it is done.
#[derive(Debug, Clone)]
pub struct Slot(#[allow(dead_code)] Arc<(OwnedSemaphorePermit, PeerPlace)>);

impl Admission {
    /// Room for `max_in_flight` requests, `per_peer` of them from one
    /// address (0: no cap of its own); a request waits up to `queue_wait`
    /// for room.
    pub fn new(max_in_flight: usize, per_peer: usize, queue_wait: Duration) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(max_in_flight)),
            queue_wait,
            per_peer: PerPeer::new(per_peer),
        }
    }

    /// A slot, or `None` when none came free within the queue wait (or
    /// `peer` holds its share: then at once, so that one address cannot
    /// queue in front of the others).
    pub async fn admit(&self, peer: IpAddr) -> Option<Slot> {
        let place = self.per_peer.take(peer)?;
        let permit = match Arc::clone(&self.slots).try_acquire_owned() {
            Ok(permit) => permit,
            Err(TryAcquireError::Closed) => return None,
            Err(TryAcquireError::NoPermits) if self.queue_wait.is_zero() => return None,
            Err(TryAcquireError::NoPermits) => {
                tokio::time::timeout(self.queue_wait, Arc::clone(&self.slots).acquire_owned())
                    .await
                    .ok()?
                    .ok()?
            }
        };
        Some(Slot(Arc::new((permit, place))))
    }
}

/// The answer to a request shed for want of a slot: `503`, problem type
/// `server-overloaded`, `Retry-After: 1`.
pub fn overloaded<B>() -> Response<ResponseBody<B>> {
    metrics::counter!(REQUESTS_SHED_TOTAL).increment(1);
    ResponseBody::problem(
        &Problem::new(
            ProblemKind::Overloaded,
            "the gateway is handling as many requests as it may; nothing was recorded or forwarded, retry after the hint",
        )
        .with_retry_after(Duration::from_secs(1)),
    )
}

/// A request body from a client connection that fails with an
/// [`std::io::ErrorKind::TimedOut`] error when the client pauses longer
/// than the allowed time between chunks, or takes longer than the allowed
/// time in all. The timers exist only while the body is waiting: a body
/// that arrives with its head costs nothing.
#[derive(Debug)]
pub struct ClientBody {
    body: Incoming,
    idle: Option<Duration>,
    timer: Option<Pin<Box<Sleep>>>,
    /// When the whole body must be in (`None`: no limit).
    until: Option<tokio::time::Instant>,
    total: Option<Pin<Box<Sleep>>>,
}

impl ClientBody {
    /// Wraps `body`, allowing pauses of at most `idle` and `total` in all
    /// from now (`None`: no such limit).
    pub fn new(body: Incoming, idle: Option<Duration>, total: Option<Duration>) -> Self {
        Self {
            body,
            idle,
            timer: None,
            until: total.map(|t| tokio::time::Instant::now() + t),
            total: None,
        }
    }
}

impl Body for ClientBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Poll::Ready(frame) = Pin::new(&mut this.body).poll_frame(cx) {
            this.timer = None;
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        if let Some(until) = this.until {
            let total = this
                .total
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(until)));
            if total.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Some(Err(Box::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the request body took longer than body_total_timeout in all",
                )))));
            }
        }
        let Some(idle) = this.idle else {
            return Poll::Pending;
        };
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
        ready!(timer.as_mut().poll(cx));
        this.timer = None;
        Poll::Ready(Some(Err(Box::new(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no request body data from the client for {idle:?}"),
        )))))
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::ProxyBody;

    #[tokio::test]
    async fn a_full_gateway_sheds_after_the_queue_wait_and_admits_again() {
        let adm = Admission::new(2, 0, Duration::from_millis(20));
        let a = adm.admit(LOCAL).await.expect("first slot");
        let b = adm.admit(LOCAL).await.expect("second slot");
        assert_eq!(adm.slots.available_permits(), 0, "both slots in flight");
        assert!(adm.admit(LOCAL).await.is_none(), "third request is shed");
        // A clone (the one riding with the request) keeps the slot.
        let a2 = a.clone();
        drop(a);
        assert!(adm.admit(LOCAL).await.is_none(), "the clone still holds it");
        drop(a2);
        let c = adm.admit(LOCAL).await.expect("a slot came free");
        drop((b, c));
        assert_eq!(adm.slots.available_permits(), 2, "none in flight");
    }

    #[tokio::test]
    async fn a_waiting_request_gets_a_slot_freed_within_the_wait() {
        let adm = Admission::new(1, 0, Duration::from_secs(5));
        let held = adm.admit(LOCAL).await.expect("slot");
        let waiter = tokio::spawn({
            let adm = adm.clone();
            async move { adm.admit(LOCAL).await.is_some() }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(held);
        assert!(waiter.await.expect("join"), "admitted once the slot freed");
    }

    #[tokio::test]
    async fn zero_queue_wait_sheds_at_once() {
        let adm = Admission::new(1, 0, Duration::ZERO);
        let _held = adm.admit(LOCAL).await.expect("slot");
        assert!(adm.admit(LOCAL).await.is_none());
    }

    const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    #[tokio::test]
    async fn one_peer_gets_its_share_and_the_others_keep_theirs() {
        let adm = Admission::new(4, 2, Duration::from_secs(5));
        let other: IpAddr = "10.0.0.2".parse().expect("ip");
        let (a, b) = (adm.admit(LOCAL).await, adm.admit(LOCAL).await);
        assert!(a.is_some() && b.is_some());
        // Its third is shed at once (no queueing in front of the others),
        // while another address still gets in.
        let started = std::time::Instant::now();
        assert!(adm.admit(LOCAL).await.is_none());
        assert!(started.elapsed() < Duration::from_secs(1));
        let c = adm.admit(other).await.expect("another peer");
        assert_eq!(adm.per_peer.held(LOCAL), 2);
        drop(a);
        assert_eq!(adm.per_peer.held(LOCAL), 1);
        assert!(adm.admit(LOCAL).await.is_some());
        drop((b, c));
        assert_eq!(adm.per_peer.held(other), 0);
        assert_eq!(adm.per_peer.held(LOCAL), 0);
        // An IPv6 client owns its /64: its addresses share one share.
        let peers = PerPeer::new(1);
        let one: IpAddr = "2001:db8:1:2::1".parse().expect("ip");
        let same_net: IpAddr = "2001:db8:1:2:ffff::9".parse().expect("ip");
        let _held = peers.take(one).expect("first");
        assert!(peers.take(same_net).is_none(), "the same /64");
        let elsewhere: IpAddr = "2001:db8:1:3::1".parse().expect("ip");
        assert!(peers.take(elsewhere).is_some(), "another /64");
        // No cap: nothing counted.
        assert!(PerPeer::new(0).take(one).is_some());
    }

    #[test]
    fn the_shed_answer_is_a_503_with_a_retry_hint() {
        let resp = overloaded::<ProxyBody>();
        assert_eq!(resp.status(), 503);
        assert_eq!(resp.headers()["retry-after"], "1");
        assert_eq!(resp.headers()["content-type"], idem_http::PROBLEM_JSON);
    }
}

/// A client connection's read deadlines.
///
/// * Its first bytes: before hyper knows the protocol (HTTP/1 or the
///   HTTP/2 preface) no header time-out of its own runs, so a socket that
///   sends nothing would hold its place under `max_connections` for ever.
/// * Idleness ([`with_idle`](Self::with_idle)): a connection with no
///   request in flight for `idle_timeout` is closed. HTTP/1 keep-alive
///   connections are closed sooner by `header_read_timeout`; an HTTP/2
///   connection answering the gateway's pings, but sending nothing else,
///   would otherwise stay open for ever.
#[derive(Debug)]
pub struct Deadlines<S> {
    inner: S,
    /// Until the first bytes arrive.
    deadline: Option<Pin<Box<Sleep>>>,
    idle: Option<Idle>,
}

#[derive(Debug)]
struct Idle {
    activity: Arc<Activity>,
    after: Duration,
    timer: Pin<Box<Sleep>>,
    /// Whether the timer holds the connection task's waker: then it is
    /// polled again only once it has fired (polling it on every read
    /// would re-register the waker each time: measurable on
    /// pass-through).
    armed: bool,
}

/// What a connection is doing: requests in flight (until their answer's
/// body is done), and when the last one ended.
#[derive(Debug)]
pub struct Activity {
    in_flight: AtomicUsize,
    /// When the last request ended, in milliseconds since `opened`.
    last_end: AtomicU64,
    opened: tokio::time::Instant,
}

impl Activity {
    /// A connection with nothing in flight since now.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            in_flight: AtomicUsize::new(0),
            last_end: AtomicU64::new(0),
            opened: tokio::time::Instant::now(),
        })
    }

    /// A request starts; it is in flight until the guard is dropped (put
    /// it in the answer's body).
    pub fn start(self: &Arc<Self>) -> Busy {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        Busy(Arc::clone(self))
    }

    /// When the connection counts as idle from, or `None` while busy.
    fn idle_since(&self) -> Option<tokio::time::Instant> {
        let last = self.opened + Duration::from_millis(self.last_end.load(Ordering::Acquire));
        (self.in_flight.load(Ordering::Acquire) == 0).then_some(last)
    }
}

/// One request in flight on a connection (see [`Activity::start`]).
#[derive(Debug)]
pub struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        let since = self.0.opened.elapsed().as_millis();
        self.0
            .last_end
            .store(u64::try_from(since).unwrap_or(u64::MAX), Ordering::Release);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An answer's body that keeps its request [`Busy`] until it is done.
#[derive(Debug)]
pub struct Tracked<B> {
    inner: B,
    _busy: Option<Busy>,
}

impl<B> Tracked<B> {
    /// `inner`, busy until dropped.
    pub fn new(inner: B, busy: Option<Busy>) -> Self {
        Self { inner, _busy: busy }
    }
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<S> Deadlines<S> {
    /// `inner`, closed with a time-out error if nothing is read from it
    /// within `within` (`None`: no deadline).
    pub fn new(inner: S, within: Option<Duration>) -> Self {
        Self {
            inner,
            deadline: within.map(|d| Box::pin(tokio::time::sleep(d))),
            idle: None,
        }
    }

    /// A client connection's deadlines: its first bytes within
    /// `first_bytes`, and, with `idle`, closed once nothing has been in
    /// flight that long; with it, the [`Activity`] to mark its requests on.
    pub fn for_connection(
        inner: S,
        first_bytes: Option<Duration>,
        idle: Option<Duration>,
    ) -> (Self, Option<Arc<Activity>>) {
        let stream = Self::new(inner, first_bytes);
        match idle {
            Some(after) => {
                let activity = Activity::new();
                (
                    stream.with_idle(Arc::clone(&activity), after),
                    Some(activity),
                )
            }
            None => (stream, None),
        }
    }

    /// Also closed once `activity` has had nothing in flight for `after`.
    pub fn with_idle(mut self, activity: Arc<Activity>, after: Duration) -> Self {
        self.idle = Some(Idle {
            activity,
            after,
            timer: Box::pin(tokio::time::sleep(after)),
            armed: false,
        });
        self
    }
}

impl Idle {
    /// Whether the connection has been idle for long enough; otherwise
    /// arms the timer for when it could be, so that the task is woken.
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        if self.armed && !self.timer.is_elapsed() {
            return false;
        }
        // The connection stays in the task that first polled it, so the
        // waker registered then is the one to wake.
        self.armed = true;
        while self.timer.as_mut().poll(cx).is_ready() {
            let now = tokio::time::Instant::now();
            match self.activity.idle_since() {
                Some(since) if now >= since + self.after => return true,
                Some(since) => self.timer.as_mut().reset(since + self.after),
                None => self.timer.as_mut().reset(now + self.after),
            }
        }
        false
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Deadlines<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                this.deadline = None;
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                let expired = this
                    .deadline
                    .as_mut()
                    .is_some_and(|deadline| deadline.as_mut().poll(cx).is_ready());
                if expired {
                    return Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the client sent nothing within header_read_timeout",
                    )));
                }
                if this.idle.as_mut().is_some_and(|idle| idle.expired(cx)) {
                    return Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "no request on the connection within idle_timeout",
                    )));
                }
                Poll::Pending
            }
            other => other,
        }
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Deadlines<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

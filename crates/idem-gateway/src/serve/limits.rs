//! What one gateway takes on at once, and how long it waits for a slow
//! client (`[limits]`).
//!
//! * Connections: past `max_connections` the gateway stops accepting; new
//!   connections wait in the kernel's listen backlog.
//! * Requests: past `max_in_flight` a request waits up to `queue_wait` for a
//!   slot, then is answered `503` + `Retry-After` (problem type
//!   `server-overloaded`) before anything is recorded or forwarded, so its
//!   retry starts clean. A request takes its slot once its body is in
//!   (bodies up to the largest `max_request_body`; a longer one after its
//!   first bytes), so a client dribbling a body holds no slot. Work
//!   carried on for a client that went away still holds its slot until it
//!   ends, and so does an answer waiting for its client, until
//!   `idle_timeout` closes the connection.
//! * One peer (a client address) holds at most `max_connections_per_peer`
//!   connections (more are closed at once) and `max_in_flight_per_peer`
//!   requests (more are shed with `503` at once): by default half of each,
//!   so one address can never take every place from the others; and
//!   `max_bodies_per_peer` bodies arriving at once (by default its share
//!   of requests; more are shed with `503` at once). An address is compared
//!   in its canonical form: an IPv4 client of a dual-stack listener is
//!   `a.b.c.d`, not `::ffff:a.b.c.d`; an IPv6 client by its /64.
//! * Slow clients: the request head must arrive within
//!   `header_read_timeout` (hyper closes the connection otherwise, also an
//!   idle keep-alive one); the body may pause at most `body_read_timeout`
//!   between chunks, and take at most `body_total_timeout` in all (`408`,
//!   nothing recorded or forwarded).
//! * Clients that do not read: a connection whose answers have all waited
//!   for the client for `idle_timeout` (or whose socket took no byte of a
//!   write for that long) is closed, counted in
//!   `idem_connections_stalled_total`.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use http::Response;
use idem_http::{Problem, ProblemKind, ResponseBody};

use idem::metrics::REQUESTS_SHED_TOTAL;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError};

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
    metrics::counter!(REQUESTS_SHED_TOTAL.name).increment(1);
    ResponseBody::problem(
        &Problem::new(
            ProblemKind::Overloaded,
            "the gateway is handling as many requests as it may; nothing was recorded or forwarded, retry after the hint",
        )
        .with_retry_after(Duration::from_secs(1)),
    )
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

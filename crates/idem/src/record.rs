//! The record: one logical operation, its state, its lease and its answer.
//!
//! ```text
//!            reserve                    complete
//!  (none) ───────────► processing ─────────────────► completed  (replayed)
//!    ▲                   │   │        fail
//!    └──── release ──────┘   └─────────────────────► failed     (replayed)
//! ```
//!
//! A `processing` record whose side effect may have happened is marked with
//! [`OUTCOME_UNKNOWN`] and stays `processing` until it is reconciled or its
//! lease expires and the policy allows a new attempt.

use std::fmt;
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use crate::{Fingerprint, IdempotencyKey, Scope};

/// The `error_code` of a record whose side effect may or may not have
/// happened (a timeout after sending, a result that could not be recorded).
pub const OUTCOME_UNKNOWN: &str = "outcome_unknown";

/// A point in time as milliseconds since the Unix epoch, read from the
/// store's one clock (the database's, Redis', or the embedded store's
/// process clock) — never compared across clocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Timestamp(i64);

impl Timestamp {
    /// From milliseconds since the Unix epoch.
    pub const fn from_millis(millis: i64) -> Self {
        Self(millis)
    }

    /// Milliseconds since the Unix epoch.
    pub const fn as_millis(self) -> i64 {
        self.0
    }

    /// The current time of this process' store clock: the wall clock as
    /// read once, at first use, advanced by the monotonic clock since.
    ///
    /// Stores that keep time themselves (the embedded store, the in-memory
    /// store and cache) take their leases and expiry from it. A step of the
    /// wall clock while the process runs (an operator, a bad NTP server, a
    /// resumed VM) then moves neither: a jump ahead does not hand live work
    /// to a retry nor expire answers early, a jump back holds nothing
    /// longer. [`Timestamp::wall_clock_offset`] tells how far the wall
    /// clock has moved away; a restart takes the wall clock's time again.
    pub fn now() -> Self {
        let (wall, since) = anchor();
        let elapsed = i64::try_from(since.elapsed().as_millis()).unwrap_or(i64::MAX);
        Self(wall.0.saturating_add(elapsed))
    }

    /// How far the wall clock is ahead of [`Timestamp::now`] (negative:
    /// behind): zero, give or take a millisecond, unless the wall clock was
    /// stepped since the process first read it.
    pub fn wall_clock_offset() -> i64 {
        wall_clock().0.saturating_sub(Self::now().0)
    }

    /// This instant moved forward by `d`, saturating.
    pub fn plus(self, d: Duration) -> Self {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Self(self.0.saturating_add(ms))
    }

    /// This instant moved back by `d`, saturating.
    pub fn minus(self, d: Duration) -> Self {
        let ms = i64::try_from(d.as_millis()).unwrap_or(i64::MAX);
        Self(self.0.saturating_sub(ms))
    }

    /// How long from `earlier` to `self`; zero if `earlier` is later.
    pub fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(u64::try_from(self.0.saturating_sub(earlier.0)).unwrap_or(0))
    }
}

/// The wall clock now.
fn wall_clock() -> Timestamp {
    let since = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or(Duration::ZERO);
    Timestamp(i64::try_from(since.as_millis()).unwrap_or(i64::MAX))
}

/// The wall clock's time when the process first asked, and the monotonic
/// instant it was read at.
fn anchor() -> (Timestamp, Instant) {
    static ANCHOR: OnceLock<(Timestamp, Instant)> = OnceLock::new();
    *ANCHOR.get_or_init(|| (wall_clock(), Instant::now()))
}

/// Where a record is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RecordState {
    /// An attempt holds (or held) the lease; no final answer yet.
    Processing,
    /// Done; the stored response is replayed.
    Completed,
    /// Deterministically failed (a 4xx, a decline); the stored response is replayed.
    Failed,
}

impl RecordState {
    /// The name used in storage, URLs and metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Processing => "processing",
            Self::Completed => "completed",
            Self::Failed => "failed",
        }
    }

    /// Whether the record holds a final, replayable answer.
    pub const fn is_final(self) -> bool {
        !matches!(self, Self::Processing)
    }
}

impl fmt::Display for RecordState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a string does not name a [`RecordState`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown record state {0:?}; expected processing, completed or failed")]
pub struct UnknownState(pub String);

impl std::str::FromStr for RecordState {
    type Err = UnknownState;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "processing" => Ok(Self::Processing),
            "completed" => Ok(Self::Completed),
            "failed" => Ok(Self::Failed),
            other => Err(UnknownState(other.to_owned())),
        }
    }
}

/// A random token naming one owner of a lease. Together with the attempt
/// number it fences stale owners out.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct OwnerToken(u128);

impl OwnerToken {
    /// A fresh token: never repeated by this process, and unguessable
    /// across processes.
    ///
    /// One random 128-bit seed per process (from the OS) is combined with a
    /// counter through a bijective mixer, so tokens of one process are all
    /// distinct and tokens of two processes collide with negligible
    /// probability — without a system call per reservation (which the
    /// profile of the gateway showed on every request).
    pub fn random() -> Self {
        static SEED: std::sync::OnceLock<u128> = std::sync::OnceLock::new();
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let seed = *SEED.get_or_init(|| uuid::Uuid::new_v4().as_u128());
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // Both halves change with every token (callers may use a prefix
        // of its text as a short unique name); the high half alone is
        // already distinct for every counter value.
        let hi = splitmix64(n);
        let lo = splitmix64(n ^ 0x5851_f42d_4c95_7f2d);
        Self(seed ^ (u128::from(hi) << 64 | u128::from(lo)))
    }

    /// From its 128-bit value (as read back from storage).
    pub const fn from_u128(v: u128) -> Self {
        Self(v)
    }

    /// The 128-bit value.
    pub const fn as_u128(self) -> u128 {
        self.0
    }

    /// 16 big-endian bytes, for binary columns.
    pub const fn to_bytes(self) -> [u8; 16] {
        self.0.to_be_bytes()
    }

    /// From 16 big-endian bytes.
    pub const fn from_bytes(b: [u8; 16]) -> Self {
        Self(u128::from_be_bytes(b))
    }
}

/// SplitMix64's finaliser: a bijection on `u64` that scatters a counter's
/// bits.
const fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl fmt::Display for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}

impl fmt::Debug for OwnerToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OwnerToken({self})")
    }
}

/// A record's lease: who may resolve it, which attempt this is, and until
/// when other attempts must wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// The owner of the current attempt.
    pub owner: OwnerToken,
    /// Attempt number, starting at 1 and raised on every takeover.
    pub attempt: u32,
    /// Until when the current attempt holds the record.
    pub locked_until: Timestamp,
}

/// The answer to replay: for HTTP a status, chosen headers and the body;
/// other callers use the status as their own result code and the body as
/// their serialised result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// Status code (HTTP status, or a caller-defined code).
    pub status: u16,
    /// Headers to replay, in order, names lowercase.
    pub headers: Vec<(String, Bytes)>,
    /// The body.
    pub body: Bytes,
}

/// Why stored header bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("stored response headers are corrupt: {0}")]
pub struct HeaderDecodeError(&'static str);

impl StoredResponse {
    /// A response with no headers.
    pub fn new(status: u16, body: impl Into<Bytes>) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: body.into(),
        }
    }

    /// Adds a header (builder style).
    pub fn with_header(mut self, name: &str, value: impl Into<Bytes>) -> Self {
        self.headers.push((name.to_ascii_lowercase(), value.into()));
        self
    }

    /// Encodes the headers into the one compact binary form every store
    /// keeps: for each header a `u16` name length, the name, a `u32` value
    /// length and the value, all big-endian.
    pub fn encode_headers(&self) -> Vec<u8> {
        let size: usize = self
            .headers
            .iter()
            .map(|(n, v)| 6 + n.len() + v.len())
            .sum();
        let mut out = Vec::with_capacity(size);
        for (name, value) in &self.headers {
            let name_len = u16::try_from(name.len()).unwrap_or(u16::MAX);
            let value_len = u32::try_from(value.len()).unwrap_or(u32::MAX);
            out.extend_from_slice(&name_len.to_be_bytes());
            out.extend_from_slice(&name.as_bytes()[..usize::from(name_len)]);
            out.extend_from_slice(&value_len.to_be_bytes());
            out.extend_from_slice(&value[..value_len as usize]);
        }
        out
    }

    /// Decodes headers written by [`encode_headers`](Self::encode_headers).
    pub fn decode_headers(mut raw: &[u8]) -> Result<Vec<(String, Bytes)>, HeaderDecodeError> {
        fn take<'a>(raw: &mut &'a [u8], n: usize) -> Result<&'a [u8], HeaderDecodeError> {
            if raw.len() < n {
                return Err(HeaderDecodeError("truncated"));
            }
            let (head, tail) = raw.split_at(n);
            *raw = tail;
            Ok(head)
        }
        let mut headers = Vec::new();
        while !raw.is_empty() {
            let len = take(&mut raw, 2)?;
            let name_len = usize::from(u16::from_be_bytes([len[0], len[1]]));
            let name = std::str::from_utf8(take(&mut raw, name_len)?)
                .map_err(|_| HeaderDecodeError("header name is not UTF-8"))?
                .to_owned();
            let len = take(&mut raw, 4)?;
            let value_len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
            let value = Bytes::copy_from_slice(take(&mut raw, value_len)?);
            headers.push((name, value));
        }
        Ok(headers)
    }
}

/// One logical operation, identified by `(scope.tenant, scope.operation, key)`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Tenant and operation.
    pub scope: Scope,
    /// The client's key.
    pub key: IdempotencyKey,
    /// Fingerprint of the request that created the record.
    pub fingerprint: Fingerprint,
    /// Where the record is in its life.
    pub state: RecordState,
    /// When the record was first reserved.
    pub created_at: Timestamp,
    /// When the record last changed.
    pub updated_at: Timestamp,
    /// When a final record may be purged. Processing records are never
    /// purged, whatever this says.
    pub expires_at: Timestamp,
    /// The current (or last) attempt's lease.
    pub lease: Lease,
    /// The stored answer, for final records.
    pub response: Option<StoredResponse>,
    /// An identifier of what the operation created (a payment id…), if told.
    pub resource_id: Option<String>,
    /// A machine-readable reason: [`OUTCOME_UNKNOWN`], a decline code…
    pub error_code: Option<String>,
}

impl Record {
    /// Whether this record's side effect may have happened without a
    /// recorded answer.
    pub fn is_outcome_unknown(&self) -> bool {
        self.state == RecordState::Processing && self.error_code.as_deref() == Some(OUTCOME_UNKNOWN)
    }

    /// Whether a final record has passed its retention at `now`.
    pub fn is_expired(&self, now: Timestamp) -> bool {
        self.state.is_final() && self.expires_at <= now
    }

    /// Whether the current attempt's lease is still live at `now`.
    pub fn lease_live(&self, now: Timestamp) -> bool {
        self.lease.locked_until > now
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_tokens_are_distinct_across_threads() {
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    (0..10_000)
                        .map(|_| OwnerToken::random())
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut all = std::collections::HashSet::new();
        for t in threads {
            for token in t.join().expect("thread") {
                assert!(all.insert(token), "{token} repeated");
            }
        }
        // Consecutive tokens differ in many bits, in both halves: a prefix
        // of the text is a usable short name too.
        let (a, b) = (OwnerToken::random().0, OwnerToken::random().0);
        assert!((a ^ b).count_ones() > 16, "{a:032x} {b:032x}");
        assert!(((a ^ b) >> 64).count_ones() > 8, "{a:032x} {b:032x}");
        let prefixes: std::collections::HashSet<String> = (0..1000)
            .map(|_| OwnerToken::random().to_string()[..10].to_owned())
            .collect();
        assert_eq!(prefixes.len(), 1000, "10-digit prefixes repeat");
    }

    #[test]
    fn headers_round_trip() {
        let resp = StoredResponse::new(201, "body")
            .with_header("Content-Type", "application/json")
            .with_header("location", "/v1/payments/1")
            .with_header("x-bin", Bytes::from_static(&[0, 255, 10]));
        let raw = resp.encode_headers();
        assert_eq!(StoredResponse::decode_headers(&raw), Ok(resp.headers));
        assert_eq!(StoredResponse::decode_headers(&[]), Ok(vec![]));
    }

    #[test]
    fn corrupt_headers_are_an_error_not_a_panic() {
        let raw = StoredResponse::new(200, "")
            .with_header("a", "b")
            .encode_headers();
        for cut in 1..raw.len() {
            assert!(
                StoredResponse::decode_headers(&raw[..cut]).is_err(),
                "cut {cut}"
            );
        }
        assert!(StoredResponse::decode_headers(&[0, 1, 0xff, 0, 0, 0, 0]).is_err());
    }

    #[test]
    fn timestamps() {
        let t = Timestamp::from_millis(1_000);
        assert_eq!(t.plus(Duration::from_millis(500)).as_millis(), 1_500);
        assert_eq!(t.minus(Duration::from_secs(2)).as_millis(), -1_000);
        assert_eq!(
            t.since(Timestamp::from_millis(400)),
            Duration::from_millis(600)
        );
        assert_eq!(Timestamp::from_millis(0).since(t), Duration::ZERO);
        assert!(Timestamp::now().as_millis() > 1_600_000_000_000);
    }

    #[test]
    fn the_store_clock_runs_with_the_monotonic_clock_from_the_wall_clock() {
        let a = Timestamp::now();
        std::thread::sleep(Duration::from_millis(20));
        let b = Timestamp::now();
        assert!(b.since(a) >= Duration::from_millis(20), "{a:?} {b:?}");
        // Nobody stepped this machine's clock during the test.
        assert!(Timestamp::wall_clock_offset().abs() < 1_000);
    }

    #[test]
    fn state_names_round_trip() {
        for s in [
            RecordState::Processing,
            RecordState::Completed,
            RecordState::Failed,
        ] {
            assert_eq!(s.as_str().parse::<RecordState>(), Ok(s));
        }
        assert!("done".parse::<RecordState>().is_err());
    }

    #[test]
    fn owner_tokens_are_distinct_and_round_trip() {
        let a = OwnerToken::random();
        assert_ne!(a, OwnerToken::random());
        assert_eq!(OwnerToken::from_bytes(a.to_bytes()), a);
        assert_eq!(a.to_string().len(), 32);
    }
}

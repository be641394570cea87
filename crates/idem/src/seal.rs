//! Stored response bodies encrypted at rest (feature `seal`).
//!
//! [`Sealed`] wraps any store: every response body it records is sealed
//! with AES-256-GCM under the current key of a [`SealKeys`] ring, and opened
//! again when the record is read. The whole stored answer is bound to its
//! record: the associated data (authenticated, not encrypted) are the
//! record's tenant, operation, key and fingerprint, its state, and the
//! answer's status, replayed headers, resource id and error code. A sealed
//! body copied onto another record, or a status, header or fingerprint
//! changed in the store, does not open: the record is refused as corrupt
//! (never replayed, never run again). Status, headers, fingerprints and
//! keys stay readable: they are what the store matches on.
//!
//! [`Sealed::with_require_sealed`] also refuses a final record whose body
//! is not sealed at all (one written into the store by someone else, or
//! stored before sealing was on). Bodies sealed by earlier versions
//! (bound to tenant, operation and key only) still open.
//!
//! Keys are named (`id:64 hex digits`), and a sealed body names the key
//! that sealed it, so keys rotate without rewriting records: put the new
//! key first (it seals from then on), keep the old ones after it (they
//! still open what they sealed) until the longest retention has passed,
//! then drop them. A body stored before sealing was turned on (no seal
//! header) is read as it is.
//!
//! ```
//! # #[cfg(feature = "seal")] {
//! use idem::seal::SealKeys;
//! let keys = SealKeys::parse(
//!     "k2:000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f,\
//!      k1:1f1e1d1c1b1a191817161514131211100f0e0d0c0b0a09080706050403020100",
//! )
//! .expect("two keys");
//! assert_eq!(keys.current_id(), "k2");
//! # }
//! ```

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use ring::aead::{AES_256_GCM, Aad, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};
use ring::rand::{SecureRandom, SystemRandom};

use crate::{
    FinalOutcome, Fingerprint, IdempotencyKey, Lease, ListFilter, ListRecords, Page, Purge, Record,
    RecordState, Reservation, ReserveRequest, Scope, Store, StoreError, StoredResponse, Timestamp,
};

/// The first bytes of a sealed body (a body an application returns never
/// starts with a NUL and this tag by accident in practice; one that does is
/// refused at sealing time rather than misread later).
const MAGIC: &[u8] = b"\0idem-seal1\0";
/// The first bytes of a body sealed with its whole answer bound to the
/// record (this version); [`MAGIC`] marks the earlier, body-only form.
const MAGIC2: &[u8] = b"\0idem-seal2\0";

/// What a sealed answer is bound to: the record and the rest of its answer.
#[derive(Debug, Clone, Copy)]
pub struct Binding<'a> {
    /// The record's tenant and operation.
    pub scope: &'a Scope,
    /// The record's key.
    pub key: &'a IdempotencyKey,
    /// The record's fingerprint.
    pub fingerprint: &'a Fingerprint,
    /// Completed or failed.
    pub state: RecordState,
    /// The answer's status.
    pub status: u16,
    /// The answer's replayed headers.
    pub headers: &'a [(String, Bytes)],
    /// What the operation created, if said.
    pub resource_id: Option<&'a str>,
    /// The record's machine-readable reason, if any.
    pub error_code: Option<&'a str>,
}

impl<'a> Binding<'a> {
    /// The associated data: each part length-prefixed, so that no part
    /// can slide into the next.
    fn associated(&self) -> Vec<u8> {
        let mut aad = Vec::with_capacity(256);
        let mut part = |bytes: &[u8]| {
            aad.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
            aad.extend_from_slice(bytes);
        };
        part(self.scope.tenant().as_bytes());
        part(self.scope.operation().as_bytes());
        part(self.key.as_str().as_bytes());
        part(self.fingerprint.digest());
        part(self.state.as_str().as_bytes());
        part(&self.status.to_be_bytes());
        part(&(self.headers.len() as u64).to_be_bytes());
        for (name, value) in self.headers {
            part(name.as_bytes());
            part(value);
        }
        part(self.resource_id.unwrap_or("\0none").as_bytes());
        part(self.error_code.unwrap_or("\0none").as_bytes());
        aad
    }

    fn of(record: &'a Record) -> Option<(Binding<'a>, &'a StoredResponse)> {
        let response = record.response.as_ref()?;
        Some((
            Binding {
                scope: &record.scope,
                key: &record.key,
                fingerprint: &record.fingerprint,
                state: record.state,
                status: response.status,
                headers: &response.headers,
                resource_id: record.resource_id.as_deref(),
                error_code: record.error_code.as_deref(),
            },
            response,
        ))
    }
}

/// Why a key ring could not be built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("encryption keys: {0}")]
pub struct SealKeyError(String);

/// Named AES-256 keys: the first seals, every one opens what it sealed.
pub struct SealKeys {
    keys: Vec<(String, LessSafeKey)>,
    rng: SystemRandom,
}

impl fmt::Debug for SealKeys {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Names only: key material never reaches a log.
        let ids: Vec<&str> = self.keys.iter().map(|(id, _)| id.as_str()).collect();
        f.debug_struct("SealKeys").field("ids", &ids).finish()
    }
}

impl SealKeys {
    /// Parses `id:hex[,id:hex…]` (commas, whitespace or new lines between
    /// keys; `#` starts a comment line). Each key is 32 bytes as 64 hex
    /// digits (`openssl rand -hex 32`); ids are 1 to 32 letters, digits,
    /// `-`, `_` or `.`, and unique. The first key seals.
    pub fn parse(spec: &str) -> Result<Self, SealKeyError> {
        let mut keys: Vec<(String, LessSafeKey)> = Vec::new();
        let entries = spec
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .flat_map(|l| l.split([',', ' ', '\t']))
            .map(str::trim)
            .filter(|e| !e.is_empty());
        for (i, entry) in entries.enumerate() {
            let (id, hex) = entry
                .split_once(':')
                .ok_or_else(|| SealKeyError(format!("entry {} is not id:hex", i + 1)))?;
            let id_ok = (1..=32).contains(&id.len())
                && id
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b));
            if !id_ok {
                return Err(SealKeyError(format!(
                    "key id {id:?}: 1 to 32 letters, digits, '-', '_' or '.'"
                )));
            }
            if keys.iter().any(|(k, _)| k == id) {
                return Err(SealKeyError(format!("key id {id:?} appears twice")));
            }
            let bytes = crate::hex::hex32(hex).ok_or_else(|| {
                SealKeyError(format!("key {id:?}: must be 64 hex digits (32 bytes)"))
            })?;
            let key = UnboundKey::new(&AES_256_GCM, &bytes)
                .map_err(|_| SealKeyError(format!("key {id:?}: not an AES-256 key")))?;
            keys.push((id.to_owned(), LessSafeKey::new(key)));
        }
        if keys.is_empty() {
            return Err(SealKeyError("no key given".to_owned()));
        }
        Ok(Self {
            keys,
            rng: SystemRandom::new(),
        })
    }

    /// The id of the key that seals.
    pub fn current_id(&self) -> &str {
        &self.keys[0].0
    }

    /// Seals `body`, bound to its record and answer.
    pub fn seal(&self, binding: &Binding<'_>, body: &[u8]) -> Result<Bytes, StoreError> {
        self.seal_with(MAGIC2, binding.associated(), body)
    }

    fn seal_with(&self, magic: &[u8], aad: Vec<u8>, body: &[u8]) -> Result<Bytes, StoreError> {
        let (id, aead) = &self.keys[0];
        let mut nonce = [0u8; NONCE_LEN];
        self.rng
            .fill(&mut nonce)
            .map_err(|_| StoreError::Backend("no randomness for a nonce".into()))?;
        // Header, then the body sealed in place behind it, then the tag:
        // one buffer, one copy of the body.
        let tag_len = AES_256_GCM.tag_len();
        let mut out =
            BytesMut::with_capacity(magic.len() + 1 + id.len() + NONCE_LEN + body.len() + tag_len);
        out.put_slice(magic);
        out.put_u8(id.len() as u8);
        out.put_slice(id.as_bytes());
        out.put_slice(&nonce);
        let start = out.len();
        out.put_slice(body);
        let tag = aead
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(nonce),
                Aad::from(aad),
                &mut out[start..],
            )
            .map_err(|_| StoreError::Backend("sealing the response body failed".into()))?;
        out.put_slice(tag.as_ref());
        Ok(out.freeze())
    }

    /// Opens a body sealed for `binding`'s record and answer; a body
    /// without a seal header (stored before sealing was on) comes back as
    /// it is, unless `require_sealed`.
    pub fn open(
        &self,
        binding: &Binding<'_>,
        body: Bytes,
        require_sealed: bool,
    ) -> Result<Bytes, StoreError> {
        let corrupt =
            |why: &str| StoreError::Corrupt(format!("sealed response body: {why}").into());
        let (rest, aad) = if let Some(rest) = body.strip_prefix(MAGIC2) {
            (rest, binding.associated())
        } else if let Some(rest) = body.strip_prefix(MAGIC) {
            (rest, associated_v1(binding.scope, binding.key))
        } else if require_sealed {
            return Err(StoreError::Corrupt(
                "the stored answer is not sealed, and require_sealed is on: refused, not replayed"
                    .into(),
            ));
        } else {
            return Ok(body);
        };
        let (&id_len, rest) = rest.split_first().ok_or_else(|| corrupt("truncated"))?;
        let id_len = usize::from(id_len);
        if rest.len() < id_len + NONCE_LEN {
            return Err(corrupt("truncated"));
        }
        let (id, rest) = rest.split_at(id_len);
        let (nonce, sealed) = rest.split_at(NONCE_LEN);
        let id = std::str::from_utf8(id).map_err(|_| corrupt("bad key id"))?;
        let (_, aead) =
            self.keys.iter().find(|(k, _)| k == id).ok_or_else(|| {
                corrupt(&format!("sealed with key {id:?}, which is not configured"))
            })?;
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| corrupt("bad nonce"))?;
        let mut buf = sealed.to_vec();
        let plain = aead
            .open_in_place(nonce, Aad::from(aad), &mut buf)
            .map_err(|_| {
                corrupt(&format!(
                    "does not open with key {id:?} (the answer or its record altered, or another record's)"
                ))
            })?;
        let len = plain.len();
        buf.truncate(len);
        Ok(Bytes::from(buf))
    }

    fn open_record(&self, mut record: Record, require_sealed: bool) -> Result<Record, StoreError> {
        let body = match Binding::of(&record) {
            Some((binding, response)) => {
                Some(self.open(&binding, response.body.clone(), require_sealed)?)
            }
            None => None,
        };
        if let (Some(body), Some(resp)) = (body, record.response.as_mut()) {
            resp.body = body;
        }
        Ok(record)
    }
}

/// What bound a body sealed by earlier versions to its record.
fn associated_v1(scope: &Scope, key: &IdempotencyKey) -> Vec<u8> {
    let mut aad = Vec::with_capacity(scope.tenant().len() + scope.operation().len() + 64);
    aad.extend_from_slice(scope.tenant().as_bytes());
    aad.push(0);
    aad.extend_from_slice(scope.operation().as_bytes());
    aad.push(0);
    aad.extend_from_slice(key.as_str().as_bytes());
    aad
}

/// A store whose recorded response bodies are sealed at rest.
#[derive(Debug, Clone)]
pub struct Sealed<S> {
    inner: S,
    keys: Arc<SealKeys>,
    require_sealed: bool,
}

impl<S> Sealed<S> {
    /// Wraps `inner`, sealing with `keys`.
    pub fn new(inner: S, keys: Arc<SealKeys>) -> Self {
        Self {
            inner,
            keys,
            require_sealed: false,
        }
    }

    /// Also refuses final records whose body is not sealed (default: they
    /// are read as they are, as records from before sealing was on).
    pub fn with_require_sealed(mut self, require: bool) -> Self {
        self.require_sealed = require;
        self
    }
}

impl<S: Store> Store for Sealed<S> {
    async fn reserve(&self, req: ReserveRequest<'_>) -> Result<Reservation, StoreError> {
        match self.inner.reserve(req).await? {
            Reservation::Existing(record) => Ok(Reservation::Existing(Box::new(
                self.keys.open_record(*record, self.require_sealed)?,
            ))),
            other => Ok(other),
        }
    }

    async fn get(&self, scope: &Scope, key: &IdempotencyKey) -> Result<Option<Record>, StoreError> {
        self.inner
            .get(scope, key)
            .await?
            .map(|r| self.keys.open_record(r, self.require_sealed))
            .transpose()
    }

    async fn resolve(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        outcome: &FinalOutcome,
    ) -> Result<(), StoreError> {
        let body = &outcome.response.body;
        if body.starts_with(MAGIC) || body.starts_with(MAGIC2) {
            return Err(StoreError::Backend(
                "a response body that starts like a sealed one cannot be stored".into(),
            ));
        }
        // The fingerprint is the record's: one read of it per recorded
        // answer (the price of binding the answer to the request). A record
        // that is gone cannot be resolved anyway; its zero fingerprint
        // would never open.
        let fingerprint = self
            .inner
            .get(scope, key)
            .await?
            .map_or(Fingerprint::from_digest([0; 32]), |r| r.fingerprint);
        let binding = Binding {
            scope,
            key,
            fingerprint: &fingerprint,
            state: outcome.verdict.into(),
            status: outcome.response.status,
            headers: &outcome.response.headers,
            resource_id: outcome.resource_id.as_deref(),
            error_code: outcome.error_code.as_deref(),
        };
        let mut sealed = outcome.clone();
        sealed.response.body = self.keys.seal(&binding, &outcome.response.body)?;
        self.inner.resolve(scope, key, lease, &sealed).await
    }

    async fn release(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
    ) -> Result<(), StoreError> {
        self.inner.release(scope, key, lease).await
    }

    async fn mark_unknown(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        reason: &str,
    ) -> Result<(), StoreError> {
        self.inner.mark_unknown(scope, key, lease, reason).await
    }

    async fn renew(
        &self,
        scope: &Scope,
        key: &IdempotencyKey,
        lease: &Lease,
        duration: Duration,
    ) -> Result<Timestamp, StoreError> {
        self.inner.renew(scope, key, lease, duration).await
    }
}

impl<S: ListRecords> ListRecords for Sealed<S> {
    async fn list(&self, filter: &ListFilter) -> Result<Page, StoreError> {
        let page = self.inner.list(filter).await?;
        Ok(Page {
            records: page
                .records
                .into_iter()
                .map(|r| self.keys.open_record(r, self.require_sealed))
                .collect::<Result<_, _>>()?,
            next: page.next,
        })
    }
}

impl<S: Purge> Purge for Sealed<S> {
    async fn purge_expired(&self, batch: usize) -> Result<u64, StoreError> {
        self.inner.purge_expired(batch).await
    }

    async fn delete(&self, scope: &Scope, key: &IdempotencyKey) -> Result<bool, StoreError> {
        self.inner.delete(scope, key).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{MemoryStore, OwnerToken, Policy, Verdict};

    const K1: &str = "k1:000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";
    const K2: &str = "k2:ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";

    fn scope() -> Scope {
        Scope::new("tenant", "POST /v1/payments").expect("scope")
    }

    fn key(k: &str) -> IdempotencyKey {
        k.parse().expect("key")
    }

    fn fp(b: &[u8]) -> Fingerprint {
        Fingerprint::builder().part("body", b).finish()
    }

    /// A record's binding: scope, key `k`, and an answer `status`.
    fn binding<'a>(
        scope: &'a Scope,
        k: &'a IdempotencyKey,
        fp: &'a Fingerprint,
        headers: &'a [(String, Bytes)],
        status: u16,
    ) -> Binding<'a> {
        Binding {
            scope,
            key: k,
            fingerprint: fp,
            state: RecordState::Completed,
            status,
            headers,
            resource_id: Some("ch_1"),
            error_code: None,
        }
    }

    #[test]
    fn a_sealed_answer_opens_only_for_its_record_as_stored() {
        let keys = SealKeys::parse(K1).expect("keys");
        let (s, a, f) = (scope(), key("a"), fp(b"request"));
        let headers = vec![("location".to_owned(), Bytes::from_static(b"/v1/payments/1"))];
        let good = binding(&s, &a, &f, &headers, 201);
        let sealed = keys.seal(&good, b"card 4242").expect("seal");
        assert!(!sealed.windows(4).any(|w| w == b"4242"), "no clear text");
        assert_eq!(
            keys.open(&good, sealed.clone(), true).expect("open"),
            &b"card 4242"[..]
        );
        // Whatever someone changes in the store, the answer does not open:
        // another record, another fingerprint, status, header, resource, state.
        let (b, other_fp) = (key("b"), fp(b"another request"));
        let forged_headers = vec![("location".to_owned(), Bytes::from_static(b"/evil"))];
        let failed = Binding {
            state: RecordState::Failed,
            ..good
        };
        let other_resource = Binding {
            resource_id: Some("ch_2"),
            ..good
        };
        for forged in [
            binding(&s, &b, &f, &headers, 201),
            binding(&s, &a, &other_fp, &headers, 201),
            binding(&s, &a, &f, &headers, 200),
            binding(&s, &a, &f, &forged_headers, 201),
            binding(&s, &a, &f, &[], 201),
            failed,
            other_resource,
        ] {
            assert!(
                matches!(
                    keys.open(&forged, sealed.clone(), false),
                    Err(StoreError::Corrupt(_))
                ),
                "{forged:?}"
            );
        }
        let mut altered = sealed.to_vec();
        *altered.last_mut().expect("bytes") ^= 1;
        assert!(matches!(
            keys.open(&good, Bytes::from(altered), false),
            Err(StoreError::Corrupt(_))
        ));
        // Two seals of the same body differ (fresh nonces).
        assert_ne!(sealed, keys.seal(&good, b"card 4242").expect("seal"));
        // A body stored before sealing was on reads as it is, unless sealing
        // is required: then it is refused.
        let plain = Bytes::from_static(b"plain");
        assert_eq!(
            keys.open(&good, plain.clone(), false).expect("plain"),
            &b"plain"[..]
        );
        let err = keys.open(&good, plain, true).expect_err("required");
        assert!(err.to_string().contains("require_sealed"), "{err}");
        // A body sealed by an earlier version (bound to tenant, operation
        // and key only) still opens, for its record only.
        let v1 = keys
            .seal_with(MAGIC, associated_v1(&s, &a), b"old")
            .expect("v1");
        assert_eq!(
            keys.open(&good, v1.clone(), true).expect("v1 opens"),
            &b"old"[..]
        );
        assert!(
            keys.open(&binding(&s, &b, &f, &headers, 201), v1, false)
                .is_err()
        );
    }

    #[test]
    fn keys_rotate_new_first_old_still_opening() {
        let (s, a, f) = (scope(), key("a"), fp(b"r"));
        let b = binding(&s, &a, &f, &[], 201);
        let old = SealKeys::parse(K1).expect("old");
        let sealed_old = old.seal(&b, b"x").expect("seal");
        let rotated = SealKeys::parse(&format!("{K2}\n# previous\n{K1}")).expect("rotated");
        assert_eq!(rotated.current_id(), "k2");
        assert_eq!(
            rotated
                .open(&b, sealed_old.clone(), false)
                .expect("old opens"),
            &b"x"[..]
        );
        let sealed_new = rotated.seal(&b, b"y").expect("seal");
        let err = old.open(&b, sealed_new, false).expect_err("k2 unknown");
        assert!(
            err.to_string().contains("\"k2\", which is not configured"),
            "{err}"
        );
        let dropped = SealKeys::parse(K2).expect("k1 dropped");
        assert!(dropped.open(&b, sealed_old, false).is_err());
    }

    #[test]
    fn bad_key_specs_are_refused_with_the_reason_and_never_printed() {
        for (spec, why) in [
            ("", "no key given"),
            ("k1", "not id:hex"),
            ("k1:abcd", "64 hex digits"),
            (&format!("{K1},{K1}"), "appears twice"),
            ("bad/id:00", "1 to 32 letters"),
        ] {
            let err = SealKeys::parse(spec).expect_err(spec).to_string();
            assert!(err.contains(why), "{spec}: {err}");
        }
        let keys = SealKeys::parse(K1).expect("keys");
        let shown = format!("{keys:?}");
        assert!(shown.contains("k1") && !shown.contains("0a0b0c"), "{shown}");
    }

    #[tokio::test]
    async fn the_store_keeps_sealed_bodies_and_answers_clear_ones() {
        let inner = Arc::new(MemoryStore::new());
        let keys = Arc::new(SealKeys::parse(K1).expect("keys"));
        let store = Sealed::new(Arc::clone(&inner), keys);
        let (s, k) = (scope(), key("pay-1"));
        let policy = Policy::default();
        let Reservation::Acquired(lease) = store
            .reserve(ReserveRequest {
                scope: &s,
                key: &k,
                fingerprint: Fingerprint::builder().part("body", b"request").finish(),
                owner: OwnerToken::random(),
                lease: policy.lease,
                retention: policy.retention,
                on_lease_expiry: policy.on_lease_expiry,
            })
            .await
            .expect("reserve")
        else {
            panic!("acquired");
        };
        let outcome = FinalOutcome {
            verdict: Verdict::Completed,
            response: StoredResponse::new(201, "{\"charge\":\"ch_1\"}"),
            resource_id: None,
            error_code: None,
            retention: Duration::from_secs(60),
        };
        store
            .resolve(&s, &k, &lease, &outcome)
            .await
            .expect("resolve");
        let raw = inner.get(&s, &k).await.expect("get").expect("record");
        let raw_body = raw.response.expect("response").body;
        assert!(raw_body.starts_with(MAGIC2), "sealed at rest");
        let clear = store.get(&s, &k).await.expect("get").expect("record");
        assert_eq!(
            clear.response.expect("response").body,
            &b"{\"charge\":\"ch_1\"}"[..]
        );
    }

    /// A reservation of `k` by a fresh owner, the same request each time.
    fn request<'a>(s: &'a Scope, k: &'a IdempotencyKey) -> ReserveRequest<'a> {
        let policy = Policy::default();
        ReserveRequest {
            scope: s,
            key: k,
            fingerprint: fp(b"request"),
            owner: OwnerToken::random(),
            lease: policy.lease,
            retention: policy.retention,
            on_lease_expiry: policy.on_lease_expiry,
        }
    }

    /// Records `body` as the answer to `k` through `store`.
    async fn complete(store: &impl Store, k: &IdempotencyKey, body: &'static str) {
        let s = scope();
        let Reservation::Acquired(lease) = store.reserve(request(&s, k)).await.expect("reserve")
        else {
            panic!("acquired");
        };
        let outcome = FinalOutcome {
            verdict: Verdict::Completed,
            response: StoredResponse::new(201, body),
            resource_id: None,
            error_code: None,
            retention: Duration::from_secs(60),
        };
        store
            .resolve(&s, k, &lease, &outcome)
            .await
            .expect("resolve");
    }

    /// `with_require_sealed(true)`: a final record whose body is not sealed
    /// (written into the store by someone else) is refused as corrupt on
    /// every way it is read (get, a retry's replay, listing), never
    /// replayed; `false`, as by default, it is read as it is. A sealed
    /// record opens either way.
    #[tokio::test]
    async fn require_sealed_refuses_a_clear_answer_wherever_it_is_read() {
        let inner = Arc::new(MemoryStore::new());
        let keys = Arc::new(SealKeys::parse(K1).expect("keys"));
        let (s, clear, sealed) = (scope(), key("clear"), key("sealed"));
        complete(&inner, &clear, "clear body").await;
        complete(
            &Sealed::new(Arc::clone(&inner), Arc::clone(&keys)),
            &sealed,
            "sealed body",
        )
        .await;
        let body = |record: Option<Record>| record.and_then(|r| r.response).map(|r| r.body);
        let every = ListFilter {
            limit: 10,
            ..ListFilter::default()
        };
        for require in [false, true] {
            let store =
                Sealed::new(Arc::clone(&inner), Arc::clone(&keys)).with_require_sealed(require);
            let opened = store.get(&s, &sealed).await.expect("get");
            assert_eq!(body(opened).as_deref(), Some(&b"sealed body"[..]));
            let got = store.get(&s, &clear).await;
            let replayed = store.reserve(request(&s, &clear)).await;
            let listed = store.list(&every).await;
            if require {
                assert!(matches!(got, Err(StoreError::Corrupt(_))), "{got:?}");
                assert!(
                    matches!(replayed, Err(StoreError::Corrupt(_))),
                    "{replayed:?}"
                );
                assert!(matches!(listed, Err(StoreError::Corrupt(_))), "{listed:?}");
            } else {
                let got = got.expect("get");
                assert_eq!(body(got).as_deref(), Some(&b"clear body"[..]));
                let Ok(Reservation::Existing(record)) = replayed else {
                    panic!("a replay: {replayed:?}");
                };
                assert_eq!(body(Some(*record)).as_deref(), Some(&b"clear body"[..]));
                assert_eq!(listed.expect("list").records.len(), 2);
            }
        }
        assert!(
            !Sealed::new(Arc::clone(&inner), keys).require_sealed,
            "off by default"
        );
    }
}

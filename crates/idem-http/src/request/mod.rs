//! Reading what identifies a request: its key, its tenant, its fingerprint.
//!
//! ```
//! use http::Request;
//! use idem_http::{Tenant, TenantSource, TenantExtractor, idempotency_key};
//!
//! let req = Request::post("/v1/payments")
//!     .header("idempotency-key", "\"order-7\"")   // structured-field string
//!     .header("authorization", "Bearer sk_test_1")
//!     .body(())
//!     .unwrap();
//! let (parts, _) = req.into_parts();
//! assert_eq!(idempotency_key(&parts.headers).unwrap().unwrap().as_str(), "order-7");
//! let tenant = TenantSource::Authorization.tenant(&parts).unwrap();
//! // A credential: the layer keeps only its keyed hash.
//! assert_eq!(tenant, Tenant::Credential(b"Bearer sk_test_1"));
//! ```
//!
//! One file per reading: `key.rs` (the key), `tenant.rs` (the tenant and
//! the peer), `fingerprint.rs` (what makes two requests the same).

mod fingerprint;
mod key;
mod tenant;

pub use fingerprint::{Hashing, fingerprints, is_json, previous_fingerprint};
pub use key::{IDEMPOTENCY_KEY, idempotency_key, key_from_body, key_from_headers};
pub(crate) use key::{header_label, key_from_value, key_in, key_required};
pub use tenant::{PeerAddr, Tenant, TenantExtractor, TenantSource, is_trusted};

#[cfg(test)]
mod tests;

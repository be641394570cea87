//! The deployment's hash secret: the key of `v3:` fingerprints and of
//! credential tenants, and the unkeyed tenant of records written before
//! one was set.

use std::fmt;

use ring::hmac;
use sha2::{Digest, Sha256};

use crate::hex::{from_hex, to_hex};

const DOMAIN_TENANT: &[u8] = b"idem.tenant.v2\0";

/// The deployment's secret for keyed hashes: fingerprints (`v3:`) and
/// credential tenants. Every process that shares a store must use the same
/// one, or none of them finds the others' records.
///
/// At least 32 bytes, written as hex (`openssl rand -hex 32`). The secret
/// never reaches a log: `Debug` shows its length only.
pub struct HashSecret {
    key: hmac::Key,
    len: usize,
}

impl fmt::Debug for HashSecret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HashSecret")
            .field("bytes", &self.len)
            .finish_non_exhaustive()
    }
}

/// Why a text is not a hash secret (the message never quotes it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("hash secret: {0}")]
pub struct HashSecretError(&'static str);

impl HashSecret {
    /// The fewest bytes a secret may have.
    pub const MIN_BYTES: usize = 32;

    /// Reads a secret written as hex (white space around it ignored).
    pub fn from_hex(text: &str) -> Result<Self, HashSecretError> {
        let bytes = from_hex(text.trim()).ok_or(HashSecretError(
            "must be written as hex digits (openssl rand -hex 32)",
        ))?;
        Self::from_bytes(&bytes)
    }

    /// A secret from raw bytes, at least [`MIN_BYTES`](Self::MIN_BYTES).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, HashSecretError> {
        if bytes.len() < Self::MIN_BYTES {
            return Err(HashSecretError(
                "must be at least 32 bytes (64 hex digits: openssl rand -hex 32)",
            ));
        }
        Ok(Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, bytes),
            len: bytes.len(),
        })
    }

    /// A new random secret of 32 bytes, and its hex form to keep.
    pub fn generate() -> (Self, String) {
        use ring::rand::SecureRandom;
        let mut bytes = [0u8; 32];
        ring::rand::SystemRandom::new()
            .fill(&mut bytes)
            .expect("the operating system's random source works");
        let hex = to_hex(&bytes);
        let secret = Self::from_bytes(&bytes).expect("32 bytes");
        (secret, hex)
    }

    /// The HMAC key fingerprints (`v3:`) are signed with.
    pub(crate) fn hmac_key(&self) -> &hmac::Key {
        &self.key
    }

    /// The tenant a credential (an `Authorization` value, an API key, a
    /// session cookie) stands for: HMAC-SHA-256 of it under this secret,
    /// as 64 hex digits. The credential itself is never kept.
    pub fn tenant(&self, credential: &[u8]) -> String {
        let mut ctx = hmac::Context::with_key(&self.key);
        ctx.update(DOMAIN_TENANT);
        ctx.update(credential);
        to_hex(ctx.sign().as_ref())
    }
}

/// The tenant earlier versions gave a credential: its unkeyed SHA-256, as
/// 64 hex digits. Used only to find records written before a
/// [`HashSecret`] was set.
pub fn unkeyed_tenant(credential: &[u8]) -> String {
    to_hex(&Sha256::digest(credential))
}

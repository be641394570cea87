//! A webhook signing secret: the key bytes its text stands for, never
//! shown, never compared in variable time.

use std::fmt;

use subtle::ConstantTimeEq;

/// One signing secret of a sender. A route holds several while the
/// sender rotates them: a delivery signed with any of them is verified.
#[derive(Clone)]
pub struct Secret {
    key: Vec<u8>,
}

/// Why a secret's text was refused. Never quotes the secret.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SecretError(String);

impl fmt::Display for SecretError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for SecretError {}

/// How a provider writes its secrets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretForm {
    /// The text's bytes are the key (Stripe, whose `whsec_…` is used
    /// whole; GitHub; Shopify; generic senders).
    Text,
    /// Standard Webhooks: `whsec_` then the key in base64 (the prefix may
    /// be left out).
    Base64,
}

impl Secret {
    /// The key bytes `text` stands for, written as `form` says. Blank
    /// text, and base64 that does not decode, are refused.
    pub fn parse(text: &str, form: SecretForm) -> Result<Self, SecretError> {
        let text = text.trim();
        if text.is_empty() {
            return Err(SecretError("the secret is empty".to_owned()));
        }
        let key = match form {
            SecretForm::Text => text.as_bytes().to_vec(),
            SecretForm::Base64 => {
                use base64::Engine as _;
                let b64 = text.strip_prefix("whsec_").unwrap_or(text);
                base64::engine::general_purpose::STANDARD
                    .decode(b64)
                    .map_err(|_| {
                        SecretError(
                            "a Standard Webhooks secret is whsec_ followed by base64, and this one does not decode"
                                .to_owned(),
                        )
                    })?
            }
        };
        Self::from_bytes(key)
    }

    /// A secret of these key bytes (at least one).
    pub fn from_bytes(key: Vec<u8>) -> Result<Self, SecretError> {
        if key.is_empty() {
            return Err(SecretError("the secret is empty".to_owned()));
        }
        Ok(Self { key })
    }

    /// How many bytes the key has (a short one is guessable).
    pub fn len(&self) -> usize {
        self.key.len()
    }

    /// Always false: a secret has at least one byte.
    pub fn is_empty(&self) -> bool {
        self.key.is_empty()
    }

    pub(super) fn key(&self) -> &[u8] {
        &self.key
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret(<{} bytes, not shown>)", self.key.len())
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Self) -> bool {
        self.key.ct_eq(&other.key).into()
    }
}

impl Eq for Secret {}

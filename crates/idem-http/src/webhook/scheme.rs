//! Where a signed delivery carries its signature, its timestamp and its
//! id, and what its sender signs: one [`Scheme`] per provider, and the
//! generic HMAC one a route describes itself.

use std::fmt;
use std::str::FromStr;

use http::HeaderName;

use crate::JsonPointer;

/// The hash under the HMAC.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// HMAC-SHA-1 (older senders only).
    Sha1,
    /// HMAC-SHA-256, what every documented provider uses.
    Sha256,
    /// HMAC-SHA-512.
    Sha512,
}

impl Algorithm {
    pub(super) fn ring(self) -> ring::hmac::Algorithm {
        match self {
            Self::Sha1 => ring::hmac::HMAC_SHA1_FOR_LEGACY_USE_ONLY,
            Self::Sha256 => ring::hmac::HMAC_SHA256,
            Self::Sha512 => ring::hmac::HMAC_SHA512,
        }
    }
}

impl FromStr for Algorithm {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sha1" => Ok(Self::Sha1),
            "sha256" => Ok(Self::Sha256),
            "sha512" => Ok(Self::Sha512),
            _ => Err("expected \"sha256\", \"sha512\" or \"sha1\"".to_owned()),
        }
    }
}

/// How a signature's bytes are written in its header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// Hexadecimal, either case.
    Hex,
    /// Base64, standard alphabet, padded.
    Base64,
}

impl FromStr for Encoding {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "hex" => Ok(Self::Hex),
            "base64" => Ok(Self::Base64),
            _ => Err("expected \"hex\" or \"base64\"".to_owned()),
        }
    }
}

impl Encoding {
    pub(super) fn decode(self, text: &[u8]) -> Option<Vec<u8>> {
        use base64::Engine as _;
        match self {
            Self::Hex => hex::decode(text).ok(),
            Self::Base64 => base64::engine::general_purpose::STANDARD.decode(text).ok(),
        }
    }
}

/// One piece of what a sender signs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece {
    /// These bytes, as written.
    Text(String),
    /// The delivery id, as its header carries it.
    Id,
    /// The timestamp, as its header carries it.
    Timestamp,
    /// The raw body, as received.
    Body,
}

/// What a sender signs, written as a template: `{body}` (GitHub,
/// Shopify), `{timestamp}.{body}` (Stripe), `{id}.{timestamp}.{body}`
/// (Standard Webhooks), `v0:{timestamp}:{body}` (Slack). The body comes
/// in exactly once; `{id}` needs the id in a header, `{timestamp}` a
/// timestamp.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Signed(pub(super) Vec<Piece>);

impl Signed {
    /// Whether the template names `piece`.
    pub fn names(&self, piece: &Piece) -> bool {
        self.0.contains(piece)
    }
}

impl FromStr for Signed {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut pieces = Vec::new();
        let mut rest = s;
        while !rest.is_empty() {
            let (text, after) = match rest.find('{') {
                Some(at) => rest.split_at(at),
                None => (rest, ""),
            };
            if !text.is_empty() {
                pieces.push(Piece::Text(text.to_owned()));
            }
            if after.is_empty() {
                break;
            }
            let end = after
                .find('}')
                .ok_or_else(|| "a '{' without its '}'".to_owned())?;
            pieces.push(match &after[1..end] {
                "id" => Piece::Id,
                "timestamp" => Piece::Timestamp,
                "body" => Piece::Body,
                other => {
                    return Err(format!(
                        "{{{other}}} is not one of {{id}}, {{timestamp}}, {{body}}"
                    ));
                }
            });
            rest = &after[end + 1..];
        }
        match pieces.iter().filter(|p| **p == Piece::Body).count() {
            1 => Ok(Self(pieces)),
            0 => Err("what is signed must include {body}".to_owned()),
            _ => Err("{body} may come in only once".to_owned()),
        }
    }
}

impl fmt::Display for Signed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for piece in &self.0 {
            match piece {
                Piece::Text(t) => f.write_str(t)?,
                Piece::Id => f.write_str("{id}")?,
                Piece::Timestamp => f.write_str("{timestamp}")?,
                Piece::Body => f.write_str("{body}")?,
            }
        }
        Ok(())
    }
}

/// Where a delivery's id is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdSource {
    /// The first of these headers the delivery carries.
    Header(Vec<HeaderName>),
    /// A field of the JSON body (Stripe's event `id`).
    Field(JsonPointer),
}

/// How the signature header is written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum SignatureForm {
    /// Standard Webhooks: space-separated `v1,<base64>` entries, one per
    /// secret the sender signs with; other versions are skipped.
    Versioned,
    /// Stripe: `t=<unix seconds>` and one `v1=<hex>` per secret, comma
    /// separated; other schemes (`v0`) are skipped.
    Stripe,
    /// One signature: an optional prefix (`sha256=`), then the MAC.
    Plain {
        /// Written before the MAC, compared without regard to case.
        prefix: String,
        /// How the MAC is written.
        encoding: Encoding,
    },
}

/// Where a delivery's timestamp is: unix seconds in a header, or Stripe's
/// `t=` inside the signature header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum TimestampSource {
    Header(Vec<HeaderName>),
    InSignature,
}

/// How one sender signs its deliveries and where it puts their ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scheme {
    pub(super) algorithm: Algorithm,
    /// The signature header: the first of these the delivery carries.
    pub(super) signature_header: Vec<HeaderName>,
    pub(super) signature: SignatureForm,
    pub(super) signed: Signed,
    pub(super) id: IdSource,
    pub(super) timestamp: Option<TimestampSource>,
}

fn names(list: &[&'static str]) -> Vec<HeaderName> {
    list.iter().map(|n| HeaderName::from_static(n)).collect()
}

fn template(text: &str) -> Signed {
    text.parse().unwrap_or(Signed(vec![Piece::Body]))
}

impl Scheme {
    /// Standard Webhooks, as Svix and others send it: `webhook-id`,
    /// `webhook-timestamp`, `webhook-signature` (or Svix's `svix-` names
    /// of the same three), `{id}.{timestamp}.{body}` signed with
    /// HMAC-SHA-256, signatures `v1,<base64>`.
    pub fn standard() -> Self {
        Self {
            algorithm: Algorithm::Sha256,
            signature_header: names(&["webhook-signature", "svix-signature"]),
            signature: SignatureForm::Versioned,
            signed: template("{id}.{timestamp}.{body}"),
            id: IdSource::Header(names(&["webhook-id", "svix-id"])),
            timestamp: Some(TimestampSource::Header(names(&[
                "webhook-timestamp",
                "svix-timestamp",
            ]))),
        }
    }

    /// Stripe: `Stripe-Signature: t=…,v1=…`, `{t}.{body}` signed with
    /// HMAC-SHA-256 in hex, the event's id in the body's `id`.
    pub fn stripe() -> Self {
        Self {
            algorithm: Algorithm::Sha256,
            signature_header: names(&["stripe-signature"]),
            signature: SignatureForm::Stripe,
            signed: template("{timestamp}.{body}"),
            id: IdSource::Field("/id".parse().expect("a valid pointer")),
            timestamp: Some(TimestampSource::InSignature),
        }
    }

    /// GitHub: `X-Hub-Signature-256: sha256=<hex>` over the body, the
    /// delivery's GUID in `X-GitHub-Delivery`; no timestamp.
    pub fn github() -> Self {
        Self::hmac(
            HeaderName::from_static("x-hub-signature-256"),
            IdSource::Header(names(&["x-github-delivery"])),
        )
        .with_prefix("sha256=")
    }

    /// Shopify: `X-Shopify-Hmac-Sha256: <base64>` over the body, the
    /// delivery's id in `X-Shopify-Webhook-Id`; no signed timestamp.
    pub fn shopify() -> Self {
        Self::hmac(
            HeaderName::from_static("x-shopify-hmac-sha256"),
            IdSource::Header(names(&["x-shopify-webhook-id"])),
        )
        .with_encoding(Encoding::Base64)
    }

    /// A generic HMAC scheme: HMAC-SHA-256 of the body, in hex with no
    /// prefix, in `header`; the id where `id` says; no timestamp. The
    /// `with_` methods change each part.
    pub fn hmac(header: HeaderName, id: IdSource) -> Self {
        Self {
            algorithm: Algorithm::Sha256,
            signature_header: vec![header],
            signature: SignatureForm::Plain {
                prefix: String::new(),
                encoding: Encoding::Hex,
            },
            signed: Signed(vec![Piece::Body]),
            id,
            timestamp: None,
        }
    }

    /// Sets the hash (generic schemes).
    pub fn with_algorithm(mut self, algorithm: Algorithm) -> Self {
        self.algorithm = algorithm;
        self
    }

    /// Sets how the MAC is written (generic schemes).
    pub fn with_encoding(mut self, encoding: Encoding) -> Self {
        if let SignatureForm::Plain { encoding: e, .. } = &mut self.signature {
            *e = encoding;
        }
        self
    }

    /// Sets what comes before the MAC (generic schemes), e.g. `sha256=`.
    pub fn with_prefix(mut self, prefix: &str) -> Self {
        if let SignatureForm::Plain { prefix: p, .. } = &mut self.signature {
            *p = prefix.to_owned();
        }
        self
    }

    /// Sets what is signed (generic schemes).
    pub fn with_signed(mut self, signed: Signed) -> Self {
        self.signed = signed;
        self
    }

    /// Reads the delivery's timestamp, unix seconds, from `header`
    /// (generic schemes): deliveries outside the tolerance are refused.
    pub fn with_timestamp_header(mut self, header: HeaderName) -> Self {
        self.timestamp = Some(TimestampSource::Header(vec![header]));
        self
    }

    /// Whether deliveries carry a signed timestamp, so that a captured
    /// delivery cannot be sent again once the tolerance has passed.
    pub fn has_timestamp(&self) -> bool {
        self.timestamp.is_some() && self.signed.names(&Piece::Timestamp)
    }

    /// What is wrong with this scheme, if anything: a template naming
    /// `{id}` with the id in the body, or `{timestamp}` with none.
    pub fn check(&self) -> Result<(), String> {
        if self.signed.names(&Piece::Id) && matches!(self.id, IdSource::Field(_)) {
            return Err("{id} can be signed only when the id is in a header".to_owned());
        }
        if self.signed.names(&Piece::Timestamp) && self.timestamp.is_none() {
            return Err("{timestamp} is signed, but no timestamp header is named".to_owned());
        }
        Ok(())
    }

    /// The headers this scheme reads: the signature, the timestamp and
    /// the id headers (for the docs and the OpenAPI document).
    pub fn headers(&self) -> Vec<HeaderName> {
        let mut out = vec![self.signature_header[0].clone()];
        if let Some(TimestampSource::Header(h)) = &self.timestamp {
            out.push(h[0].clone());
        }
        if let IdSource::Header(h) = &self.id {
            out.push(h[0].clone());
        }
        out
    }
}

//! Signed webhook deliveries. A route that receives a provider's webhooks
//! ([`RoutePolicy::with_webhook`](crate::RoutePolicy::with_webhook))
//! verifies each delivery's signature over the raw body, as received,
//! before anything else; then its key is the provider's delivery id and
//! its tenant the sender, so a provider's retries of one delivery run
//! once and two senders' ids never meet.
//!
//! ```
//! use http::HeaderMap;
//! use idem_http::webhook::{Provider, Refused, Secret, Webhook};
//!
//! let secret = Secret::parse("it's a secret to everybody", Provider::Github.secret_form())?;
//! let hook = Webhook::for_provider(Provider::Github, vec![secret])?;
//! let body = br#"{"action":"opened"}"#;
//! let mut headers = HeaderMap::new();
//! headers.insert("x-github-delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958".parse()?);
//! headers.insert(
//!     "x-hub-signature-256",
//!     "sha256=0000000000000000000000000000000000000000000000000000000000000000".parse()?,
//! );
//! let refused = hook.verify(&headers, body).unwrap_err();
//! assert_eq!(refused.reason, Refused::SignatureInvalid);
//! assert_eq!(hook.tenant(), "webhook:github");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! One file per part: `scheme.rs` (where each provider puts what, and
//! what it signs), `secret.rs` (the keys), this file (the providers and
//! the verification).

mod scheme;
mod secret;
#[cfg(test)]
mod tests;

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::{HeaderMap, HeaderName};
use idem::IdempotencyKey;
use subtle::ConstantTimeEq;

pub use scheme::{Algorithm, Encoding, IdSource, Piece, Scheme, Signed};
use scheme::{SignatureForm, TimestampSource};
pub use secret::{Secret, SecretError, SecretForm};

use crate::{Problem, ProblemKind};

const HOUR: u64 = 3600;
const DAY: u64 = 24 * HOUR;

/// A webhook sender whose scheme idem knows, or `Hmac`, described by the
/// route.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Provider {
    /// Standard Webhooks, as Svix and others send them.
    Standard,
    /// Stripe.
    Stripe,
    /// GitHub.
    Github,
    /// Shopify.
    Shopify,
    /// A generic HMAC signature the route describes ([`Scheme::hmac`]).
    Hmac,
}

impl Provider {
    /// Every provider, in the order the docs list them.
    pub const ALL: [Provider; 5] = [
        Self::Standard,
        Self::Stripe,
        Self::Github,
        Self::Shopify,
        Self::Hmac,
    ];

    /// The name a config writes (`provider = "stripe"`).
    pub const fn name(self) -> &'static str {
        match self {
            Self::Standard => "standard",
            Self::Stripe => "stripe",
            Self::Github => "github",
            Self::Shopify => "shopify",
            Self::Hmac => "hmac",
        }
    }

    /// The provider's own scheme; `None` for [`Hmac`](Self::Hmac), which
    /// the route describes.
    pub fn scheme(self) -> Option<Scheme> {
        match self {
            Self::Standard => Some(Scheme::standard()),
            Self::Stripe => Some(Scheme::stripe()),
            Self::Github => Some(Scheme::github()),
            Self::Shopify => Some(Scheme::shopify()),
            Self::Hmac => None,
        }
    }

    /// How the provider writes its secrets.
    pub const fn secret_form(self) -> SecretForm {
        match self {
            Self::Standard => SecretForm::Base64,
            _ => SecretForm::Text,
        }
    }

    /// The longest time over which the provider documents sending one
    /// delivery again: a route's retention unless it sets its own, so
    /// that its last retry still finds the record. Stripe retries for up
    /// to 3 days (live mode); GitHub redelivers on request for 3 days (7
    /// on Enterprise Server); Shopify documented 48 hours (19 retries;
    /// now 8 over 4 hours); Svix's schedule ends after 27 h 35 min,
    /// kept 3 days for the other Standard Webhooks senders. A generic
    /// sender gets 3 days.
    pub const fn retry_window(self) -> Duration {
        Duration::from_secs(match self {
            Self::Standard | Self::Stripe | Self::Hmac => 3 * DAY,
            Self::Github => 7 * DAY,
            Self::Shopify => 48 * HOUR,
        })
    }

    /// How far a signed timestamp may be from the gateway's clock, either
    /// way, unless the route says otherwise: 5 minutes, as Stripe's and
    /// the Standard Webhooks libraries check.
    pub const fn tolerance(self) -> Duration {
        Duration::from_secs(300)
    }
}

impl FromStr for Provider {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| {
                "expected \"standard\", \"stripe\", \"github\", \"shopify\" or \"hmac\"".to_owned()
            })
    }
}

impl fmt::Display for Provider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a webhook route could not be made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookError(String);

impl fmt::Display for WebhookError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for WebhookError {}

/// Why a delivery was refused: the metrics label and the log's reason.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Refused {
    /// No signature header (401).
    SignatureMissing,
    /// A signature header that holds no signature of the scheme's form
    /// (401).
    SignatureMalformed,
    /// No secret of the route signs this delivery as it was received (401).
    SignatureInvalid,
    /// No timestamp where the scheme signs one (400).
    TimestampMissing,
    /// A timestamp that is not unix seconds, or is sent twice (400).
    TimestampInvalid,
    /// A signed timestamp older than the tolerance: a delivery captured
    /// and sent again, or held up on its way (401).
    TimestampStale,
    /// A signed timestamp ahead of the clock by more than the tolerance
    /// (401).
    TimestampFuture,
    /// No delivery id where the provider puts it (400).
    IdMissing,
    /// A delivery id that cannot be a key: not visible ASCII, over 255
    /// bytes, or sent twice (400).
    IdInvalid,
}

impl Refused {
    /// Every reason, in the order the metrics list them.
    pub const ALL: [Refused; 9] = [
        Self::SignatureMissing,
        Self::SignatureMalformed,
        Self::SignatureInvalid,
        Self::TimestampMissing,
        Self::TimestampInvalid,
        Self::TimestampStale,
        Self::TimestampFuture,
        Self::IdMissing,
        Self::IdInvalid,
    ];

    /// The label: `signature_invalid`, `timestamp_stale`, ….
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::SignatureMissing => "signature_missing",
            Self::SignatureMalformed => "signature_malformed",
            Self::SignatureInvalid => "signature_invalid",
            Self::TimestampMissing => "timestamp_missing",
            Self::TimestampInvalid => "timestamp_invalid",
            Self::TimestampStale => "timestamp_stale",
            Self::TimestampFuture => "timestamp_future",
            Self::IdMissing => "id_missing",
            Self::IdInvalid => "id_invalid",
        }
    }

    /// The problem it answers with.
    pub const fn kind(self) -> ProblemKind {
        match self {
            Self::SignatureMissing | Self::SignatureMalformed | Self::SignatureInvalid => {
                ProblemKind::WebhookSignatureInvalid
            }
            Self::TimestampStale | Self::TimestampFuture => ProblemKind::WebhookTimestampRefused,
            Self::TimestampMissing | Self::TimestampInvalid | Self::IdMissing | Self::IdInvalid => {
                ProblemKind::WebhookDeliveryInvalid
            }
        }
    }
}

/// A refused delivery: why, and what to tell its sender (never the
/// secret, never the signature).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// Why.
    pub reason: Refused,
    detail: String,
}

impl Refusal {
    fn new(reason: Refused, detail: impl Into<String>) -> Self {
        Self {
            reason,
            detail: detail.into(),
        }
    }

    /// What went wrong, for the answer and the log.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The answer: a problem document of [`Refused::kind`].
    pub fn problem(&self) -> Problem {
        Problem::new(
            self.reason.kind(),
            format!("{}; nothing was forwarded or recorded", self.detail),
        )
    }
}

/// A route's webhook sender: its scheme, its secrets, how far its
/// timestamps may drift, and the tenant its deliveries are kept under.
#[derive(Clone)]
pub struct Webhook {
    provider: Provider,
    scheme: Scheme,
    secrets: Vec<Secret>,
    keys: Vec<ring::hmac::Key>,
    tolerance: Duration,
    tenant: String,
}

impl fmt::Debug for Webhook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Webhook")
            .field("provider", &self.provider)
            .field("scheme", &self.scheme)
            .field("secrets", &self.secrets.len())
            .field("tolerance", &self.tolerance)
            .field("tenant", &self.tenant)
            .finish()
    }
}

impl PartialEq for Webhook {
    fn eq(&self, other: &Self) -> bool {
        self.provider == other.provider
            && self.scheme == other.scheme
            && self.secrets == other.secrets
            && self.tolerance == other.tolerance
            && self.tenant == other.tenant
    }
}

impl Eq for Webhook {}

/// The longest sender name: it is a tenant, which a store keeps in 255
/// bytes.
pub const MAX_SENDER_LEN: usize = 64;

impl Webhook {
    /// A sender of `provider`'s own scheme (not [`Provider::Hmac`], which
    /// needs [`new`](Self::new)), signing with any of `secrets`.
    pub fn for_provider(provider: Provider, secrets: Vec<Secret>) -> Result<Self, WebhookError> {
        let scheme = provider.scheme().ok_or_else(|| {
            WebhookError("a generic hmac sender needs its scheme described".to_owned())
        })?;
        Self::new(provider, scheme, secrets)
    }

    /// A sender that signs as `scheme` says with any of `secrets`; its
    /// tenant is `webhook:<provider>` until [`with_sender`](Self::with_sender)
    /// names it.
    pub fn new(
        provider: Provider,
        scheme: Scheme,
        secrets: Vec<Secret>,
    ) -> Result<Self, WebhookError> {
        scheme.check().map_err(WebhookError)?;
        if secrets.is_empty() {
            return Err(WebhookError(
                "a webhook route needs at least one secret".to_owned(),
            ));
        }
        let keys = secrets
            .iter()
            .map(|s| ring::hmac::Key::new(scheme.algorithm.ring(), s.key()))
            .collect();
        Ok(Self {
            provider,
            scheme,
            secrets,
            keys,
            tolerance: provider.tolerance(),
            tenant: format!("webhook:{}", provider.name()),
        })
    }

    /// Sets how far a signed timestamp may be from the clock, either way.
    pub fn with_tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// Names the sender: its deliveries are kept under the tenant
    /// `webhook:<name>`. Letters, digits, `.`, `_` and `-`, at most
    /// [`MAX_SENDER_LEN`].
    pub fn with_sender(mut self, name: &str) -> Result<Self, WebhookError> {
        let ok = !name.is_empty()
            && name.len() <= MAX_SENDER_LEN
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !ok {
            return Err(WebhookError(format!(
                "a sender is 1 to {MAX_SENDER_LEN} letters, digits, '.', '_' or '-'"
            )));
        }
        self.tenant = format!("webhook:{name}");
        Ok(self)
    }

    /// The provider.
    pub fn provider(&self) -> Provider {
        self.provider
    }

    /// The scheme.
    pub fn scheme(&self) -> &Scheme {
        &self.scheme
    }

    /// The tolerance of signed timestamps.
    pub fn tolerance(&self) -> Duration {
        self.tolerance
    }

    /// The tenant its deliveries are kept under: `webhook:<sender>`.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// The secrets, for checks of their strength.
    pub fn secrets(&self) -> &[Secret] {
        &self.secrets
    }

    /// Verifies a delivery as received (headers and raw body) against
    /// the clock: its key (the delivery id) when a secret of the route
    /// signs it and its timestamp, if it has one, is within the
    /// tolerance; the refusal otherwise.
    pub fn verify(&self, headers: &HeaderMap, body: &[u8]) -> Result<IdempotencyKey, Refusal> {
        self.verify_at(headers, body, SystemTime::now())
    }

    /// [`verify`](Self::verify) at the time `now`.
    pub fn verify_at(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now: SystemTime,
    ) -> Result<IdempotencyKey, Refusal> {
        let s = &self.scheme;
        let signature = one(headers, &s.signature_header)
            .map_err(|name| {
                Refusal::new(
                    Refused::SignatureMalformed,
                    format!("the {name} header is sent more than once"),
                )
            })?
            .ok_or_else(|| {
                Refusal::new(
                    Refused::SignatureMissing,
                    format!("the {} header is missing", s.signature_header[0]),
                )
            })?;
        let (candidates, in_signature) = signatures(&s.signature, signature).map_err(|why| {
            Refusal::new(
                Refused::SignatureMalformed,
                format!("the {} header {why}", s.signature_header[0]),
            )
        })?;
        let timestamp = match &s.timestamp {
            None => None,
            Some(TimestampSource::InSignature) => Some(in_signature.ok_or_else(|| {
                Refusal::new(
                    Refused::TimestampMissing,
                    format!("the {} header has no t=", s.signature_header[0]),
                )
            })?),
            Some(TimestampSource::Header(names)) => Some(
                one(headers, names)
                    .map_err(|name| {
                        Refusal::new(
                            Refused::TimestampInvalid,
                            format!("the {name} header is sent more than once"),
                        )
                    })?
                    .ok_or_else(|| {
                        Refusal::new(
                            Refused::TimestampMissing,
                            format!("the {} header is missing", names[0]),
                        )
                    })?,
            ),
        };
        let seconds = timestamp.map(unix_seconds).transpose()?;
        let header_id = match &s.id {
            IdSource::Header(names) => one(headers, names).map_err(|name| {
                Refusal::new(
                    Refused::IdInvalid,
                    format!("the {name} header is sent more than once"),
                )
            })?,
            IdSource::Field(_) => None,
        };
        let missing_id = || match &s.id {
            IdSource::Header(names) => Refusal::new(
                Refused::IdMissing,
                format!("the {} header is missing", names[0]),
            ),
            IdSource::Field(field) => Refusal::new(
                Refused::IdMissing,
                format!("the JSON body has no {field} to be the delivery id"),
            ),
        };
        if s.signed.names(&Piece::Id) && header_id.is_none() {
            return Err(missing_id());
        }
        let signed = |ctx: &mut ring::hmac::Context| {
            for piece in &s.signed.0 {
                match piece {
                    Piece::Text(t) => ctx.update(t.as_bytes()),
                    Piece::Id => ctx.update(header_id.unwrap_or_default()),
                    Piece::Timestamp => ctx.update(timestamp.unwrap_or_default()),
                    Piece::Body => ctx.update(body),
                }
            }
        };
        let verified = self.keys.iter().any(|key| {
            let mut ctx = ring::hmac::Context::with_key(key);
            signed(&mut ctx);
            let tag = ctx.sign();
            candidates
                .iter()
                .any(|c| bool::from(c.as_slice().ct_eq(tag.as_ref())))
        });
        if !verified {
            return Err(Refusal::new(
                Refused::SignatureInvalid,
                "no secret of this route signs the delivery as received",
            ));
        }
        if let Some(sent) = seconds {
            let now = now
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
            let tolerance = i64::try_from(self.tolerance.as_secs()).unwrap_or(i64::MAX);
            let age = now.saturating_sub(sent);
            if age > tolerance {
                return Err(Refusal::new(
                    Refused::TimestampStale,
                    format!(
                        "the delivery was signed {age} s ago, more than the {tolerance} s this route accepts"
                    ),
                ));
            }
            if -age > tolerance {
                return Err(Refusal::new(
                    Refused::TimestampFuture,
                    format!(
                        "the delivery is signed {} s ahead of this gateway's clock, more than the {tolerance} s this route accepts",
                        -age
                    ),
                ));
            }
        }
        let id = match (&s.id, header_id) {
            (IdSource::Header(_), Some(id)) => id,
            (IdSource::Header(_), None) => return Err(missing_id()),
            (IdSource::Field(field), _) => {
                let doc = idem::json_strict(body).map_err(|_| missing_id())?;
                let value = field.get(&doc).ok_or_else(missing_id)?;
                return crate::request::key_from_value(value, &format!("the body's {field}"))
                    .map_err(|p| Refusal::new(Refused::IdInvalid, p.detail()));
            }
        };
        IdempotencyKey::from_bytes(id).map_err(|e| {
            Refusal::new(
                Refused::IdInvalid,
                format!("the delivery id is not a valid key: {e}"),
            )
        })
    }
}

/// The one value of the first of `names` the request carries; `Err`
/// names a header sent more than once.
fn one<'a>(headers: &'a HeaderMap, names: &[HeaderName]) -> Result<Option<&'a [u8]>, String> {
    let Some(name) = names.iter().find(|n| headers.contains_key(*n)) else {
        return Ok(None);
    };
    let mut values = headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (Some(v), None) => Ok(Some(v.as_bytes())),
        (Some(_), Some(_)) => Err(name.to_string()),
        (None, _) => Ok(None),
    }
}

/// The candidate MACs a signature header holds, and Stripe's `t=`.
type Candidates<'a> = (Vec<Vec<u8>>, Option<&'a [u8]>);

fn signatures<'a>(form: &SignatureForm, value: &'a [u8]) -> Result<Candidates<'a>, String> {
    let mut out = Vec::new();
    let mut t = None;
    match form {
        SignatureForm::Versioned => {
            for entry in value
                .split(|b| b.is_ascii_whitespace())
                .filter(|e| !e.is_empty())
            {
                if let Some(b64) = entry.strip_prefix(b"v1,")
                    && let Some(mac) = Encoding::Base64.decode(b64)
                {
                    out.push(mac);
                }
            }
        }
        SignatureForm::Stripe => {
            for item in value.split(|b| *b == b',') {
                let item = item.trim_ascii();
                if let Some(ts) = item.strip_prefix(b"t=") {
                    if t.replace(ts).is_some() {
                        return Err("has t= more than once".to_owned());
                    }
                } else if let Some(hex) = item.strip_prefix(b"v1=")
                    && let Some(mac) = Encoding::Hex.decode(hex)
                {
                    out.push(mac);
                }
            }
        }
        SignatureForm::Plain { prefix, encoding } => {
            let value = value.trim_ascii();
            let (head, mac) = value.split_at(prefix.len().min(value.len()));
            if !head.eq_ignore_ascii_case(prefix.as_bytes()) {
                return Err(format!("does not start with {prefix:?}"));
            }
            out.extend(encoding.decode(mac));
        }
    }
    if out.is_empty() {
        let form = match form {
            SignatureForm::Versioned => "a v1,<base64> signature",
            SignatureForm::Stripe => "a v1=<hex> signature",
            SignatureForm::Plain {
                encoding: Encoding::Hex,
                ..
            } => "a signature in hex",
            SignatureForm::Plain {
                encoding: Encoding::Base64,
                ..
            } => "a signature in base64",
        };
        return Err(format!("holds no {form}"));
    }
    Ok((out, t))
}

/// Unix seconds as a sender writes them: ASCII digits, at most 12.
fn unix_seconds(text: &[u8]) -> Result<i64, Refusal> {
    std::str::from_utf8(text)
        .ok()
        .filter(|t| !t.is_empty() && t.len() <= 12 && t.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|t| t.parse().ok())
        .ok_or_else(|| {
            Refusal::new(
                Refused::TimestampInvalid,
                "the timestamp is not unix seconds",
            )
        })
}

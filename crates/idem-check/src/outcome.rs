//! What a check finds: the probes, their verdicts, and the evidence (each
//! request sent and the answer it got).

use bytes::Bytes;
use http::HeaderMap;
use serde::Serialize;

/// Every probe, in the order they run.
pub const PROBES: [Probe; 8] = [
    Probe::Retry,
    Probe::Concurrent,
    Probe::Reuse,
    Probe::EquivalentJson,
    Probe::DistinctKeys,
    Probe::MissingKey,
    Probe::MalformedKey,
    Probe::Tenants,
];

/// One black-box probe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Probe {
    /// The same request sent again with the same key gets the same answer.
    Retry,
    /// N copies at once: one resource; the others replayed or 409.
    Concurrent,
    /// The key reused with a changed field is refused, not executed.
    Reuse,
    /// The same JSON with reordered keys and other white space is the same request.
    EquivalentJson,
    /// Different keys create different resources.
    DistinctKeys,
    /// A request without a key is refused where keys are required.
    MissingKey,
    /// Malformed and oversized keys are refused with 400.
    MalformedKey,
    /// The same key under two credentials makes two independent requests.
    Tenants,
}

impl Probe {
    /// The probe's name on the command line and in reports.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Retry => "retry",
            Self::Concurrent => "concurrent",
            Self::Reuse => "reuse",
            Self::EquivalentJson => "equivalent-json",
            Self::DistinctKeys => "distinct-keys",
            Self::MissingKey => "missing-key",
            Self::MalformedKey => "malformed-key",
            Self::Tenants => "tenants",
        }
    }

    /// What the probe checks, in one sentence.
    pub const fn summary(self) -> &'static str {
        match self {
            Self::Retry => "a sequential retry with the same key returns the same status and body",
            Self::Concurrent => {
                "concurrent duplicates make exactly one resource; the others are replayed or get 409 with Retry-After"
            }
            Self::Reuse => {
                "the key reused with a changed field is rejected (400/409/422), not executed"
            }
            Self::EquivalentJson => {
                "semantically equal JSON (reordered keys, other white space) is treated as the same request"
            }
            Self::DistinctKeys => "different keys create different resources",
            Self::MissingKey => "a request without a key is rejected where keys are required",
            Self::MalformedKey => "malformed and oversized keys are rejected with 400",
            Self::Tenants => "the same key under different credentials makes independent requests",
        }
    }

    /// Requests the probe sends at most (`concurrency` for the concurrent one).
    pub fn budget(self, concurrency: u32) -> u32 {
        match self {
            Self::Retry | Self::Reuse | Self::EquivalentJson | Self::DistinctKeys => 2,
            Self::Tenants | Self::MalformedKey => 2,
            Self::Concurrent => concurrency,
            Self::MissingKey => 1,
        }
    }

    /// Parses a probe name.
    pub fn parse(name: &str) -> Option<Self> {
        PROBES.into_iter().find(|p| p.name() == name.trim())
    }
}

/// Whether a probe passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// The endpoint behaved idempotently.
    Pass,
    /// It did not; the evidence shows how.
    Fail,
    /// Not applicable with the given arguments (the note says why).
    Skip,
    /// The probe could not be judged (a transport error, rate limiting).
    Error,
}

/// One request and what came back.
#[derive(Debug, Clone, Serialize)]
pub struct Exchange {
    /// What was sent, in one line (method, key, credential label, body digest).
    pub request: String,
    /// Status, or 0 when no response came.
    pub status: u16,
    /// Idempotency-relevant headers of the answer.
    pub headers: Vec<(String, String)>,
    /// The start of the body (or the transport error).
    pub body: String,
    /// Milliseconds until the whole answer was read.
    pub millis: u64,
    /// The whole body, which the probes compare.
    #[serde(skip)]
    pub(crate) full_body: Bytes,
    /// Every header of the answer.
    #[serde(skip)]
    pub(crate) header_map: HeaderMap,
}

impl Exchange {
    /// A header of the answer, if present and text.
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.header_map.get(name).and_then(|v| v.to_str().ok())
    }

    /// Whether the answer says it is a replay: `Idempotent-Replayed:
    /// true` as Stripe spells it, or `Idempotency-Replayed: true` as the
    /// IETF-aligned servers do.
    pub(crate) fn replayed(&self) -> bool {
        self.replay_marker().is_some()
    }

    /// The replay marker the answer carries (`true`), by its name.
    pub(crate) fn replay_marker(&self) -> Option<&'static str> {
        ["Idempotent-Replayed", "Idempotency-Replayed"]
            .into_iter()
            .find(|name| self.header(&name.to_ascii_lowercase()) == Some("true"))
    }

    /// Whether the status is 2xx.
    pub(crate) fn success(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// The result of one probe.
#[derive(Debug, Clone, Serialize)]
pub struct Outcome {
    /// The probe.
    pub probe: Probe,
    /// Pass, fail, skip or error.
    pub verdict: Verdict,
    /// Why, in a sentence.
    pub note: String,
    /// The exchanges that justify the verdict.
    pub evidence: Vec<Exchange>,
    /// Seconds the probe took.
    pub seconds: f64,
}

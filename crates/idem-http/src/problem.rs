//! RFC 9457 problem details: every refusal has a stable `type`, and a
//! `code` member holding its slug, for clients and profiles that read a
//! machine code rather than a URI. A published slug never changes.
//!
//! ```
//! use idem_http::{Problem, ProblemKind};
//! let p = Problem::new(ProblemKind::KeyReused, "the key was used for another request");
//! assert_eq!(p.status().as_u16(), 422);
//! assert_eq!(p.type_uri(), "https://idem.dev/problems/idempotency-key-reused");
//! ```

use std::fmt;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::Full;

/// The base of every problem `type` URI; the suffix is the kind's slug.
pub const PROBLEM_BASE: &str = "https://idem.dev/problems/";

/// The media type of problem responses.
pub const PROBLEM_JSON: &str = "application/problem+json";

/// Every kind of refusal or failure the HTTP layer answers itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ProblemKind {
    /// The route requires an `Idempotency-Key` and none was sent (400).
    KeyMissing,
    /// The key is empty, too long, or not visible ASCII (400).
    KeyInvalid,
    /// More than one `Idempotency-Key` header (or a list) was sent (400).
    KeyAmbiguous,
    /// The key was used before for a different request (422 by default).
    KeyReused,
    /// The first request with this key is still running (409 + Retry-After).
    InProgress,
    /// An earlier attempt may have taken effect; the route's lookup is
    /// asking the upstream what became of it (409 + Retry-After: when the
    /// next lookup is due).
    OutcomeReconciling,
    /// An earlier attempt may have taken effect and nothing reconciles it
    /// automatically: it is held for an operator (409, no Retry-After).
    OutcomeHeld,
    /// The request body is over the route's limit (413).
    BodyTooLarge,
    /// The request body could not be read to its end (truncated) (400).
    BodyUnreadable,
    /// A JSON body is not valid UTF-8 (400).
    BodyEncoding,
    /// A JSON body two readers may read differently: a member name twice
    /// in one object, or an integer beyond ±2^53 (400).
    BodyAmbiguous,
    /// The client paused sending the request body for longer than the
    /// server waits (408).
    BodyTimeout,
    /// The server is handling as many requests as it may; nothing was
    /// recorded or forwarded, retry after the hint (503 + Retry-After).
    Overloaded,
    /// The tenant could not be determined (400).
    TenantInvalid,
    /// The request lacks the credential its tenant comes from (401).
    TenantMissing,
    /// The request's `Host` is sent twice, or is not a host (400).
    HostInvalid,
    /// The request's path is not spelled as its route judges it, on a
    /// route that refuses other spellings (400).
    PathNotCanonical,
    /// A tenant identity header from a peer that is not a trusted proxy (403).
    TenantUntrusted,
    /// The idempotency store is unreachable and the route fails closed (503).
    StoreUnavailable,
    /// The upstream could not be reached; nothing was sent (502).
    UpstreamUnreachable,
    /// The upstream did not answer in time after the request was sent (504).
    UpstreamTimeout,
    /// The upstream's response broke off after the request was sent (502).
    UpstreamBroken,
    /// No TLS session with the upstream: its certificate cannot be
    /// verified, or it refused the gateway's; nothing was sent (502).
    UpstreamTls,
    /// A replay of a response whose body was too large or streamed to keep.
    ResponseNotRetained,
    /// A webhook delivery without a signature a secret of its route
    /// makes over the body as received (401).
    WebhookSignatureInvalid,
    /// A webhook delivery signed longer ago, or further ahead, than its
    /// route's tolerance: sent again after capture, or held up (401).
    WebhookTimestampRefused,
    /// A webhook delivery without its id or timestamp where its provider
    /// puts them, or with one that cannot be read (400).
    WebhookDeliveryInvalid,
    /// A JSON-RPC batch holding a call the route protects (400; answered
    /// as a JSON-RPC error).
    JsonRpcBatchRefused,
    /// A request to a GraphQL route that is not one the route can judge:
    /// not a GraphQL request object, a document that does not parse, or
    /// no operation the request selects (400; answered as a GraphQL
    /// error).
    GraphQlRequestInvalid,
    /// A GraphQL batch holding a mutation (400; answered as a GraphQL
    /// error).
    GraphQlBatchRefused,
}

impl ProblemKind {
    /// Every kind, in the order the docs list them: the vocabulary of the
    /// `code` member.
    pub const ALL: [ProblemKind; 30] = [
        Self::KeyMissing,
        Self::KeyInvalid,
        Self::KeyAmbiguous,
        Self::KeyReused,
        Self::InProgress,
        Self::OutcomeReconciling,
        Self::OutcomeHeld,
        Self::BodyTooLarge,
        Self::BodyUnreadable,
        Self::BodyEncoding,
        Self::BodyAmbiguous,
        Self::BodyTimeout,
        Self::Overloaded,
        Self::TenantInvalid,
        Self::TenantMissing,
        Self::HostInvalid,
        Self::PathNotCanonical,
        Self::TenantUntrusted,
        Self::StoreUnavailable,
        Self::UpstreamUnreachable,
        Self::UpstreamTimeout,
        Self::UpstreamBroken,
        Self::UpstreamTls,
        Self::ResponseNotRetained,
        Self::WebhookSignatureInvalid,
        Self::WebhookTimestampRefused,
        Self::WebhookDeliveryInvalid,
        Self::JsonRpcBatchRefused,
        Self::GraphQlRequestInvalid,
        Self::GraphQlBatchRefused,
    ];

    /// The stable slug, last part of the `type` URI.
    pub const fn slug(self) -> &'static str {
        match self {
            Self::KeyMissing => "idempotency-key-missing",
            Self::KeyInvalid => "idempotency-key-invalid",
            Self::KeyAmbiguous => "idempotency-key-ambiguous",
            Self::KeyReused => "idempotency-key-reused",
            Self::InProgress => "idempotency-request-in-progress",
            Self::OutcomeReconciling => "idempotency-outcome-reconciling",
            Self::OutcomeHeld => "idempotency-outcome-held",
            Self::BodyTooLarge => "request-body-too-large",
            Self::BodyUnreadable => "request-body-unreadable",
            Self::BodyEncoding => "request-body-invalid-encoding",
            Self::BodyAmbiguous => "request-body-ambiguous-json",
            Self::BodyTimeout => "request-body-timeout",
            Self::Overloaded => "server-overloaded",
            Self::TenantInvalid => "tenant-invalid",
            Self::TenantMissing => "tenant-missing",
            Self::HostInvalid => "request-host-invalid",
            Self::PathNotCanonical => "request-path-not-canonical",
            Self::TenantUntrusted => "tenant-untrusted",
            Self::StoreUnavailable => "idempotency-store-unavailable",
            Self::UpstreamUnreachable => "upstream-unreachable",
            Self::UpstreamTimeout => "upstream-timeout",
            Self::UpstreamBroken => "upstream-response-broken",
            Self::UpstreamTls => "upstream-tls",
            Self::ResponseNotRetained => "idempotency-response-not-retained",
            Self::WebhookSignatureInvalid => "webhook-signature-invalid",
            Self::WebhookTimestampRefused => "webhook-timestamp-refused",
            Self::WebhookDeliveryInvalid => "webhook-delivery-invalid",
            Self::JsonRpcBatchRefused => "jsonrpc-batch-refused",
            Self::GraphQlRequestInvalid => "graphql-request-invalid",
            Self::GraphQlBatchRefused => "graphql-batch-refused",
        }
    }

    /// The `type` URI.
    pub fn type_uri(self) -> String {
        format!("{PROBLEM_BASE}{}", self.slug())
    }

    /// A short, constant summary.
    pub const fn title(self) -> &'static str {
        match self {
            Self::KeyMissing => "Idempotency-Key header required",
            Self::KeyInvalid => "Invalid Idempotency-Key",
            Self::KeyAmbiguous => "More than one Idempotency-Key",
            Self::KeyReused => "Idempotency-Key reused with a different request",
            Self::InProgress => "A request with this Idempotency-Key is still in progress",
            Self::OutcomeReconciling => {
                "The outcome of an earlier attempt with this Idempotency-Key is being reconciled"
            }
            Self::OutcomeHeld => {
                "An earlier attempt with this Idempotency-Key is held for an operator"
            }
            Self::BodyTooLarge => "Request body too large",
            Self::BodyUnreadable => "Request body could not be read",
            Self::BodyEncoding => "JSON request body is not valid UTF-8",
            Self::BodyAmbiguous => "JSON request body is ambiguous",
            Self::BodyTimeout => "Request body not received in time",
            Self::Overloaded => "Too many requests in progress",
            Self::TenantInvalid => "Tenant could not be determined",
            Self::TenantMissing => "Credentials required",
            Self::HostInvalid => "Invalid Host header",
            Self::PathNotCanonical => "Request path not in canonical form",
            Self::TenantUntrusted => "Tenant identity from an untrusted peer",
            Self::StoreUnavailable => "Idempotency store unavailable",
            Self::UpstreamUnreachable => "Upstream unreachable",
            Self::UpstreamTimeout => "Upstream timed out",
            Self::UpstreamBroken => "Upstream response broke off",
            Self::UpstreamTls => "No trusted TLS session with the upstream",
            Self::ResponseNotRetained => "Original response body not retained",
            Self::WebhookSignatureInvalid => "Webhook signature missing or not valid",
            Self::WebhookTimestampRefused => "Webhook timestamp outside the tolerance",
            Self::WebhookDeliveryInvalid => {
                "Webhook delivery id or timestamp missing or unreadable"
            }
            Self::JsonRpcBatchRefused => "JSON-RPC batch holding a protected call",
            Self::GraphQlRequestInvalid => "GraphQL request the route cannot judge",
            Self::GraphQlBatchRefused => "GraphQL batch holding a mutation",
        }
    }

    /// The status this kind answers with unless configured otherwise.
    pub const fn default_status(self) -> StatusCode {
        match self {
            Self::KeyMissing
            | Self::KeyInvalid
            | Self::KeyAmbiguous
            | Self::BodyUnreadable
            | Self::BodyEncoding
            | Self::BodyAmbiguous
            | Self::TenantInvalid
            | Self::HostInvalid
            | Self::PathNotCanonical
            | Self::WebhookDeliveryInvalid
            | Self::JsonRpcBatchRefused
            | Self::GraphQlRequestInvalid
            | Self::GraphQlBatchRefused => StatusCode::BAD_REQUEST,
            Self::TenantMissing | Self::WebhookSignatureInvalid | Self::WebhookTimestampRefused => {
                StatusCode::UNAUTHORIZED
            }
            Self::TenantUntrusted => StatusCode::FORBIDDEN,
            Self::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Self::InProgress | Self::OutcomeReconciling | Self::OutcomeHeld => StatusCode::CONFLICT,
            Self::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::StoreUnavailable | Self::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            Self::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Self::UpstreamUnreachable | Self::UpstreamBroken | Self::UpstreamTls => {
                StatusCode::BAD_GATEWAY
            }
            Self::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            Self::ResponseNotRetained => StatusCode::OK,
        }
    }
}

/// A problem `type` of a service built on this crate (the gateway's admin
/// API, say): its slug, title and status, answered in the same
/// problem+json form as the [`ProblemKind`]s of the idempotency contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ProblemType {
    slug: &'static str,
    title: &'static str,
    status: StatusCode,
}

impl ProblemType {
    /// A type whose URI is [`PROBLEM_BASE`] + `slug`.
    pub const fn new(slug: &'static str, title: &'static str, status: StatusCode) -> Self {
        Self {
            slug,
            title,
            status,
        }
    }
}

impl From<ProblemKind> for ProblemType {
    fn from(kind: ProblemKind) -> Self {
        Self::new(kind.slug(), kind.title(), kind.default_status())
    }
}

/// One problem response: type, status, human detail, optional retry hint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    kind: Option<ProblemKind>,
    ty: ProblemType,
    status: StatusCode,
    detail: String,
    retry_after: Option<Duration>,
}

impl Problem {
    /// A problem with the kind's default status.
    pub fn new(kind: ProblemKind, detail: impl Into<String>) -> Self {
        Self {
            kind: Some(kind),
            ..Self::of_type(kind.into(), detail)
        }
    }

    /// A problem of a type of its own (not one of the contract's kinds).
    pub fn of_type(ty: ProblemType, detail: impl Into<String>) -> Self {
        Self {
            kind: None,
            ty,
            status: ty.status,
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// Overrides the status (e.g. the configured mismatch status).
    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    /// Adds a `Retry-After` hint (rounded up to whole seconds, at least 1).
    pub fn with_retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The kind, when it is one of the idempotency contract's.
    pub fn kind(&self) -> Option<ProblemKind> {
        self.kind
    }

    /// The slug: the last part of the `type` URI.
    pub fn slug(&self) -> &'static str {
        self.ty.slug
    }

    /// The `type` URI.
    pub fn type_uri(&self) -> String {
        format!("{PROBLEM_BASE}{}", self.ty.slug)
    }

    /// The status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The detail text.
    /// The type's short, constant summary.
    pub fn title(&self) -> &'static str {
        self.ty.title
    }

    /// How long the client is asked to wait before retrying, if at all.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// The human detail.
    pub fn detail(&self) -> &str {
        &self.detail
    }

    /// The JSON document.
    pub fn to_json(&self) -> Vec<u8> {
        let doc = serde_json::json!({
            "type": self.type_uri(),
            "code": self.ty.slug,
            "title": self.ty.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        doc.to_string().into_bytes()
    }

    /// The full HTTP response.
    pub fn to_response(&self) -> Response<Full<Bytes>> {
        let mut resp = Response::new(Full::new(Bytes::from(self.to_json())));
        *resp.status_mut() = self.status;
        resp.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        if let Some(after) = self.retry_after {
            resp.headers_mut().insert(
                header::RETRY_AFTER,
                HeaderValue::from(retry_after_secs(after)),
            );
        }
        resp
    }
}

/// Seconds for a `Retry-After` header: rounded up, at least 1.
pub fn retry_after_secs(after: Duration) -> u64 {
    let secs = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    secs.max(1)
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.ty.title, self.status, self.detail)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_has_the_rfc_9457_members() {
        let p = Problem::new(ProblemKind::InProgress, "wait")
            .with_retry_after(Duration::from_millis(1500));
        let v: serde_json::Value = serde_json::from_slice(&p.to_json()).expect("json");
        assert_eq!(
            v["type"],
            "https://idem.dev/problems/idempotency-request-in-progress"
        );
        assert_eq!(v["status"], 409);
        assert_eq!(v["detail"], "wait");
        assert_eq!(v["code"], "idempotency-request-in-progress");
        let r = p.to_response();
        assert_eq!(r.headers()[header::RETRY_AFTER], "2");
        assert_eq!(r.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
    }

    #[test]
    fn retry_after_rounds_up_to_at_least_one_second() {
        assert_eq!(retry_after_secs(Duration::ZERO), 1);
        assert_eq!(retry_after_secs(Duration::from_millis(10)), 1);
        assert_eq!(retry_after_secs(Duration::from_secs(3)), 3);
        assert_eq!(retry_after_secs(Duration::from_millis(3001)), 4);
    }

    #[test]
    fn slugs_are_unique() {
        let slugs: std::collections::HashSet<_> =
            ProblemKind::ALL.iter().map(|k| k.slug()).collect();
        assert_eq!(slugs.len(), ProblemKind::ALL.len());
    }
}

//! [`Decision`]: what the layer decided for one request, the label of
//! `idem_requests_total{outcome}`.

/// What the layer decided, left in the response's extensions for metrics
/// and logs. Names follow the `idem_requests_total{outcome}` label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Not a protected request, or no key where none is required.
    PassThrough,
    /// Ran here for the first time.
    Executed,
    /// Answered from the store.
    Replayed,
    /// Key reused with another request.
    Mismatch,
    /// First request still running.
    InProgress,
    /// Required key absent.
    MissingKey,
    /// Malformed key (or several).
    InvalidKey,
    /// Refused before the engine: body too large or unreadable, bad tenant.
    BadRequest,
    /// Forwarded unprotected (fail-open).
    Unprotected,
    /// Store failed, request refused (fail-closed).
    StoreError,
    /// Sent upstream, outcome unknown (timeout after send).
    OutcomeUnknown,
    /// A webhook delivery refused by its signature, timestamp or id:
    /// nothing forwarded, nothing recorded.
    Unverified,
}

impl Decision {
    /// Every decision, in declaration order (`d as usize` indexes it).
    pub const ALL: [Decision; 12] = [
        Self::PassThrough,
        Self::Executed,
        Self::Replayed,
        Self::Mismatch,
        Self::InProgress,
        Self::MissingKey,
        Self::InvalidKey,
        Self::BadRequest,
        Self::Unprotected,
        Self::StoreError,
        Self::OutcomeUnknown,
        Self::Unverified,
    ];

    /// The metric label.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::PassThrough => "pass_through",
            Self::Executed => "executed",
            Self::Replayed => "replayed",
            Self::Mismatch => "mismatch",
            Self::InProgress => "in_progress",
            Self::MissingKey => "missing_key",
            Self::InvalidKey => "invalid_key",
            Self::BadRequest => "bad_request",
            Self::Unprotected => "unprotected",
            Self::StoreError => "store_error",
            Self::OutcomeUnknown => "outcome_unknown",
            Self::Unverified => "unverified",
        }
    }
}

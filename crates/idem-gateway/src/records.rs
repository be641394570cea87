//! Records as operators see them: the JSON views the admin API and the
//! `idem records` command print, the paging cursor's text form, and the
//! final answer an operator records by hand. Shared by `admin` and `cli`.

use std::time::{Duration, UNIX_EPOCH};

use axum::http::{HeaderValue, header};
use idem::fingerprint::{from_hex, to_hex};
use idem::store::Cursor;
use idem::{FinalOutcome, Record, StoredResponse, Timestamp, Verdict};
use serde::{Deserialize, Serialize};

/// Records per page when `limit` is not given.
pub const DEFAULT_PAGE: usize = 100;

/// A record as the API shows it.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct RecordView {
    /// Tenant.
    pub tenant: String,
    /// Operation (`METHOD pattern`).
    pub operation: String,
    /// The client's key.
    pub key: String,
    /// `processing`, `completed` or `failed`.
    pub state: String,
    /// Request fingerprint.
    pub fingerprint: String,
    /// RFC 3339, milliseconds.
    pub created_at: String,
    /// RFC 3339, milliseconds.
    pub updated_at: String,
    /// When a final record stops being replayed.
    pub expires_at: String,
    /// Attempt number of the current (or last) owner.
    pub attempt: u32,
    /// End of the current lease.
    pub locked_until: String,
    /// Whether the side effect may or may not have happened.
    pub outcome_unknown: bool,
    /// What the work created, if known.
    pub resource_id: Option<String>,
    /// Machine-readable reason.
    pub error_code: Option<String>,
    /// The stored answer (final records).
    pub response: Option<ResponseView>,
}

/// A stored response as the API shows it.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct ResponseView {
    /// HTTP status.
    pub status: u16,
    /// Stored headers (values as text; non-UTF-8 bytes replaced).
    pub headers: std::collections::BTreeMap<String, String>,
    /// Body size in bytes.
    pub body_bytes: usize,
    /// The body, when asked for and UTF-8.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub body: Option<String>,
    /// The body as hex, when asked for and not UTF-8.
    #[serde(skip_serializing_if = "Option::is_none", default)]
    pub body_hex: Option<String>,
}

/// RFC 3339 with milliseconds.
pub fn rfc3339(t: Timestamp) -> String {
    let ms = u64::try_from(t.as_millis()).unwrap_or(0);
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

impl RecordView {
    /// The view of `record`, with the response body if `body`.
    pub fn new(record: &Record, body: bool) -> Self {
        let response = record.response.as_ref().map(|r| {
            let text = body.then(|| std::str::from_utf8(&r.body).ok());
            ResponseView {
                status: r.status,
                headers: r
                    .headers
                    .iter()
                    .map(|(n, v)| (n.clone(), String::from_utf8_lossy(v).into_owned()))
                    .collect(),
                body_bytes: r.body.len(),
                body: text.flatten().map(str::to_owned),
                body_hex: matches!(text, Some(None)).then(|| to_hex(&r.body)),
            }
        });
        Self {
            tenant: record.scope.tenant().to_owned(),
            operation: record.scope.operation().to_owned(),
            key: record.key.as_str().to_owned(),
            state: record.state.as_str().to_owned(),
            fingerprint: record.fingerprint.to_string(),
            created_at: rfc3339(record.created_at),
            updated_at: rfc3339(record.updated_at),
            expires_at: rfc3339(record.expires_at),
            attempt: record.lease.attempt,
            locked_until: rfc3339(record.lease.locked_until),
            outcome_unknown: record.is_outcome_unknown(),
            resource_id: record.resource_id.clone(),
            error_code: record.error_code.clone(),
            response,
        }
    }
}

/// A page cursor as an opaque, URL-safe string.
pub fn encode_cursor(c: &Cursor) -> String {
    let json = serde_json::json!([c.created_at.as_millis(), c.tenant, c.operation, c.key]);
    to_hex(json.to_string().as_bytes())
}

/// Reads a cursor made by [`encode_cursor`].
pub fn decode_cursor(text: &str) -> Option<Cursor> {
    let (created_at, tenant, operation, key): (i64, String, String, String) =
        serde_json::from_slice(&from_hex(text)?).ok()?;
    Some(Cursor {
        created_at: Timestamp::from_millis(created_at),
        tenant,
        operation,
        key,
    })
}

/// The body of `POST …/resolve`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResolveRequest {
    /// `completed` or `failed`; by default from the status (< 400 completed).
    pub verdict: Option<String>,
    /// The HTTP status to replay.
    pub status: u16,
    /// Headers to replay.
    #[serde(default)]
    pub headers: std::collections::BTreeMap<String, String>,
    /// The body to replay, as text.
    #[serde(default)]
    pub body: Option<String>,
    /// The body to replay, hex-encoded (for bytes that are not UTF-8; as
    /// `show` prints them).
    #[serde(default)]
    pub body_hex: Option<String>,
    /// What the operation created.
    pub resource_id: Option<String>,
    /// Machine-readable reason (failures).
    pub error_code: Option<String>,
    /// How long to keep the answer (`24h`); the gateway's default if absent.
    pub retention: Option<String>,
}

impl ResolveRequest {
    /// The outcome to record; errors name the field.
    pub fn outcome(&self, default_retention: Duration) -> Result<FinalOutcome, InvalidParameter> {
        if !(100..=599).contains(&self.status) {
            return Err(InvalidParameter(format!(
                "status: {} is not an HTTP status",
                self.status
            )));
        }
        let verdict = match self.verdict.as_deref() {
            Some("completed") => Verdict::Completed,
            Some("failed") => Verdict::Failed,
            Some(other) => {
                return Err(InvalidParameter(format!(
                    "verdict: {other:?} is not completed or failed"
                )));
            }
            None if self.status < 400 => Verdict::Completed,
            None => Verdict::Failed,
        };
        let body = match (&self.body, &self.body_hex) {
            (Some(_), Some(_)) => {
                return Err(InvalidParameter(
                    "body, body_hex: give one or the other".to_owned(),
                ));
            }
            (Some(text), None) => text.clone().into_bytes(),
            (None, Some(hex)) => from_hex(hex)
                .ok_or_else(|| "body_hex: not an even number of hex digits".to_owned())?,
            (None, None) => Vec::new(),
        };
        let mut response = StoredResponse::new(self.status, body);
        for (name, value) in &self.headers {
            header::HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| format!("headers: {name:?} is not a header name"))?;
            if !idem_http::replayable(name) {
                return Err(InvalidParameter(format!(
                    "headers: {name:?} is never stored: a replay frames its own body, and connection, cookie and authentication headers belong to one caller"
                )));
            }
            HeaderValue::from_str(value)
                .map_err(|_| format!("headers: the value of {name:?} is not a header value"))?;
            response = response.with_header(name, value.clone().into_bytes());
        }
        let retention = match &self.retention {
            None => default_retention,
            Some(text) => humantime::parse_duration(text)
                .ok()
                .filter(|d| !d.is_zero())
                .ok_or_else(|| format!("retention: {text:?} is not a duration like 24h"))?,
        };
        Ok(FinalOutcome {
            verdict,
            response,
            resource_id: self.resource_id.clone(),
            error_code: self.error_code.clone(),
            retention,
        })
    }
}

/// Why a parameter of an operator's request (a list filter, an answer
/// recorded by hand in a [`ResolveRequest`]) was refused: the field and
/// what it should be.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidParameter(String);

impl From<String> for InvalidParameter {
    fn from(why: String) -> Self {
        Self(why)
    }
}

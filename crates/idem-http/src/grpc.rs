//! gRPC requests: a unary call is one `POST /package.Service/Method` over
//! HTTP/2 whose answer is `200` whatever happened; what happened is the
//! `grpc-status` in its trailers (or its headers, in a trailers-only
//! answer). A gRPC request's answer is judged by that status, and every
//! answer the layer makes itself is a trailers-only answer with a gRPC
//! status, which a gRPC client reads, never problem+json, which it cannot.
//!
//! ```
//! use http::HeaderMap;
//! use idem_http::grpc;
//! use idem_http::{Problem, ProblemKind};
//!
//! let mut trailers = HeaderMap::new();
//! trailers.insert("grpc-status", "14".parse()?);
//! assert_eq!(grpc::status(&HeaderMap::new(), Some(&trailers)), Some(grpc::UNAVAILABLE));
//! // Judged as a 503: released by the default policy, run by the retry.
//! assert_eq!(grpc::judged_status(Some(grpc::UNAVAILABLE)), 503);
//!
//! let refused = grpc::refusal(&Problem::new(ProblemKind::KeyReused, "another request"));
//! assert_eq!(refused.headers()["grpc-status"], "9"); // FAILED_PRECONDITION
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode, header};
use http_body_util::Full;

use crate::{Problem, ProblemKind, ResponseBody};

/// The trailer (or trailers-only header) holding a call's status code.
pub const GRPC_STATUS: HeaderName = HeaderName::from_static("grpc-status");
/// Its message, percent-encoded.
pub const GRPC_MESSAGE: HeaderName = HeaderName::from_static("grpc-message");
/// The client's deadline for the call (`500m`, `30S`).
pub const GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");
/// How long a client retrying by its service config waits before the
/// next attempt, in milliseconds (gRFC A6's server pushback).
pub const GRPC_RETRY_PUSHBACK: HeaderName = HeaderName::from_static("grpc-retry-pushback-ms");
/// The problem code of a refusal, as metadata, for clients that read a
/// machine code beyond the status (`idempotency-key-reused`).
pub const IDEM_PROBLEM: HeaderName = HeaderName::from_static("idem-problem");

/// `OK`.
pub const OK: u8 = 0;
/// `CANCELLED`.
pub const CANCELLED: u8 = 1;
/// `UNKNOWN`.
pub const UNKNOWN: u8 = 2;
/// `INVALID_ARGUMENT`.
pub const INVALID_ARGUMENT: u8 = 3;
/// `DEADLINE_EXCEEDED`.
pub const DEADLINE_EXCEEDED: u8 = 4;
/// `NOT_FOUND`.
pub const NOT_FOUND: u8 = 5;
/// `ALREADY_EXISTS`.
pub const ALREADY_EXISTS: u8 = 6;
/// `PERMISSION_DENIED`.
pub const PERMISSION_DENIED: u8 = 7;
/// `RESOURCE_EXHAUSTED`.
pub const RESOURCE_EXHAUSTED: u8 = 8;
/// `FAILED_PRECONDITION`.
pub const FAILED_PRECONDITION: u8 = 9;
/// `ABORTED`.
pub const ABORTED: u8 = 10;
/// `OUT_OF_RANGE`.
pub const OUT_OF_RANGE: u8 = 11;
/// `UNIMPLEMENTED`.
pub const UNIMPLEMENTED: u8 = 12;
/// `INTERNAL`.
pub const INTERNAL: u8 = 13;
/// `UNAVAILABLE`.
pub const UNAVAILABLE: u8 = 14;
/// `DATA_LOSS`.
pub const DATA_LOSS: u8 = 15;
/// `UNAUTHENTICATED`.
pub const UNAUTHENTICATED: u8 = 16;

/// Whether a request (or answer) is gRPC: its `Content-Type` is
/// `application/grpc`, or one of its `+proto`, `+json` forms.
pub fn is_grpc(headers: &HeaderMap) -> bool {
    // On every request, gRPC or not: the bytes are compared, never parsed.
    const GRPC: &[u8] = b"application/grpc";
    headers.get(header::CONTENT_TYPE).is_some_and(|v| {
        let ct = v.as_bytes();
        ct.len() >= GRPC.len()
            && ct[..GRPC.len()].eq_ignore_ascii_case(GRPC)
            && matches!(ct.get(GRPC.len()), None | Some(b'+' | b';' | b' '))
    })
}

/// An answer's status code: from its trailers, else (a trailers-only
/// answer) from its headers; `None` when neither has one that reads.
pub fn status(headers: &HeaderMap, trailers: Option<&HeaderMap>) -> Option<u8> {
    trailers
        .and_then(|t| t.get(GRPC_STATUS))
        .or_else(|| headers.get(GRPC_STATUS))
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u8>().ok())
}

/// The HTTP status a gRPC status counts as, for the route's policy to
/// decide what becomes of the key (Google's canonical mapping, except as
/// noted):
///
/// - `OK` is `200`: stored and replayed;
/// - `UNAVAILABLE` is `503` and `RESOURCE_EXHAUSTED` `429`, released by
///   the default `release_statuses`, as gRPC's own retry policies retry
///   them; so are `UNAUTHENTICATED` (`401`), `PERMISSION_DENIED`
///   (`403`), and `ABORTED` and `ALREADY_EXISTS` (`409`), after which
///   nothing ran for this call;
/// - `DEADLINE_EXCEEDED` is `504`, held by default: the call may have
///   run;
/// - `UNKNOWN`, `INTERNAL`, `DATA_LOSS` and `CANCELLED` are `500`
///   (`CANCELLED` is `499` in Google's table: here it does not prove the
///   call did not run), so the route's `on_server_error` decides: held
///   on a gRPC route unless it says otherwise; so is `UNIMPLEMENTED`
///   (`501`);
/// - the other statuses are `4xx`, stored as the call's final failure;
/// - no status at all (`None`), or one past 16, is `500`: an answer that
///   does not say what became of the call.
pub const fn judged_status(code: Option<u8>) -> u16 {
    match code {
        Some(OK) => 200,
        Some(INVALID_ARGUMENT | FAILED_PRECONDITION | OUT_OF_RANGE) => 400,
        Some(UNAUTHENTICATED) => 401,
        Some(PERMISSION_DENIED) => 403,
        Some(NOT_FOUND) => 404,
        Some(ALREADY_EXISTS | ABORTED) => 409,
        Some(RESOURCE_EXHAUSTED) => 429,
        Some(UNIMPLEMENTED) => 501,
        Some(UNAVAILABLE) => 503,
        Some(DEADLINE_EXCEEDED) => 504,
        _ => 500,
    }
}

/// The gRPC status of each refusal: what a gRPC client acts on.
pub const fn status_code(kind: ProblemKind) -> u8 {
    match kind {
        ProblemKind::KeyMissing
        | ProblemKind::KeyInvalid
        | ProblemKind::KeyAmbiguous
        | ProblemKind::BodyUnreadable
        | ProblemKind::BodyEncoding
        | ProblemKind::BodyAmbiguous
        | ProblemKind::HostInvalid
        | ProblemKind::PathNotCanonical
        | ProblemKind::TenantInvalid => INVALID_ARGUMENT,
        ProblemKind::KeyReused => FAILED_PRECONDITION,
        // In flight, being looked up, or held: another attempt of this
        // call is (or may be) under way; the detail says which.
        ProblemKind::InProgress | ProblemKind::OutcomeReconciling | ProblemKind::OutcomeHeld => {
            ABORTED
        }
        ProblemKind::BodyTooLarge => RESOURCE_EXHAUSTED,
        ProblemKind::BodyTimeout | ProblemKind::UpstreamTimeout => DEADLINE_EXCEEDED,
        ProblemKind::TenantMissing => UNAUTHENTICATED,
        ProblemKind::TenantUntrusted => PERMISSION_DENIED,
        ProblemKind::Overloaded
        | ProblemKind::StoreUnavailable
        | ProblemKind::UpstreamUnreachable
        | ProblemKind::UpstreamTls => UNAVAILABLE,
        // The answer broke off after the call was sent, or was not kept:
        // what became of the call is not in this answer.
        ProblemKind::UpstreamBroken | ProblemKind::ResponseNotRetained => UNKNOWN,
        _ => INTERNAL,
    }
}

/// The trailers-only answer to a gRPC call the layer refused or could
/// not run: `200`, `content-type: application/grpc`, and in the headers
/// `grpc-status` ([`status_code`]), `grpc-message` (the problem's title
/// and detail, percent-encoded), `idem-problem` (the problem's code) and,
/// where the problem has a retry hint, `grpc-retry-pushback-ms` and
/// `retry-after`. No message: nothing ran for it.
pub fn refusal(problem: &Problem) -> Response<Full<Bytes>> {
    let code = problem.kind().map_or(INTERNAL, status_code);
    let mut resp = Response::new(Full::new(Bytes::new()));
    *resp.status_mut() = StatusCode::OK;
    let headers = resp.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/grpc"),
    );
    headers.insert(GRPC_STATUS, HeaderValue::from(u16::from(code)));
    let message = percent_encode(&format!("{}: {}", problem.title(), problem.detail()));
    if let Ok(message) = HeaderValue::from_str(&message) {
        headers.insert(GRPC_MESSAGE, message);
    }
    if let Ok(slug) = HeaderValue::from_str(problem.slug()) {
        headers.insert(IDEM_PROBLEM, slug);
    }
    if let Some(after) = problem.retry_after() {
        let millis = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
        headers.insert(GRPC_RETRY_PUSHBACK, HeaderValue::from(millis));
        headers.insert(
            header::RETRY_AFTER,
            HeaderValue::from(crate::retry_after_secs(after)),
        );
    }
    resp
}

/// The answer to a gRPC call: one the layer, or the gateway around it,
/// said as a problem becomes its [`refusal`]; any other is the
/// service's.
pub fn answer<B>(resp: Response<ResponseBody<B>>) -> Response<ResponseBody<B>> {
    ResponseBody::restate(resp, refusal)
}

/// `grpc-message`'s encoding: every byte outside printable ASCII, and
/// `%`, as `%XX`.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The call's deadline from its `grpc-timeout` (`<up to 8 digits><unit>`,
/// the unit one of `H`, `M`, `S`, `m`, `u`, `n`); `None` when it has none
/// or one that does not read.
pub fn timeout(headers: &HeaderMap) -> Option<Duration> {
    let text = headers.get(GRPC_TIMEOUT)?.to_str().ok()?;
    let (digits, unit) = text.split_at(text.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    HeaderName::from_bytes(k.as_bytes()).expect("name"),
                    HeaderValue::from_str(v).expect("value"),
                )
            })
            .collect()
    }

    #[test]
    fn grpc_requests_are_told_by_their_content_type() {
        for ct in [
            "application/grpc",
            "application/grpc+proto",
            "Application/GRPC+json; charset=utf-8",
        ] {
            assert!(is_grpc(&headers(&[("content-type", ct)])), "{ct}");
        }
        for ct in ["application/grpc-web", "application/json", "text/plain"] {
            assert!(!is_grpc(&headers(&[("content-type", ct)])), "{ct}");
        }
        assert!(!is_grpc(&HeaderMap::new()));
        // Its frames are fingerprinted as sent, never parsed as JSON.
        assert!(!crate::is_json(&headers(&[(
            "content-type",
            "application/grpc+json"
        )])));
    }

    #[test]
    fn the_status_is_read_from_trailers_then_headers() {
        let trailers = headers(&[("grpc-status", "5")]);
        let only = headers(&[("grpc-status", "14")]);
        assert_eq!(status(&only, Some(&trailers)), Some(NOT_FOUND));
        assert_eq!(status(&only, None), Some(UNAVAILABLE));
        assert_eq!(status(&HeaderMap::new(), None), None);
        assert_eq!(
            status(&headers(&[("grpc-status", "x")]), None),
            None,
            "unreadable"
        );
    }

    #[test]
    fn statuses_weigh_as_grpcs_retry_semantics_say() {
        assert_eq!(judged_status(Some(OK)), 200);
        assert_eq!(judged_status(Some(UNAVAILABLE)), 503);
        assert_eq!(judged_status(Some(DEADLINE_EXCEEDED)), 504);
        assert_eq!(judged_status(Some(UNKNOWN)), 500);
        assert_eq!(judged_status(Some(CANCELLED)), 500);
        assert_eq!(judged_status(Some(INVALID_ARGUMENT)), 400);
        assert_eq!(judged_status(Some(99)), 500);
        assert_eq!(judged_status(None), 500);
    }

    #[test]
    fn refusals_are_trailers_only_answers() {
        let p = Problem::new(ProblemKind::InProgress, "still running: 100% of it")
            .with_retry_after(Duration::from_millis(1500));
        let resp = refusal(&p);
        assert_eq!(resp.status(), StatusCode::OK);
        let h = resp.headers();
        assert_eq!(h["content-type"], "application/grpc");
        assert_eq!(h["grpc-status"], "10");
        assert_eq!(h["grpc-retry-pushback-ms"], "1500");
        assert_eq!(h["retry-after"], "2");
        assert_eq!(h["idem-problem"], "idempotency-request-in-progress");
        let message = h["grpc-message"].to_str().expect("ascii");
        assert!(
            message.ends_with("still running: 100%25 of it"),
            "{message}"
        );
        assert_eq!(crate::full_body(resp.into_body()).len(), 0);
        for (kind, code) in [
            (ProblemKind::KeyReused, FAILED_PRECONDITION),
            (ProblemKind::KeyMissing, INVALID_ARGUMENT),
            (ProblemKind::OutcomeHeld, ABORTED),
            (ProblemKind::StoreUnavailable, UNAVAILABLE),
            (ProblemKind::UpstreamTimeout, DEADLINE_EXCEEDED),
        ] {
            let resp = refusal(&Problem::new(kind, "x"));
            assert_eq!(resp.headers()["grpc-status"], code.to_string().as_str());
        }
    }

    #[test]
    fn deadlines_read_as_grpc_writes_them() {
        let t = |v: &str| timeout(&headers(&[("grpc-timeout", v)]));
        assert_eq!(t("500m"), Some(Duration::from_millis(500)));
        assert_eq!(t("2S"), Some(Duration::from_secs(2)));
        assert_eq!(t("1H"), Some(Duration::from_secs(3600)));
        assert_eq!(t("99999999n"), Some(Duration::from_nanos(99_999_999)));
        for bad in ["", "S", "123456789S", "5s", "-1S", "1.5S"] {
            assert_eq!(t(bad), None, "{bad}");
        }
    }
}

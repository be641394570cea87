//! Reading what identifies a request: its key, its tenant, its fingerprint.
//!
//! ```
//! use http::Request;
//! use idem_http::{TenantSource, TenantExtractor, idempotency_key};
//!
//! let req = Request::post("/v1/payments")
//!     .header("idempotency-key", "\"order-7\"")   // structured-field string
//!     .header("authorization", "Bearer sk_test_1")
//!     .body(())
//!     .unwrap();
//! let (parts, _) = req.into_parts();
//! assert_eq!(idempotency_key(&parts.headers).unwrap().unwrap().as_str(), "order-7");
//! let tenant = TenantSource::Authorization.tenant(&parts).unwrap();
//! assert_eq!(tenant.len(), 64); // sha256 of the credential, never the credential
//! ```

use http::header::{self, HeaderMap, HeaderName};
use http::request::Parts;
use idem::{Fingerprint, IdempotencyKey};
use sha2::{Digest, Sha256};

use crate::{Problem, ProblemKind};

/// The request header carrying the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Reads the `Idempotency-Key` header: `Ok(None)` when absent, the key when
/// well-formed (bare token, or structured-field string `"…"`), a problem
/// when malformed or sent more than once.
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, Problem> {
    let mut values = headers.get_all(&IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(Problem::new(
            ProblemKind::KeyAmbiguous,
            "the request has more than one Idempotency-Key header; send exactly one",
        ));
    }
    let raw = value.as_bytes();
    let token = match raw.first() {
        Some(b'"') => sf_string(raw)?,
        _ => raw.to_vec(),
    };
    IdempotencyKey::from_bytes(&token)
        .map(Some)
        .map_err(|e| Problem::new(ProblemKind::KeyInvalid, e.to_string()))
}

/// Unquotes an RFC 8941 item whose value is a string (`"…"` with `\"` and
/// `\\` escapes); its parameters (`;name` or `;name=value`, as the IETF
/// draft allows) are checked for form and ignored.
fn sf_string(raw: &[u8]) -> Result<Vec<u8>, Problem> {
    let bad = |why: &str| {
        Problem::new(
            ProblemKind::KeyInvalid,
            format!("Idempotency-Key is not a valid structured-field string: {why}"),
        )
    };
    let mut out = Vec::with_capacity(raw.len());
    let mut bytes = raw.iter().skip(1);
    loop {
        match bytes.next() {
            None => return Err(bad("missing closing quote")),
            Some(b'\\') => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err(bad("a backslash must escape '\"' or '\\'")),
            },
            Some(b'"') => break,
            Some(&b) => out.push(b),
        }
    }
    let rest: Vec<u8> = bytes.copied().collect();
    if !sf_parameters(&rest) {
        return Err(bad(
            "after the closing quote only parameters may follow (;name or ;name=value)",
        ));
    }
    Ok(out)
}

/// Whether `rest` is a list of RFC 8941 parameters: `*( ";" *SP key [ "="
/// bare-item ] )`, a key being `( lcalpha / "*" ) *( lcalpha / DIGIT / "_"
/// / "-" / "." / "*" )`. Values are checked loosely (a quoted string, or a
/// token of visible characters); they are ignored either way.
fn sf_parameters(mut rest: &[u8]) -> bool {
    while !rest.is_empty() {
        let Some(after) = rest.strip_prefix(b";") else {
            return false;
        };
        rest = after.trim_ascii_start();
        let key_len = rest
            .iter()
            .position(|b| !(b.is_ascii_lowercase() || b.is_ascii_digit() || b"_-.*".contains(b)))
            .unwrap_or(rest.len());
        if key_len == 0 || !(rest[0].is_ascii_lowercase() || rest[0] == b'*') {
            return false;
        }
        rest = &rest[key_len..];
        let Some(value) = rest.strip_prefix(b"=") else {
            continue;
        };
        let end = if value.first() == Some(&b'"') {
            let mut i = 1;
            loop {
                match value.get(i) {
                    None => return false,
                    Some(b'\\') => i += 2,
                    Some(b'"') => break i + 1,
                    Some(_) => i += 1,
                }
            }
        } else {
            value.iter().position(|b| *b == b';').unwrap_or(value.len())
        };
        if end == 0 || !value[..end].iter().all(|b| (0x20..0x7f).contains(b)) {
            return false;
        }
        rest = &value[end..];
    }
    true
}

/// Decides which tenant a request belongs to. Tenants come from
/// authenticated context, never from the body.
pub trait TenantExtractor: Send + Sync + 'static {
    /// The tenant of this request, or the problem to answer.
    fn tenant(&self, parts: &Parts) -> Result<String, Problem>;

    /// The headers of this request that carry the tenant's credential,
    /// sent with a lookup made on the tenant's behalf (settling a held
    /// record, [`crate::Lookup`]). Kept in memory only, never stored.
    /// Default: none.
    fn credentials(&self, parts: &Parts) -> HeaderMap {
        let _ = parts;
        HeaderMap::new()
    }

    /// Whether a lookup needs [`credentials`](Self::credentials): if so, a
    /// held record found without them (its process died) waits for its
    /// client's retry to bring them. Default: no.
    fn needs_credentials(&self) -> bool {
        false
    }
}

/// The built-in tenant sources (the gateway's `[tenant] from = …`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantSource {
    /// SHA-256 (hex) of the `Authorization` value: each credential is its
    /// own tenant and the credential itself is never stored. Requests
    /// without `Authorization` share the tenant `anonymous`.
    Authorization,
    /// The value of a header set by a trusted authenticating proxy; a
    /// request without it is refused.
    Header(HeaderName),
    /// One tenant for everything.
    Single(String),
}

/// The tenant of requests that carry no `Authorization` header.
pub const ANONYMOUS_TENANT: &str = "anonymous";

impl TenantExtractor for TenantSource {
    fn credentials(&self, parts: &Parts) -> HeaderMap {
        let name = match self {
            Self::Authorization => header::AUTHORIZATION,
            Self::Header(name) => name.clone(),
            Self::Single(_) => return HeaderMap::new(),
        };
        let mut out = HeaderMap::new();
        for v in parts.headers.get_all(&name) {
            out.append(name.clone(), v.clone());
        }
        out
    }

    fn needs_credentials(&self) -> bool {
        !matches!(self, Self::Single(_))
    }

    fn tenant(&self, parts: &Parts) -> Result<String, Problem> {
        match self {
            Self::Authorization => Ok(match parts.headers.get(header::AUTHORIZATION) {
                Some(v) => idem::fingerprint::to_hex(&Sha256::digest(v.as_bytes())),
                None => ANONYMOUS_TENANT.to_owned(),
            }),
            Self::Header(name) => {
                let mut values = parts.headers.get_all(name).iter();
                match (values.next(), values.next()) {
                    (Some(v), None) => v
                        .to_str()
                        .ok()
                        .filter(|s| !s.is_empty())
                        .map(str::to_owned)
                        .ok_or_else(|| {
                            Problem::new(
                                ProblemKind::TenantInvalid,
                                format!("the {name} header must be non-empty visible ASCII"),
                            )
                        }),
                    (None, _) => Err(Problem::new(
                        ProblemKind::TenantInvalid,
                        format!("the {name} header is required to identify the tenant"),
                    )),
                    (Some(_), Some(_)) => Err(Problem::new(
                        ProblemKind::TenantInvalid,
                        format!("more than one {name} header"),
                    )),
                }
            }
            Self::Single(tenant) => Ok(tenant.clone()),
        }
    }
}

/// Whether a `Content-Type` names JSON (`application/json`, `…+json`).
pub fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|ct| {
            ct.split(';')
                .next()
                .unwrap_or("")
                .trim()
                .to_ascii_lowercase()
        })
        .is_some_and(|mime| {
            mime == "application/json"
                || (mime.starts_with("application/") && mime.ends_with("+json"))
        })
}

/// The request fingerprint: method, operation, the sorted query, the
/// chosen headers (all values, in order), and the body — canonical JSON
/// when the content type is JSON, bytes otherwise. A JSON body that is not
/// UTF-8 is refused (JSON text is UTF-8 by definition); one that does not
/// parse is hashed as bytes and left for the upstream to judge.
pub fn fingerprint(
    parts: &Parts,
    operation: &str,
    headers: &[HeaderName],
    body: &[u8],
) -> Result<Fingerprint, Problem> {
    let mut query: Vec<&str> = parts
        .uri
        .query()
        .map(|q| q.split('&').filter(|p| !p.is_empty()).collect())
        .unwrap_or_default();
    query.sort_unstable();
    let mut fp = Fingerprint::builder()
        .part("method", parts.method.as_str().as_bytes())
        .part("operation", operation.as_bytes())
        .part("query", query.join("&").as_bytes());
    for name in headers {
        for value in parts.headers.get_all(name) {
            fp = fp.part(name.as_str(), value.as_bytes());
        }
    }
    Ok(if is_json(&parts.headers) {
        if std::str::from_utf8(body).is_err() {
            return Err(Problem::new(
                ProblemKind::BodyEncoding,
                "the body is declared as JSON but is not valid UTF-8",
            ));
        }
        // Parsed once: canonicalised, and refused when two readers could
        // read it as different documents (the upstream may read it as the
        // one the fingerprint did not).
        match idem::canonical_json_strict(body) {
            Ok(canonical) => fp
                .body_digest(idem::BodyKind::Json, Sha256::digest(&canonical).into())
                .finish(),
            Err(idem::JsonRefusal::NotJson) => fp.bytes_body(body).finish(),
            Err(why) => {
                return Err(Problem::new(
                    ProblemKind::BodyAmbiguous,
                    format!("the JSON body is ambiguous: {why}; nothing was forwarded"),
                ));
            }
        }
    } else {
        fp.bytes_body(body).finish()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    #[test]
    fn ambiguous_json_is_refused_and_plain_json_keeps_its_fingerprint() {
        let json = |body: &str| {
            let p = parts(|b| b.header("content-type", "application/json"));
            fingerprint(&p, "POST /v1/payments", &[], body.as_bytes())
        };
        for (body, why) in [
            (r#"{"a":1,"a":2}"#, "appears twice"),
            (r#"{"x":{"to":"alice","to":"mallory"}}"#, "appears twice"),
            (r#"[{"n":9007199254740993}]"#, "beyond"),
            (r#"{"n":-9007199254740993}"#, "beyond"),
        ] {
            let p = json(body).expect_err(body);
            assert_eq!(p.kind(), ProblemKind::BodyAmbiguous, "{body}");
            assert!(p.detail().contains(why), "{body}: {}", p.detail());
        }
        // Safe integers, floats and the same document reordered are fine
        // and fingerprint as before (the canonical JSON's digest).
        let a = json(r#"{"n":9007199254740992,"f":1.5,"s":"x"}"#).expect("safe");
        let b = json(r#"{ "s":"x", "f":1.5, "n":9007199254740992 }"#).expect("safe");
        assert_eq!(a, b);
        let p = parts(|b| b.header("content-type", "application/json"));
        let via_builder = Fingerprint::builder()
            .part("method", b"POST")
            .part("operation", b"POST /v1/payments")
            .part("query", b"a=1&b=2")
            .json_body(br#"{"n":9007199254740992,"f":1.5,"s":"x"}"#)
            .finish();
        assert_eq!(
            fingerprint(
                &p,
                "POST /v1/payments",
                &[],
                br#"{"n":9007199254740992,"f":1.5,"s":"x"}"#
            )
            .expect("fp"),
            via_builder
        );
        // Not JSON at all: its bytes, as before.
        assert!(json("{not json").is_ok());
    }

    fn parts(build: impl FnOnce(http::request::Builder) -> http::request::Builder) -> Parts {
        build(Request::post("/v1/payments?b=2&a=1"))
            .body(())
            .expect("request")
            .into_parts()
            .0
    }

    fn key_of(value: &[u8]) -> Result<Option<IdempotencyKey>, Problem> {
        let p = parts(|b| {
            b.header(
                "idempotency-key",
                http::HeaderValue::from_bytes(value).expect("header"),
            )
        });
        idempotency_key(&p.headers)
    }

    #[test]
    fn bare_and_structured_keys() {
        assert_eq!(
            key_of(b"abc-123").expect("ok").expect("some").as_str(),
            "abc-123"
        );
        assert_eq!(
            key_of(b"\"abc-123\"").expect("ok").expect("some").as_str(),
            "abc-123"
        );
        assert_eq!(
            key_of(br#""a\"b\\c""#).expect("ok").expect("some").as_str(),
            r#"a"b\c"#
        );
        assert_eq!(idempotency_key(&HeaderMap::new()).expect("ok"), None);
        // Item parameters are allowed by the draft and ignored.
        for value in [
            &br#""abc-123";v=1"#[..],
            br#""abc-123"; origin="web;app""#,
            br#""abc-123";a;b=tok;*c=2.5"#,
        ] {
            assert_eq!(
                key_of(value).expect("parameters").expect("some").as_str(),
                "abc-123",
                "{}",
                String::from_utf8_lossy(value)
            );
        }
    }

    #[test]
    fn malformed_keys_are_problems() {
        for (value, kind) in [
            (&b"\"\""[..], ProblemKind::KeyInvalid),
            (b"\"abc", ProblemKind::KeyInvalid),
            (b"\"a\\nb\"", ProblemKind::KeyInvalid),
            (b"\"a b\"", ProblemKind::KeyInvalid),
            (b"\"a\"b\"", ProblemKind::KeyInvalid),
            (b"\"a\";", ProblemKind::KeyInvalid),
            (b"\"a\";V=1", ProblemKind::KeyInvalid),
            (b"\"a\";v=", ProblemKind::KeyInvalid),
            (b"\"a\";v=\"open", ProblemKind::KeyInvalid),
            (b"\"a\" junk", ProblemKind::KeyInvalid),
            (b"caf\xc3\xa9", ProblemKind::KeyInvalid),
        ] {
            let err = key_of(value).expect_err("invalid");
            assert_eq!(err.kind(), kind, "{value:?}");
            assert_eq!(err.status(), 400);
        }
        let long = vec![b'k'; 256];
        assert!(
            key_of(&long)
                .expect_err("too long")
                .detail()
                .contains("256")
        );
    }

    #[test]
    fn two_key_headers_are_ambiguous() {
        let p = parts(|b| {
            b.header("idempotency-key", "a")
                .header("idempotency-key", "a")
        });
        assert_eq!(
            idempotency_key(&p.headers).expect_err("two").kind(),
            ProblemKind::KeyAmbiguous
        );
    }

    #[test]
    fn tenants() {
        let with_auth = parts(|b| b.header("authorization", "Bearer one"));
        let other = parts(|b| b.header("authorization", "Bearer two"));
        let t1 = TenantSource::Authorization
            .tenant(&with_auth)
            .expect("tenant");
        assert_ne!(
            t1,
            TenantSource::Authorization.tenant(&other).expect("tenant")
        );
        assert!(!t1.contains("one"));
        assert_eq!(
            TenantSource::Authorization
                .tenant(&parts(|b| b))
                .expect("tenant"),
            ANONYMOUS_TENANT
        );
        let by_header = TenantSource::Header(HeaderName::from_static("x-tenant-id"));
        assert_eq!(
            by_header
                .tenant(&parts(|b| b.header("x-tenant-id", "acme")))
                .expect("tenant"),
            "acme"
        );
        assert_eq!(
            by_header.tenant(&parts(|b| b)).expect_err("missing").kind(),
            ProblemKind::TenantInvalid
        );
        assert_eq!(
            TenantSource::Single("one".into())
                .tenant(&parts(|b| b))
                .expect("tenant"),
            "one"
        );
    }

    #[test]
    fn fingerprint_ignores_query_order_and_json_layout() {
        let json =
            |b: http::request::Builder| b.header("content-type", "application/json; charset=utf-8");
        let a = fingerprint(
            &parts(json),
            "POST /v1/payments",
            &[header::CONTENT_TYPE],
            br#"{"a":1,"b":[1,2]}"#,
        )
        .expect("fp");
        let mut reordered = parts(json);
        reordered.uri = "/v1/payments?a=1&b=2".parse().expect("uri");
        let b = fingerprint(
            &reordered,
            "POST /v1/payments",
            &[header::CONTENT_TYPE],
            b"{ \"b\": [1, 2], \"a\": 1.0 }",
        )
        .expect("fp");
        assert_eq!(a, b);
        let c = fingerprint(
            &parts(json),
            "POST /v1/payments",
            &[header::CONTENT_TYPE],
            br#"{"a":2,"b":[1,2]}"#,
        )
        .expect("fp");
        assert_ne!(a, c);
        let other_op = fingerprint(
            &parts(json),
            "POST /v1/refunds",
            &[header::CONTENT_TYPE],
            br#"{"a":1,"b":[1,2]}"#,
        )
        .expect("fp");
        assert_ne!(a, other_op);
    }

    #[test]
    fn json_that_is_not_utf8_is_refused() {
        let p = parts(|b| b.header("content-type", "application/merchant+json"));
        let err = fingerprint(&p, "op", &[], b"{\"a\":\"\xff\"}").expect_err("not utf-8");
        assert_eq!(err.kind(), ProblemKind::BodyEncoding);
        // Not JSON: any bytes are fine.
        let p = parts(|b| b.header("content-type", "application/octet-stream"));
        assert!(fingerprint(&p, "op", &[], b"\xff\xfe").is_ok());
    }
}

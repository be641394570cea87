//! The fingerprint: which parts of a request it covers, hashed under the
//! deployment's secret ([`Hashing`]), and the forms records written
//! earlier were keyed with.

use std::sync::Arc;
use std::time::SystemTime;

use http::header::{self, HeaderMap, HeaderName};
use http::request::Parts;
use idem::json::Value;
use idem::{Fingerprint, HashSecret};
use sha2::{Digest, Sha256};

use super::tenant::Tenant;
use crate::{BodyFields, Problem, ProblemKind};

/// Whether a `Content-Type` names JSON (`application/json`, `…+json`);
/// not `application/grpc+json`, whose body is length-prefixed gRPC
/// frames (fingerprinted as the bytes sent), whatever their encoding.
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
                || (mime.starts_with("application/")
                    && mime.ends_with("+json")
                    && !mime.starts_with("application/grpc+"))
        })
}

/// How tenants and fingerprints are hashed: under the deployment's
/// [`HashSecret`] (`v3:` fingerprints, keyed credential tenants), and for
/// how long records written before it are still looked for.
///
/// Without a secret ([`Hashing::unkeyed`], the library's default) tenants
/// are the unkeyed SHA-256 of the credential and fingerprints unkeyed
/// (`v1:`) over the same request parts (the path included): someone who
/// reads the store can then test guesses of a credential or a small body
/// against them. Set a secret on any deployment whose store others can
/// read, or whose logs leave the machine.
#[derive(Debug, Clone, Default)]
pub struct Hashing {
    secret: Option<Arc<HashSecret>>,
    accept_v1_until: Option<SystemTime>,
}

impl Hashing {
    /// Unkeyed: SHA-256 (`v1:` fingerprints).
    pub fn unkeyed() -> Self {
        Self::default()
    }

    /// Keyed under `secret`.
    pub fn keyed(secret: Arc<HashSecret>) -> Self {
        Self {
            secret: Some(secret),
            accept_v1_until: None,
        }
    }

    /// Until `until`, also finds records written by versions before this
    /// one (before keyed hashing, and before the path was part of the
    /// fingerprint), under their unkeyed tenant and their fingerprint of
    /// method, operation, sorted query, headers and body
    /// ([`idem::Engine::begin_accepting_v1`]), at the cost of one store read
    /// per fresh reservation. Set it to when the last such record expires:
    /// the upgrade plus the longest retention.
    pub fn accept_v1_until(mut self, until: SystemTime) -> Self {
        self.accept_v1_until = Some(until);
        self
    }

    /// Whether a secret keys the hashes.
    pub fn is_keyed(&self) -> bool {
        self.secret.is_some()
    }

    /// Whether records written by earlier versions are looked for now.
    pub fn accepts_v1(&self) -> bool {
        self.accept_v1_until.is_some_and(|u| SystemTime::now() < u)
    }

    /// The tenant string of `tenant`.
    pub fn tenant(&self, tenant: &Tenant<'_>) -> String {
        match (tenant, &self.secret) {
            (Tenant::Credential(c), Some(secret)) => secret.tenant(c),
            (Tenant::Credential(c), None) => idem::fingerprint::unkeyed_tenant(c),
            (Tenant::Identity(id), _) => id.clone().into_owned(),
        }
    }

    /// The fingerprint of a request whose body is `body` (see
    /// [`fingerprints`]).
    pub fn fingerprint(
        &self,
        parts: &Parts,
        path: &str,
        operation: &str,
        headers: &[HeaderName],
        body: &[u8],
    ) -> Result<Fingerprint, Problem> {
        fingerprints(
            self,
            parts,
            path,
            operation,
            headers,
            &BodyFields::All,
            body,
        )
        .map(|(fp, _)| fp)
    }
}

/// A request's fingerprint, and (while [`Hashing::accepts_v1`]) the
/// one versions before keyed hashing gave it.
///
/// Over method, operation, the concrete [normalised](crate::normalize_path)
/// `path` (so one key on another resource is a different request), the
/// query with repeated parameters in the order sent, the chosen headers
/// (all values, in order), and the body: canonical JSON when the content
/// type is JSON (only the `fields` chosen; numbers by exact decimal
/// value), bytes otherwise; keyed (`v3:`) with a secret, SHA-256 (`v1:`)
/// without. The earlier form: the same without the path, the query's
/// parameters sorted, the whole body, its numbers read as doubles,
/// unkeyed.
///
/// A JSON body that is not UTF-8 is refused (JSON text is UTF-8 by
/// definition), and so is one two readers could read as different
/// documents (`400 request-body-ambiguous-json`); one that does not parse,
/// or whose numbers have no canonical form, is hashed as bytes and left
/// for the upstream to judge. The body is parsed once for both
/// fingerprints.
pub fn fingerprints(
    hashing: &Hashing,
    parts: &Parts,
    path: &str,
    operation: &str,
    headers: &[HeaderName],
    fields: &BodyFields,
    body: &[u8],
) -> Result<(Fingerprint, Option<Fingerprint>), Problem> {
    let accepts_v1 = hashing.accepts_v1();
    let (body, whole_doubles) = body_digests(parts, body, fields, accepts_v1)?;
    let builder = match &hashing.secret {
        Some(secret) => idem::FingerprintBuilder::keyed(secret),
        None => Fingerprint::builder(),
    };
    let current = current_form(builder, parts, path, operation, headers, fields, body);
    // The form of versions before keyed hashing. A body they refused (an
    // integer a double rounds) has no record to find.
    let earlier = whole_doubles.flatten().map(|whole| {
        let mut sorted: Vec<&str> = query_params(parts).collect();
        sorted.sort_unstable();
        let fp = Fingerprint::builder()
            .part("method", parts.method.as_str().as_bytes())
            .part("operation", operation.as_bytes())
            .part("query", sorted.join("&").as_bytes());
        with_headers_and_body(fp, parts, headers, whole)
    });
    Ok((current, earlier))
}

/// The fingerprint the version before `v3` gave a request: the form of
/// [`fingerprints`] with its JSON numbers read as binary doubles
/// ([`idem::canonical_json_doubles`]): `v2:` with a secret, `v1:` without.
/// `None` when that version refused the request (it gave it none).
///
/// Only for a request whose fingerprint a record does not carry
/// ([`idem::Engine::recheck_mismatch`]): it parses the body again.
pub fn previous_fingerprint(
    hashing: &Hashing,
    parts: &Parts,
    path: &str,
    operation: &str,
    headers: &[HeaderName],
    fields: &BodyFields,
    body: &[u8],
) -> Option<Fingerprint> {
    let body = doubles_digest(parts, body, fields)?;
    let builder = match &hashing.secret {
        Some(secret) => idem::FingerprintBuilder::keyed_v2(secret),
        None => Fingerprint::builder(),
    };
    Some(current_form(
        builder, parts, path, operation, headers, fields, body,
    ))
}

fn query_params(parts: &Parts) -> impl Iterator<Item = &str> {
    parts
        .uri
        .query()
        .unwrap_or("")
        .split('&')
        .filter(|p| !p.is_empty())
}

/// The request's parts in the order of the `v2`/`v3` form, into `fp`.
fn current_form(
    fp: idem::FingerprintBuilder,
    parts: &Parts,
    path: &str,
    operation: &str,
    headers: &[HeaderName],
    fields: &BodyFields,
    body: BodyDigest,
) -> Fingerprint {
    let mut fp = fp
        .part("method", parts.method.as_str().as_bytes())
        .part("operation", operation.as_bytes())
        .part("path", path.as_bytes());
    // Each parameter its own part, in order: `a=1&a=2` is not `a=2&a=1`,
    // and no parameter can run into the next.
    for param in query_params(parts) {
        fp = fp.part("query", param.as_bytes());
    }
    // Only when the body is covered in part (and JSON): the default keeps
    // the fingerprints it always gave.
    if body.0 == idem::BodyKind::Json
        && let Some(label) = fields.label()
    {
        fp = fp.part("body:fields", label.as_bytes());
    }
    with_headers_and_body(fp, parts, headers, body)
}

fn with_headers_and_body(
    mut fp: idem::FingerprintBuilder,
    parts: &Parts,
    headers: &[HeaderName],
    body: BodyDigest,
) -> Fingerprint {
    for name in headers {
        for value in parts.headers.get_all(name) {
            fp = fp.part(name.as_str(), value.as_bytes());
        }
    }
    fp.body_digest(body.0, body.1).finish()
}

/// A body's kind and SHA-256, as a fingerprint takes it.
type BodyDigest = (idem::BodyKind, [u8; 32]);

fn bytes_digest(body: &[u8]) -> BodyDigest {
    (idem::BodyKind::Bytes, Sha256::digest(body).into())
}

fn json_digest(canonical: &[u8]) -> BodyDigest {
    (idem::BodyKind::Json, Sha256::digest(canonical).into())
}

/// The body's digest as the fingerprint takes it (of the `fields` chosen
/// when the body is JSON) and, when `whole_doubles`, the digest versions
/// before `v3` gave the whole body (`Some(None)` where they refused it),
/// from one parse.
fn body_digests(
    parts: &Parts,
    body: &[u8],
    fields: &BodyFields,
    whole_doubles: bool,
) -> Result<(BodyDigest, Option<Option<BodyDigest>>), Problem> {
    if !is_json(&parts.headers) {
        let digest = bytes_digest(body);
        return Ok((digest, whole_doubles.then_some(Some(digest))));
    }
    if std::str::from_utf8(body).is_err() {
        return Err(Problem::new(
            ProblemKind::BodyEncoding,
            "the body is declared as JSON but is not valid UTF-8",
        ));
    }
    // Parsed once: canonicalised, and refused when two readers could read
    // it as different documents (the upstream may read it as the one the
    // fingerprint did not).
    match idem::json_strict(body) {
        Ok(doc) => {
            let doubles = whole_doubles.then(|| doubles_of(&doc, body));
            let canonical = idem::canonical_json_value(&fields.select(doc), body.len());
            Ok((json_digest(&canonical), doubles))
        }
        Err(idem::JsonRefusal::NotJson | idem::JsonRefusal::OutOfRange(_)) => {
            let digest = bytes_digest(body);
            Ok((digest, whole_doubles.then_some(Some(digest))))
        }
        Err(why) => Err(ambiguous(&why)),
    }
}

/// The digest versions before `v3` gave the `fields` of a body: `None`
/// where they refused it.
fn doubles_digest(parts: &Parts, body: &[u8], fields: &BodyFields) -> Option<BodyDigest> {
    if !is_json(&parts.headers) {
        return Some(bytes_digest(body));
    }
    match idem::json_strict(body) {
        Ok(doc) => doubles_of(&fields.select(doc), body),
        Err(idem::JsonRefusal::NotJson) => Some(bytes_digest(body)),
        Err(_) => None,
    }
}

/// A parsed document's digest in the doubles form: as bytes where that
/// form has no number for it (beyond the doubles' range, as those
/// versions hashed it), `None` where those versions refused it.
fn doubles_of(doc: &Value, body: &[u8]) -> Option<BodyDigest> {
    match idem::canonical_json_doubles_value(doc, body.len()) {
        Ok(canonical) => Some(json_digest(&canonical)),
        Err(idem::JsonRefusal::NotJson) => Some(bytes_digest(body)),
        Err(_) => None,
    }
}

/// `400 request-body-ambiguous-json`.
pub(super) fn ambiguous(why: &idem::JsonRefusal) -> Problem {
    Problem::new(
        ProblemKind::BodyAmbiguous,
        format!("the JSON body is ambiguous: {why}; nothing was forwarded"),
    )
}

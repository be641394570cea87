//! Reading what identifies a request: its key, its tenant, its fingerprint.
//!
//! ```
//! use http::Request;
//! use idem_http::{Tenant, TenantSource, TenantExtractor, idempotency_key};
//!
//! let req = Request::post("/v1/payments")
//!     .header("idempotency-key", "\"order-7\"")   // structured-field string
//!     .header("authorization", "Bearer sk_test_1")
//!     .body(())
//!     .unwrap();
//! let (parts, _) = req.into_parts();
//! assert_eq!(idempotency_key(&parts.headers).unwrap().unwrap().as_str(), "order-7");
//! let tenant = TenantSource::Authorization.tenant(&parts).unwrap();
//! // A credential: the layer keeps only its keyed hash.
//! assert_eq!(tenant, Tenant::Credential(b"Bearer sk_test_1"));
//! ```

use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::SystemTime;

use http::header::{self, HeaderMap, HeaderName};
use http::request::Parts;
use idem::json::Value;
use idem::{Fingerprint, HashSecret, IdempotencyKey};
use ipnet::IpNet;
use sha2::{Digest, Sha256};

use crate::{BodyFields, JsonPointer, Problem, ProblemKind};

/// The request header carrying the key.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");

/// Reads the `Idempotency-Key` header: `Ok(None)` when absent, the key when
/// well-formed (bare token, or structured-field string `"…"`), a problem
/// when malformed or sent more than once.
pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, Problem> {
    key_from_headers(headers, std::slice::from_ref(&IDEMPOTENCY_KEY))
}

/// Reads the key from the first of `names` the request carries (a route's
/// `key_header`), as [`idempotency_key`] reads `Idempotency-Key`: one
/// value of that header, bare or a structured-field string.
pub fn key_from_headers(
    headers: &HeaderMap,
    names: &[HeaderName],
) -> Result<Option<IdempotencyKey>, Problem> {
    let Some(name) = names.iter().find(|name| headers.contains_key(*name)) else {
        return Ok(None);
    };
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(Problem::new(
            ProblemKind::KeyAmbiguous,
            format!(
                "the request has more than one {} header; send exactly one",
                header_label(name)
            ),
        ));
    }
    let raw = value.as_bytes();
    match raw.first() {
        Some(b'"') => IdempotencyKey::from_quoted(&sf_string(raw)?),
        _ => IdempotencyKey::from_bytes(raw),
    }
    .map(Some)
    .map_err(|e| {
        Problem::new(
            ProblemKind::KeyInvalid,
            format!("{}: {e}", header_label(name)),
        )
    })
}

/// Reads the key from the field `pointer` names in a JSON body (a route's
/// `key_from`): a string, or an integer as written. `Ok(None)` when the
/// body is not JSON or lacks the field; a problem when the field holds
/// anything else, or its text is not a valid key.
pub fn key_from_body(
    parts: &Parts,
    body: &[u8],
    pointer: &JsonPointer,
) -> Result<Option<IdempotencyKey>, Problem> {
    if !is_json(&parts.headers) {
        return Ok(None);
    }
    let doc = match idem::json_strict(body) {
        Ok(doc) => doc,
        Err(idem::JsonRefusal::NotJson | idem::JsonRefusal::OutOfRange(_)) => return Ok(None),
        Err(why) => return Err(ambiguous(&why)),
    };
    let text = match pointer.get(&doc) {
        None => return Ok(None),
        Some(Value::String(s)) => s.as_str(),
        Some(Value::Number(n)) if n.is_integer_literal() => n.as_str(),
        Some(_) => {
            return Err(Problem::new(
                ProblemKind::KeyInvalid,
                format!("the body's {pointer} must be a string or an integer to be the key"),
            ));
        }
    };
    IdempotencyKey::from_bytes(text.as_bytes())
        .map(Some)
        .map_err(|e| {
            Problem::new(
                ProblemKind::KeyInvalid,
                format!("the body's {pointer}: {e}"),
            )
        })
}

/// A header's name as people write it: `Idempotency-Key`, `X-Request-Id`.
pub(crate) fn header_label(name: &HeaderName) -> String {
    name.as_str()
        .split('-')
        .map(|word| {
            let mut chars = word.chars();
            chars.next().map_or_else(String::new, |first| {
                first.to_ascii_uppercase().to_string() + chars.as_str()
            })
        })
        .collect::<Vec<_>>()
        .join("-")
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

/// The address of the client a request came from, put in its extensions
/// by the server (the gateway does; a service using the layer directly
/// inserts it for [`TenantSource::TrustedHeader`] to trust anyone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerAddr(pub SocketAddr);

/// What a request's tenant is made from, as a [`TenantExtractor`] read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Tenant<'a> {
    /// A credential (an `Authorization` value, an API key, a session
    /// cookie): the tenant is its keyed hash ([`idem::HashSecret::tenant`]),
    /// so the credential is never stored nor logged.
    Credential(&'a [u8]),
    /// An identity that is no secret (set by a trusted proxy, or the one
    /// tenant of a single-tenant deployment): used as it is.
    Identity(Cow<'a, str>),
}

/// Decides which tenant a request belongs to. Tenants come from
/// authenticated context, never from the body.
///
/// A request without what its tenant comes from is refused with
/// [`ProblemKind::TenantMissing`] (`401`), never put in a tenant shared by
/// everyone who sends nothing; a route may pass such requests on
/// unprotected instead ([`crate::MissingTenant::Pass`]).
pub trait TenantExtractor: Send + Sync + 'static {
    /// What this request's tenant is made from, or the problem to answer.
    fn tenant<'a>(&'a self, parts: &'a Parts) -> Result<Tenant<'a>, Problem>;

    /// The tenant versions before keyed hashes gave this request, to find
    /// records they wrote ([`idem::Engine::begin_with_earlier`]). Default:
    /// none.
    fn earlier_tenant(&self, parts: &Parts) -> Option<String> {
        let _ = parts;
        None
    }

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

    /// Removes from a request what its peer may not carry on to the
    /// service: an identity only a trusted proxy may set. Called on every
    /// request the layer forwards, protected or not, after its tenant was
    /// judged (so a protected request still gets its clear refusal).
    /// Default: nothing.
    fn remove_untrusted(&self, headers: &mut HeaderMap, peer: Option<&PeerAddr>) {
        let _ = (headers, peer);
    }
}

/// Whether `peer` is one of `proxies`, compared by canonical address: on
/// a dual-stack listener an IPv4 client is `::ffff:a.b.c.d`, which is the
/// IPv4 address `a.b.c.d`.
pub fn is_trusted(proxies: &[IpNet], peer: Option<&PeerAddr>) -> bool {
    peer.is_some_and(|p| {
        let ip = p.0.ip().to_canonical();
        proxies.iter().any(|net| net.contains(&ip))
    })
}

/// The built-in tenant sources (the gateway's `[tenant] from = …`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantSource {
    /// The `Authorization` value, as a credential: each credential is its
    /// own tenant. A request without one is refused (`401
    /// tenant-missing`).
    Authorization,
    /// A credential header (`X-Api-Key`), hashed like `Authorization`.
    Header(HeaderName),
    /// A cookie's value (a session cookie), hashed like `Authorization`.
    Cookie(String),
    /// An identity header set by an authenticating proxy, used as it is,
    /// and only on requests whose [`PeerAddr`] is in `proxies`: from any
    /// other peer it is refused (`403 tenant-untrusted`), since anyone can
    /// write a header.
    TrustedHeader {
        /// The header the proxy sets.
        name: HeaderName,
        /// The proxies' addresses.
        proxies: Vec<IpNet>,
    },
    /// One tenant for everything: a single-tenant deployment, where every
    /// caller may see every answer.
    Single(String),
}

impl TenantSource {
    /// The proxies trusted to say who a request is from: those of
    /// [`TenantSource::TrustedHeader`], none for the other sources.
    pub fn trusted_proxies(&self) -> &[IpNet] {
        match self {
            Self::TrustedHeader { proxies, .. } => proxies,
            _ => &[],
        }
    }
}

/// Exactly one non-empty value of `name`, `Ok(None)` when absent.
fn single_header<'a>(parts: &'a Parts, name: &HeaderName) -> Result<Option<&'a [u8]>, Problem> {
    let mut values = parts.headers.get_all(name).iter();
    match (values.next(), values.next()) {
        (None, _) => Ok(None),
        (Some(v), None) if v.as_bytes().trim_ascii().is_empty() => Ok(None),
        (Some(v), None) => Ok(Some(v.as_bytes())),
        (Some(_), Some(_)) => Err(Problem::new(
            ProblemKind::TenantInvalid,
            format!("more than one {name} header: the tenant is ambiguous"),
        )),
    }
}

/// The value of cookie `name` across the request's `Cookie` headers;
/// refused when it is set twice (two tenants).
fn cookie<'a>(parts: &'a Parts, name: &str) -> Result<Option<&'a [u8]>, Problem> {
    let mut found = None;
    for header in parts.headers.get_all(header::COOKIE) {
        for pair in header.as_bytes().split(|b| *b == b';') {
            let pair = pair.trim_ascii();
            let Some(eq) = pair.iter().position(|b| *b == b'=') else {
                continue;
            };
            if &pair[..eq] != name.as_bytes() {
                continue;
            }
            let value = pair[eq + 1..].trim_ascii();
            let value = value
                .strip_prefix(b"\"")
                .and_then(|v| v.strip_suffix(b"\""))
                .unwrap_or(value);
            if found.is_some() {
                return Err(Problem::new(
                    ProblemKind::TenantInvalid,
                    format!("the cookie {name} is sent more than once: the tenant is ambiguous"),
                ));
            }
            if !value.is_empty() {
                found = Some(value);
            }
        }
    }
    Ok(found)
}

fn missing(what: &str) -> Problem {
    Problem::new(
        ProblemKind::TenantMissing,
        format!("{what} is required to identify the caller; nothing was forwarded"),
    )
}

impl TenantExtractor for TenantSource {
    fn credentials(&self, parts: &Parts) -> HeaderMap {
        let name = match self {
            Self::Authorization => header::AUTHORIZATION,
            Self::Header(name) | Self::TrustedHeader { name, .. } => name.clone(),
            Self::Cookie(_) => header::COOKIE,
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

    fn remove_untrusted(&self, headers: &mut HeaderMap, peer: Option<&PeerAddr>) {
        if let Self::TrustedHeader { name, proxies } = self
            && !is_trusted(proxies, peer)
        {
            headers.remove(name);
        }
    }

    fn tenant<'a>(&'a self, parts: &'a Parts) -> Result<Tenant<'a>, Problem> {
        match self {
            Self::Authorization => single_header(parts, &header::AUTHORIZATION)?
                .map(Tenant::Credential)
                .ok_or_else(|| missing("an Authorization header")),
            Self::Header(name) => single_header(parts, name)?
                .map(Tenant::Credential)
                .ok_or_else(|| missing(&format!("the {name} header"))),
            Self::Cookie(name) => cookie(parts, name)?
                .map(Tenant::Credential)
                .ok_or_else(|| missing(&format!("the {name} cookie"))),
            Self::TrustedHeader { name, proxies } => {
                let Some(value) = single_header(parts, name)? else {
                    return Err(missing(&format!("the {name} header")));
                };
                if !is_trusted(proxies, parts.extensions.get::<PeerAddr>()) {
                    return Err(Problem::new(
                        ProblemKind::TenantUntrusted,
                        format!(
                            "the {name} header is accepted only from the trusted proxies, and this connection is not from one; nothing was forwarded"
                        ),
                    ));
                }
                std::str::from_utf8(value)
                    .ok()
                    .filter(|v| v.bytes().all(|b| b.is_ascii_graphic() || b == b' '))
                    .map(|v| Tenant::Identity(Cow::Borrowed(v)))
                    .ok_or_else(|| {
                        Problem::new(
                            ProblemKind::TenantInvalid,
                            format!("the {name} header must be visible ASCII"),
                        )
                    })
            }
            Self::Single(tenant) => Ok(Tenant::Identity(Cow::Borrowed(tenant))),
        }
    }

    fn earlier_tenant(&self, parts: &Parts) -> Option<String> {
        match self {
            // Earlier versions took the unkeyed SHA-256 of Authorization, the
            // value of a (trusted) header as it was, and had no cookies.
            Self::Authorization => single_header(parts, &header::AUTHORIZATION)
                .ok()
                .flatten()
                .map(idem::fingerprint::unkeyed_tenant),
            Self::Header(name) | Self::TrustedHeader { name, .. } => single_header(parts, name)
                .ok()
                .flatten()
                .and_then(|v| std::str::from_utf8(v).ok())
                .map(str::to_owned),
            Self::Cookie(_) => None,
            Self::Single(tenant) => Some(tenant.clone()),
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
    earlier_until: Option<SystemTime>,
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
            earlier_until: None,
        }
    }

    /// Until `until`, also finds records written by versions before this
    /// one (before keyed hashing, and before the path was part of the
    /// fingerprint), under their unkeyed tenant and their fingerprint of
    /// method, operation, sorted query, headers and body
    /// ([`idem::Engine::begin_with_earlier`]), at the cost of one store read
    /// per fresh reservation. Set it to when the last such record expires:
    /// the upgrade plus the longest retention.
    pub fn with_earlier_until(mut self, until: SystemTime) -> Self {
        self.earlier_until = Some(until);
        self
    }

    /// Whether a secret keys the hashes.
    pub fn is_keyed(&self) -> bool {
        self.secret.is_some()
    }

    /// Whether records written by earlier versions are looked for now.
    pub fn finds_earlier(&self) -> bool {
        self.earlier_until.is_some_and(|u| SystemTime::now() < u)
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

/// A request's fingerprint, and (while [`Hashing::finds_earlier`]) the
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
    let finds_earlier = hashing.finds_earlier();
    let (body, whole_doubles) = body_digests(parts, body, fields, finds_earlier)?;
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
fn ambiguous(why: &idem::JsonRefusal) -> Problem {
    Problem::new(
        ProblemKind::BodyAmbiguous,
        format!("the JSON body is ambiguous: {why}; nothing was forwarded"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::Request;

    #[test]
    fn ambiguous_json_is_refused_and_plain_json_keeps_its_fingerprint() {
        let json = |body: &str| {
            let p = parts(|b| b.header("content-type", "application/json"));
            Hashing::unkeyed().fingerprint(
                &p,
                "/v1/payments",
                "POST /v1/payments",
                &[],
                body.as_bytes(),
            )
        };
        for (body, why) in [
            (r#"{"a":1,"a":2}"#, "appears twice"),
            (r#"{"x":{"to":"alice","to":"mallory"}}"#, "appears twice"),
        ] {
            let p = json(body).expect_err(body);
            assert_eq!(p.kind(), Some(ProblemKind::BodyAmbiguous), "{body}");
            assert!(p.detail().contains(why), "{body}: {}", p.detail());
        }
        // Integers of any size are requests of their own.
        let big = json(r#"[{"n":9007199254740993}]"#).expect("accepted");
        assert_ne!(big, json(r#"[{"n":9007199254740992}]"#).expect("accepted"));
        assert_ne!(
            json(r#"{"n":-18446744073709551617}"#).expect("accepted"),
            json(r#"{"n":-18446744073709551616}"#).expect("accepted")
        );
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
        // The earlier form is the one versions before this one wrote.
        let upgrading = Hashing::unkeyed()
            .with_earlier_until(SystemTime::now() + std::time::Duration::from_secs(60));
        let (_, earlier) = fingerprints(
            &upgrading,
            &p,
            "/v1/payments",
            "POST /v1/payments",
            &[],
            &BodyFields::All,
            br#"{"n":9007199254740992,"f":1.5,"s":"x"}"#,
        )
        .expect("fp");
        assert_eq!(earlier, Some(via_builder));
        // Not JSON at all: its bytes, as before.
        assert!(json("{not json").is_ok());
        // A body versions before refused has no earlier fingerprint.
        let (_, earlier) = fingerprints(
            &upgrading,
            &p,
            "/v1/payments",
            "POST /v1/payments",
            &[],
            &BodyFields::All,
            br#"{"n":9007199254740993}"#,
        )
        .expect("fp");
        assert_eq!(earlier, None);
    }

    /// The previous fingerprint is the `v2` one: the current form with
    /// numbers read as doubles, so two bodies one double cannot tell apart
    /// share it, and one that version refused has none.
    #[test]
    fn the_previous_fingerprint_reads_numbers_as_doubles() {
        let p = parts(|b| b.header("content-type", "application/json"));
        let fields = BodyFields::Exclude(vec!["/sent_at".parse().expect("pointer")]);
        let previous = |hashing: &Hashing, body: &str| {
            previous_fingerprint(
                hashing,
                &p,
                "/v1/payments",
                "POST /v1/payments",
                &[header::CONTENT_TYPE],
                &fields,
                body.as_bytes(),
            )
        };
        let a = previous(&secret(1), r#"{"amount":0.1,"sent_at":1}"#).expect("v2");
        assert!(a.to_string().starts_with("v2:"), "{a}");
        assert_eq!(
            Some(a),
            previous(&secret(1), r#"{"amount":0.10000000000000001,"sent_at":2}"#)
        );
        assert_eq!(previous(&secret(1), r#"{"id":9007199254740993}"#), None);
        let unkeyed = previous(&Hashing::unkeyed(), r#"{"amount":0.1}"#).expect("v1");
        assert!(unkeyed.to_string().starts_with("v1:"), "{unkeyed}");
        // The current fingerprint tells the two amounts apart.
        let current = |body: &str| {
            fingerprints(
                &secret(1),
                &p,
                "/v1/payments",
                "POST /v1/payments",
                &[header::CONTENT_TYPE],
                &fields,
                body.as_bytes(),
            )
            .expect("fp")
            .0
        };
        assert_ne!(
            current(r#"{"amount":0.1}"#),
            current(r#"{"amount":0.10000000000000001}"#)
        );
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
        // A quoted key may hold spaces (an sf-string); a bare one may not.
        assert_eq!(
            key_of(b"\" two words \"")
                .expect("ok")
                .expect("some")
                .as_str(),
            " two words "
        );
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
            (b"a b", ProblemKind::KeyInvalid),
            (b"\"a\"b\"", ProblemKind::KeyInvalid),
            (b"\"a\";", ProblemKind::KeyInvalid),
            (b"\"a\";V=1", ProblemKind::KeyInvalid),
            (b"\"a\";v=", ProblemKind::KeyInvalid),
            (b"\"a\";v=\"open", ProblemKind::KeyInvalid),
            (b"\"a\" junk", ProblemKind::KeyInvalid),
            (b"caf\xc3\xa9", ProblemKind::KeyInvalid),
        ] {
            let err = key_of(value).expect_err("invalid");
            assert_eq!(err.kind(), Some(kind), "{value:?}");
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
            Some(ProblemKind::KeyAmbiguous)
        );
    }

    fn secret(byte: u8) -> Hashing {
        Hashing::keyed(Arc::new(
            HashSecret::from_bytes(&[byte; 32]).expect("32 bytes"),
        ))
    }

    #[test]
    fn tenants() {
        let hashing = secret(7);
        let tenant_of = |src: &TenantSource, p: &Parts| src.tenant(p).map(|t| hashing.tenant(&t));
        let with_auth = parts(|b| b.header("authorization", "Bearer one"));
        let other = parts(|b| b.header("authorization", "Bearer two"));
        let t1 = tenant_of(&TenantSource::Authorization, &with_auth).expect("tenant");
        assert_eq!(t1.len(), 64);
        assert_ne!(
            t1,
            tenant_of(&TenantSource::Authorization, &other).expect("tenant")
        );
        // Keyed: neither the credential nor its plain SHA-256, and another
        // secret gives another tenant.
        assert!(!t1.contains("one"));
        assert_ne!(t1, idem::fingerprint::unkeyed_tenant(b"Bearer one"));
        assert_ne!(
            t1,
            secret(8).tenant(&TenantSource::Authorization.tenant(&with_auth).expect("t"))
        );
        assert_eq!(
            TenantSource::Authorization.earlier_tenant(&with_auth),
            Some(idem::fingerprint::unkeyed_tenant(b"Bearer one"))
        );
        // Nothing sent, an empty value: no shared tenant, a 401.
        for p in [parts(|b| b), parts(|b| b.header("authorization", " "))] {
            let err = TenantSource::Authorization.tenant(&p).expect_err("missing");
            assert_eq!(
                (err.kind(), err.status().as_u16()),
                (Some(ProblemKind::TenantMissing), 401)
            );
        }
        let two = parts(|b| b.header("authorization", "a").header("authorization", "b"));
        assert_eq!(
            TenantSource::Authorization
                .tenant(&two)
                .expect_err("two")
                .kind(),
            Some(ProblemKind::TenantInvalid)
        );
        let api_key = TenantSource::Header(HeaderName::from_static("x-api-key"));
        assert_eq!(
            api_key
                .tenant(&parts(|b| b.header("x-api-key", "k_1")))
                .expect("tenant"),
            Tenant::Credential(b"k_1")
        );
        assert_eq!(
            api_key.tenant(&parts(|b| b)).expect_err("missing").kind(),
            Some(ProblemKind::TenantMissing)
        );
        let session = TenantSource::Cookie("session".into());
        assert_eq!(
            session
                .tenant(&parts(
                    |b| b.header("cookie", "theme=dark; session=s_9; x=1")
                ))
                .expect("tenant"),
            Tenant::Credential(b"s_9")
        );
        for p in [
            parts(|b| b),
            parts(|b| b.header("cookie", "sessionx=1; session=")),
        ] {
            assert_eq!(
                session.tenant(&p).expect_err("missing").kind(),
                Some(ProblemKind::TenantMissing)
            );
        }
        let twice = parts(|b| {
            b.header("cookie", "session=a")
                .header("cookie", "session=b")
        });
        assert_eq!(
            session.tenant(&twice).expect_err("two").kind(),
            Some(ProblemKind::TenantInvalid)
        );
        assert_eq!(
            TenantSource::Single("one".into())
                .tenant(&parts(|b| b))
                .expect("tenant"),
            Tenant::Identity("one".into())
        );
    }

    #[test]
    fn a_trusted_header_counts_only_from_a_trusted_proxy() {
        let src = TenantSource::TrustedHeader {
            name: HeaderName::from_static("x-user"),
            proxies: vec![
                "10.0.0.0/8".parse().expect("net"),
                "::1/128".parse().expect("net"),
            ],
        };
        let from = |peer: Option<&str>| {
            let mut p = parts(|b| b.header("x-user", "alice"));
            if let Some(peer) = peer {
                p.extensions.insert(PeerAddr(peer.parse().expect("addr")));
            }
            p
        };
        for peer in ["10.1.2.3:5000", "[::1]:80"] {
            assert_eq!(
                src.tenant(&from(Some(peer))).expect("trusted"),
                Tenant::Identity("alice".into()),
                "{peer}"
            );
        }
        for peer in [Some("192.168.0.1:5000"), None] {
            let err = src.tenant(&from(peer)).expect_err("untrusted");
            assert_eq!(
                (err.kind(), err.status().as_u16()),
                (Some(ProblemKind::TenantUntrusted), 403)
            );
        }
        let mut without = parts(|b| b);
        without
            .extensions
            .insert(PeerAddr("10.0.0.1:1".parse().expect("addr")));
        assert_eq!(
            src.tenant(&without).expect_err("missing").kind(),
            Some(ProblemKind::TenantMissing)
        );
    }

    #[test]
    fn fingerprint_ignores_json_layout_and_keeps_path_and_query_order() {
        let hashing = secret(1);
        let json =
            |b: http::request::Builder| b.header("content-type", "application/json; charset=utf-8");
        let fp = |p: &Parts, path: &str, op: &str, body: &[u8]| {
            hashing
                .fingerprint(p, path, op, &[header::CONTENT_TYPE], body)
                .expect("fp")
        };
        let a = fp(
            &parts(json),
            "/v1/payments",
            "POST /v1/payments",
            br#"{"a":1,"b":[1,2]}"#,
        );
        assert!(a.to_string().starts_with("v3:"), "{a}");
        let b = fp(
            &parts(json),
            "/v1/payments",
            "POST /v1/payments",
            b"{ \"b\": [1, 2], \"a\": 1.0 }",
        );
        assert_eq!(a, b);
        let c = fp(
            &parts(json),
            "/v1/payments",
            "POST /v1/payments",
            br#"{"a":2,"b":[1,2]}"#,
        );
        assert_ne!(a, c);
        let other_op = fp(
            &parts(json),
            "/v1/payments",
            "POST /v1/refunds",
            br#"{"a":1,"b":[1,2]}"#,
        );
        assert_ne!(a, other_op);
        // One key on another resource of the same route: another request.
        let op = "POST /v1/orders/{id}/capture";
        assert_ne!(
            fp(&parts(json), "/v1/orders/ord_A/capture", op, b"{}"),
            fp(&parts(json), "/v1/orders/ord_B/capture", op, b"{}")
        );
        // Repeated parameters keep their order; parameters stay apart.
        let with_query = |q: &str| {
            let mut p = parts(json);
            p.uri = format!("/v1/payments?{q}").parse().expect("uri");
            fp(&p, "/v1/payments", "POST /v1/payments", b"{}")
        };
        assert_ne!(with_query("a=1&a=2"), with_query("a=2&a=1"));
        assert_ne!(with_query("a=1&b=2"), with_query("a=1%26b=2"));
        // Another secret, another fingerprint; unkeyed is v1, and it too
        // tells one resource from another.
        let other = secret(2).fingerprint(
            &parts(json),
            "/v1/payments",
            "POST /v1/payments",
            &[header::CONTENT_TYPE],
            br#"{"a":1,"b":[1,2]}"#,
        );
        assert_ne!(a, other.expect("fp"));
        let v1 = |path: &str| {
            Hashing::unkeyed()
                .fingerprint(
                    &parts(json),
                    path,
                    "POST /v1/payments",
                    &[header::CONTENT_TYPE],
                    b"{}",
                )
                .expect("fp")
        };
        assert!(v1("/a").to_string().starts_with("v1:"));
        assert_ne!(v1("/a"), v1("/b"));
        let legacy = Fingerprint::builder()
            .part("method", b"POST")
            .part("operation", b"POST /v1/payments")
            .part("query", b"a=1&b=2")
            .part("content-type", b"application/json; charset=utf-8")
            .json_body(b"{}")
            .finish();
        // While earlier records are looked for, both come out, the v1 one
        // as earlier versions made it.
        let upgrading =
            secret(1).with_earlier_until(SystemTime::now() + std::time::Duration::from_secs(60));
        let (now, earlier) = fingerprints(
            &upgrading,
            &parts(json),
            "/a",
            "POST /v1/payments",
            &[header::CONTENT_TYPE],
            &BodyFields::All,
            b"{}",
        )
        .expect("fp");
        assert_eq!(
            now,
            secret(1)
                .fingerprint(
                    &parts(json),
                    "/a",
                    "POST /v1/payments",
                    &[header::CONTENT_TYPE],
                    b"{}"
                )
                .expect("fp")
        );
        assert_eq!(earlier, Some(legacy));
        assert_eq!(
            fingerprints(
                &secret(1),
                &parts(json),
                "/a",
                "POST /v1/payments",
                &[],
                &BodyFields::All,
                b"{}"
            )
            .expect("fp")
            .1,
            None
        );
    }

    #[test]
    fn chosen_body_fields_leave_the_rest_of_the_fingerprint_and_plain_bodies_alone() {
        let fp = |content_type: &str, fields: &BodyFields, body: &[u8]| {
            let p = parts(|b| b.header("content-type", content_type));
            let hashing = secret(1)
                .with_earlier_until(SystemTime::now() + std::time::Duration::from_secs(60));
            fingerprints(&hashing, &p, "/v1/p", "POST /v1/p", &[], fields, body).expect("fp")
        };
        let p = |t: &str| t.parse::<JsonPointer>().expect("pointer");
        let json = "application/json";
        let exclude = BodyFields::Exclude(vec![p("/sent_at")]);
        let (a, a_earlier) = fp(json, &exclude, br#"{"amount":5,"sent_at":1}"#);
        let (b, b_earlier) = fp(json, &exclude, br#"{"amount":5,"sent_at":2}"#);
        assert_eq!(a, b, "the stamp is left out");
        // Earlier versions covered the whole body, and still do.
        assert_ne!(a_earlier, b_earlier);
        // The same document covered whole is another request: a route that
        // changes what it covers does not replay records made before.
        let (whole, _) = fp(json, &BodyFields::All, br#"{"amount":5}"#);
        let (trimmed, _) = fp(json, &exclude, br#"{"amount":5}"#);
        assert_ne!(whole, trimmed);
        // A body that is not JSON is covered whole, as if no field were named.
        let include = BodyFields::Include(vec![p("/amount")]);
        let (plain, _) = fp("text/plain", &include, b"amount=5");
        assert_eq!(plain, fp("text/plain", &BodyFields::All, b"amount=5").0);
        assert_ne!(plain, fp("text/plain", &include, b"amount=6").0);
        // Ambiguous JSON is refused whatever is covered.
        let p = parts(|b| b.header("content-type", json));
        let ambiguous = fingerprints(
            &secret(1),
            &p,
            "/",
            "op",
            &[],
            &include,
            br#"{"amount":1,"amount":2}"#,
        );
        assert_eq!(
            ambiguous.expect_err("dup").kind(),
            Some(ProblemKind::BodyAmbiguous)
        );
    }

    #[test]
    fn keys_come_from_the_first_named_header_or_the_body_field() {
        let names = [HeaderName::from_static("x-request-id"), IDEMPOTENCY_KEY];
        let p = parts(|b| {
            b.header("idempotency-key", "second")
                .header("x-request-id", "first")
        });
        assert_eq!(
            key_from_headers(&p.headers, &names)
                .expect("ok")
                .expect("key")
                .as_str(),
            "first"
        );
        let p = parts(|b| b.header("idempotency-key", "\"quoted k\""));
        assert_eq!(
            key_from_headers(&p.headers, &names)
                .expect("ok")
                .expect("key")
                .as_str(),
            "quoted k"
        );
        assert_eq!(key_from_headers(&p.headers, &[]).expect("ok"), None);
        let p = parts(|b| b.header("x-request-id", "a").header("x-request-id", "b"));
        let err = key_from_headers(&p.headers, &names).expect_err("two");
        assert!(err.detail().contains("X-Request-Id"), "{}", err.detail());

        let field = "/order/id".parse::<JsonPointer>().expect("pointer");
        let json = parts(|b| b.header("content-type", "application/json"));
        let key = |body: &str| key_from_body(&json, body.as_bytes(), &field);
        assert_eq!(
            key(r#"{"order":{"id":"o-1"}}"#)
                .expect("ok")
                .expect("key")
                .as_str(),
            "o-1"
        );
        assert_eq!(
            key(r#"{"order":{"id":-7}}"#)
                .expect("ok")
                .expect("key")
                .as_str(),
            "-7"
        );
        assert_eq!(key(r#"{"order":{}}"#).expect("ok"), None);
        assert_eq!(key("not json").expect("ok"), None);
        for bad in [
            r#"{"order":{"id":1.5}}"#,
            r#"{"order":{"id":true}}"#,
            r#"{"order":{"id":"\u0007"}}"#,
        ] {
            assert_eq!(
                key(bad).expect_err(bad).kind(),
                Some(ProblemKind::KeyInvalid),
                "{bad}"
            );
        }
        let text = parts(|b| b.header("content-type", "text/plain"));
        assert_eq!(
            key_from_body(&text, br#"{"order":{"id":"o-1"}}"#, &field).expect("ok"),
            None
        );
    }

    #[test]
    fn json_that_is_not_utf8_is_refused() {
        let p = parts(|b| b.header("content-type", "application/merchant+json"));
        let err = secret(1)
            .fingerprint(&p, "/", "op", &[], b"{\"a\":\"\xff\"}")
            .expect_err("not utf-8");
        assert_eq!(err.kind(), Some(ProblemKind::BodyEncoding));
        // Not JSON: any bytes are fine.
        let p = parts(|b| b.header("content-type", "application/octet-stream"));
        assert!(
            secret(1)
                .fingerprint(&p, "/", "op", &[], b"\xff\xfe")
                .is_ok()
        );
    }
}

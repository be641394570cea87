//! The tenant: what it is made from ([`TenantSource`]), from whom an
//! identity is believed ([`is_trusted`]), and the client's address.

use std::borrow::Cow;
use std::net::SocketAddr;

use http::header::{self, HeaderMap, HeaderName};
use http::request::Parts;
use ipnet::IpNet;

use crate::{Problem, ProblemKind};

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
    /// records they wrote ([`idem::Engine::begin_accepting_v1`]). Default:
    /// none.
    fn v1_tenant(&self, parts: &Parts) -> Option<String> {
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

    fn v1_tenant(&self, parts: &Parts) -> Option<String> {
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

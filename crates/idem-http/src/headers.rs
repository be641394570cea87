//! Which headers the layer adds, forwards and stores: the replay mark, the
//! unprotected mark, the connection-level headers a proxy never forwards,
//! and the headers never kept in a record.

use std::sync::LazyLock;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, header};

/// Response header marking a replayed answer, as Stripe and the Agentic
/// Commerce Protocol spell it (the `stripe` profile's marker).
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Response header marking a replayed answer, as the IETF-aligned
/// libraries spell it (the `ietf` profile's marker).
pub const IDEMPOTENCY_REPLAYED: HeaderName = HeaderName::from_static("idempotency-replayed");

/// Response header saying how many seconds a route keeps a key's answer,
/// after the IETF working group's proposal (`Idempotency-TTL: 86400`).
pub const IDEMPOTENCY_TTL: HeaderName = HeaderName::from_static("idempotency-ttl");

/// Response header marking a request forwarded without protection
/// (store down under a fail-open policy).
pub const IDEMPOTENCY_STATUS: HeaderName = HeaderName::from_static("idempotency-status");

/// Stored header marking a tombstone: the body was not retained. Internal:
/// an upstream's own copy is stripped from its answer.
pub(crate) const NOT_RETAINED: HeaderName = HeaderName::from_static("x-idem-body-not-retained");

/// Response headers never stored nor replayed, whatever a route's
/// `unstored_headers` add and whatever wrote the record (the upstream, an
/// operator's `records resolve`, a store edited by hand), beside the
/// connection-level [`HOP_BY_HOP`] set:
///
/// * the framing (`Content-Length`): the replay frames its own body, and
///   a stored length that disagrees with it desyncs the client's
///   connection (the next pipelined answer lands inside the body);
/// * cookies and authentication results (`Set-Cookie`, `Set-Cookie2`,
///   `Authentication-Info`, `Proxy-Authentication-Info`): they belong to
///   one caller's session, and a replay would hand them to another;
/// * the gateway's own marks (`Idempotent-Replayed`,
///   `Idempotency-Replayed`, `Idempotency-Status`, `Idempotency-TTL`):
///   only the gateway says what a replay is and how long keys are kept.
pub const NEVER_STORED: [HeaderName; 9] = [
    header::CONTENT_LENGTH,
    header::SET_COOKIE,
    HeaderName::from_static("set-cookie2"),
    HeaderName::from_static("authentication-info"),
    HeaderName::from_static("proxy-authentication-info"),
    IDEMPOTENT_REPLAYED,
    IDEMPOTENCY_REPLAYED,
    IDEMPOTENCY_STATUS,
    IDEMPOTENCY_TTL,
];

/// Whether a response header may be stored and replayed: the one gate
/// every writer of a record and every replay goes through (names compared
/// without case). `false` for the [`HOP_BY_HOP`] and [`NEVER_STORED`]
/// sets, `Proxy-Connection`, and anything that is not a header name.
pub fn replayable(name: &str) -> bool {
    HeaderName::from_bytes(name.as_bytes()).is_ok_and(|name| replayable_name(&name))
}

/// [`replayable`], for a name already parsed (no second parse on the
/// recording and replay paths).
pub(crate) fn replayable_name(name: &HeaderName) -> bool {
    !HOP_BY_HOP.contains(name) && !NEVER_STORED.contains(name) && *name != PROXY_CONNECTION
}

/// The pre-standard `Connection` of old clients and proxies, which some
/// still honour: connection-level like [`HOP_BY_HOP`].
const PROXY_CONNECTION: HeaderName = HeaderName::from_static("proxy-connection");

/// Connection-level headers: never forwarded by a proxy, never stored.
pub static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// The connection-level headers of one message: the fixed [`HOP_BY_HOP`]
/// set plus whatever its `Connection` header names, or none when it
/// carries no header of the set (the others count only when a
/// `Connection` header names them). A proxy never forwards them and the
/// layer never stores them.
pub fn hop_by_hop_names(headers: &HeaderMap) -> Vec<HeaderName> {
    // Most messages carry none: one pass over their names, no lookups, and
    // a name is compared with the set only if one of the set is as long
    // (it runs two or three times per request; comparing every name with
    // all eight was its whole cost).
    static LENGTHS: LazyLock<u64> = LazyLock::new(|| {
        HOP_BY_HOP
            .iter()
            .fold(0, |lengths, name| lengths | 1 << name.as_str().len())
    });
    let lengths = *LENGTHS;
    if !headers.keys().any(|name| {
        let len = name.as_str().len();
        len < 64 && lengths >> len & 1 == 1 && HOP_BY_HOP.contains(name)
    }) {
        return Vec::new();
    }
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .chain(HOP_BY_HOP.iter().cloned())
        .collect()
}

/// The headers of an upstream's answer that its record keeps: those
/// [`replayable`] and not named by its `Connection` header nor in the
/// route's `unstored` list.
pub(crate) fn storable_headers(
    headers: &HeaderMap,
    unstored: &[HeaderName],
) -> Vec<(String, Bytes)> {
    let hop_by_hop = hop_by_hop_names(headers);
    headers
        .iter()
        .filter(|(name, _)| {
            !hop_by_hop.contains(name)
                && replayable_name(name)
                && **name != NOT_RETAINED
                && !unstored.contains(name)
        })
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                Bytes::copy_from_slice(value.as_bytes()),
            )
        })
        .collect()
}

/// The prefix under which a record keeps its answer's trailer fields
/// (a gRPC answer's `grpc-status`), among its headers: a field name has
/// no `:`, so none is mistaken for a header, and a reader that does not
/// know trailers skips them as names it cannot replay.
pub(crate) const TRAILER_PREFIX: &str = ":trailer:";

/// The trailer fields of an upstream's answer that its record keeps, as
/// [`storable_headers`] keeps headers, each under [`TRAILER_PREFIX`].
pub(crate) fn storable_trailers(
    trailers: &HeaderMap,
    unstored: &[HeaderName],
) -> impl Iterator<Item = (String, Bytes)> {
    storable_headers(trailers, unstored)
        .into_iter()
        .map(|(name, value)| (format!("{TRAILER_PREFIX}{name}"), value))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each name of the fixed set is found among ordinary headers, one of
    /// them as long as two of the set (`user-agent`); without one, none.
    #[test]
    fn every_fixed_name_is_found_and_none_is_invented() {
        let mut ordinary = HeaderMap::new();
        for (name, value) in [
            ("host", "example.com"),
            ("user-agent", "curl/8"),
            ("content-type", "application/json"),
            ("idempotency-key", "k"),
            (
                "x-a-header-name-longer-than-sixty-four-bytes-which-no-fixed-name-is",
                "1",
            ),
        ] {
            ordinary.insert(HeaderName::from_static(name), value.parse().expect("value"));
        }
        assert!(hop_by_hop_names(&ordinary).is_empty());
        for fixed in &HOP_BY_HOP {
            let mut headers = ordinary.clone();
            headers.insert(fixed.clone(), "x".parse().expect("value"));
            let found = hop_by_hop_names(&headers);
            assert!(found.contains(fixed), "{fixed}: {found:?}");
        }
    }
}

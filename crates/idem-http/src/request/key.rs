//! The idempotency key: read from a header (a bare token or an RFC 8941
//! string) or from a field of a JSON body.

use http::header::{HeaderMap, HeaderName};
use http::request::Parts;
use idem::IdempotencyKey;
use idem::json::Value;

use super::fingerprint::{ambiguous, is_json};
use crate::{JsonPointer, Problem, ProblemKind};

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
    pointer
        .get(&doc)
        .map(|value| key_from_value(value, &format!("the body's {pointer}")))
        .transpose()
}

/// A key read from a request and, when it came from its body, the path
/// of its field, for the fingerprint to leave out.
pub(crate) type KeyFound = (IdempotencyKey, Option<Vec<String>>);

/// The key of a request judged in its body (a JSON-RPC call, a GraphQL
/// request): the first of `names` the request carries, else the first of
/// `pointers` present in `value`, named `what`'s in a refusal (`the
/// call's /params/key`).
pub(crate) fn key_in(
    headers: &HeaderMap,
    names: &[HeaderName],
    pointers: &[crate::JsonPointer],
    value: &Value,
    what: &str,
) -> Result<Option<KeyFound>, Problem> {
    if let Some(key) = key_from_headers(headers, names)? {
        return Ok(Some((key, None)));
    }
    for pointer in pointers {
        let Some(found) = pointer.get(value) else {
            continue;
        };
        let key = key_from_value(found, &format!("{what} {pointer}"))?;
        let path = pointer.tokens().iter().map(|t| t.to_string()).collect();
        return Ok(Some((key, Some(path))));
    }
    Ok(None)
}

/// The refusal of `what` ("tools/call", "a mutation") without the key it
/// requires, naming every place it may be.
pub(crate) fn key_required(
    what: &str,
    names: &[HeaderName],
    pointers: &[crate::JsonPointer],
) -> Problem {
    let mut places: Vec<String> = names.iter().map(header_label).collect();
    places.extend(pointers.iter().map(|p| p.to_string()));
    Problem::new(
        ProblemKind::KeyMissing,
        format!(
            "{what} requires an idempotency key in {}",
            places.join(" or ")
        ),
    )
}

/// The key a JSON value holds: a string, or an integer as written;
/// `place` names where it was (`the body's /id`) in the refusal.
pub(crate) fn key_from_value(value: &Value, place: &str) -> Result<IdempotencyKey, Problem> {
    let text = match value {
        Value::String(s) => s.as_str(),
        Value::Number(n) if n.is_integer_literal() => n.as_str(),
        _ => {
            return Err(Problem::new(
                ProblemKind::KeyInvalid,
                format!("{place} must be a string or an integer to be the key"),
            ));
        }
    };
    IdempotencyKey::from_bytes(text.as_bytes())
        .map_err(|e| Problem::new(ProblemKind::KeyInvalid, format!("{place}: {e}")))
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

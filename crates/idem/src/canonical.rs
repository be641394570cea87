//! The canonical form of a JSON body that fingerprints hash: RFC 8785
//! (JCS), with numbers written from their exact decimal value, and the
//! doubles form that records written before exact numbers were keyed with.

use crate::json::{JsonRefusal, Value};

/// The canonical form of a JSON document, or `None` if it has none (see
/// [`canonical_json_strict`]).
///
/// RFC 8785 (JCS), except for numbers: each is written from its exact
/// decimal value ([`crate::json`]), as ECMAScript would write a number
/// with exactly those digits. A number whose digits are the shortest of
/// its double (`100`, `1.5`, `0.1`) is written as RFC 8785 writes it; one
/// that a double would round (`0.10000000000000001`, a 64-bit id) keeps
/// every digit. Written here rather than through a general serializer
/// because it runs on every protected request: one parse, then one pass
/// writing into a buffer of the body's size.
///
/// A document that [`canonical_json_strict`] refuses gives `None` too, so
/// its fingerprint is taken over its bytes: two such bodies never
/// fingerprint alike unless they are the same bytes.
pub fn canonical_json(body: &[u8]) -> Option<Vec<u8>> {
    canonical_json_strict(body).ok()
}

/// Integers beyond this magnitude do not all have a double of their own.
const SAFE_INTEGER: u64 = 1 << 53;

/// [`canonical_json`], saying why there is none. Parsed once: duplicate
/// names and numbers out of range are refused while the document is read.
pub fn canonical_json_strict(body: &[u8]) -> Result<Vec<u8>, JsonRefusal> {
    let value = json_strict(body)?;
    Ok(canonical_json_value(&value, body.len()))
}

/// Parses `body` as JSON ([`crate::json::parse`]), refusing what
/// [`canonical_json_strict`] refuses: for callers that look into the
/// document (a key field, the fields a fingerprint covers) before writing
/// its [canonical form](canonical_json_value).
pub fn json_strict(body: &[u8]) -> Result<Value, JsonRefusal> {
    crate::json::parse(body)
}

/// The canonical form of a parsed document, into a buffer of `capacity`
/// bytes to begin with (the body's length is a good guess).
pub fn canonical_json_value(value: &Value, capacity: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(capacity);
    write_canonical(value, &mut out, Numbers::Exact).expect("the exact form writes every number");
    out
}

/// The canonical form versions before `v3` gave a document: RFC 8785
/// exactly, each number read as the nearest binary double. Only for
/// fingerprints that find records those versions wrote (`v2:` and the
/// earlier `v1:` forms).
///
/// Refused as those versions refused: [`JsonRefusal::Ambiguous`] for an
/// integer literal beyond ±2^53 that fits 64 bits (they refused such a
/// body with `400`, so no record holds its fingerprint), and
/// [`JsonRefusal::NotJson`] for a number beyond the doubles' range (they
/// hashed such a body as bytes).
pub fn canonical_json_doubles(body: &[u8]) -> Result<Vec<u8>, JsonRefusal> {
    canonical_json_doubles_value(&json_strict(body)?, body.len())
}

/// [`canonical_json_doubles`] of a parsed document.
pub fn canonical_json_doubles_value(
    value: &Value,
    capacity: usize,
) -> Result<Vec<u8>, JsonRefusal> {
    let mut out = Vec::with_capacity(capacity);
    write_canonical(value, &mut out, Numbers::Doubles)?;
    Ok(out)
}

/// A number as versions before `v3` wrote it: an integer literal as its
/// integer when a double holds it exactly (serde_json read it as a 64-bit
/// integer), anything else as ECMAScript writes its double.
fn write_double(n: &crate::json::Number, out: &mut Vec<u8>) -> Result<(), JsonRefusal> {
    let text = n.as_str();
    if n.is_integer_literal() {
        let (negative, digits) = match text.strip_prefix('-') {
            Some(digits) => (true, digits),
            None => (false, text),
        };
        // serde_json read integers of 64 bits as integers, the rest as
        // doubles; earlier versions refused the integers a double rounds.
        let fits = match digits.parse::<u64>() {
            Ok(m) if negative => m <= 1 << 63,
            Ok(_) => true,
            Err(_) => false,
        };
        if fits {
            let m = digits.parse::<u64>().unwrap_or(u64::MAX);
            if m > SAFE_INTEGER {
                return Err(JsonRefusal::Ambiguous(format!(
                    "the integer {text} is beyond ±2^53, where distinct integers read as one number"
                )));
            }
            if negative && m != 0 {
                out.push(b'-');
            }
            out.extend_from_slice(itoa::Buffer::new().format(m).as_bytes());
            return Ok(());
        }
    }
    let f = n.as_f64();
    if !f.is_finite() {
        return Err(JsonRefusal::NotJson);
    }
    out.extend_from_slice(ryu_js::Buffer::new().format_finite(f).as_bytes());
    Ok(())
}

/// How the canonical form writes numbers.
#[derive(Clone, Copy)]
enum Numbers {
    /// By exact decimal value ([`canonical_json`]).
    Exact,
    /// As binary doubles ([`canonical_json_doubles`]).
    Doubles,
}

/// JCS (RFC 8785 §3.2): no white space; members sorted by their names'
/// UTF-16 code units; strings with the minimal escapes of ECMAScript's
/// `JSON.stringify`; numbers as `numbers` says.
fn write_canonical(value: &Value, out: &mut Vec<u8>, numbers: Numbers) -> Result<(), JsonRefusal> {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(n) => match numbers {
            Numbers::Exact => crate::json::write_decimal(&n.decimal(), out),
            Numbers::Doubles => write_double(n, out)?,
        },
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(item, out, numbers)?;
            }
            out.push(b']');
        }
        Value::Object(members) => {
            out.push(b'{');
            // The map iterates in UTF-8 byte order, which is UTF-16 order
            // unless a name holds a character from U+E000 to U+FFFF (UTF-8
            // lead byte 0xEE or 0xEF), which UTF-16 sorts after surrogates.
            let mut sorted: Vec<(&String, &Value)> = members.iter().collect();
            if sorted
                .iter()
                .any(|(k, _)| k.bytes().any(|b| b == 0xEE || b == 0xEF))
            {
                sorted.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
            }
            for (i, (name, item)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(name, out);
                out.push(b':');
                write_canonical(item, out, numbers)?;
            }
            out.push(b'}');
        }
    }
    Ok(())
}

fn write_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut start = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0x00..=0x1f => {
                out.extend_from_slice(&bytes[start..i]);
                const HEX: &[u8; 16] = b"0123456789abcdef";
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(b >> 4)]);
                out.push(HEX[usize::from(b & 0xf)]);
                start = i + 1;
                continue;
            }
            _ => continue,
        };
        out.extend_from_slice(&bytes[start..i]);
        out.extend_from_slice(escape);
        start = i + 1;
    }
    out.extend_from_slice(&bytes[start..]);
    out.push(b'"');
}

//! Key names: one Redis key per record, hash-tagged for Redis Cluster.
//!
//! A record `(tenant, operation, key)` lives at
//! `<prefix>:{<tenant>:<operation>:<key>}` where each part is
//! percent-encoded: every byte other than ASCII letters, digits and
//! `-_.~/` and space becomes `%XX`. So `{`, `}` and `:` inside a part can
//! neither end the hash tag nor fake a separator (the name is unambiguous),
//! and the glob characters `*?[]\` never reach a `SCAN MATCH` pattern.
//! Everything of one record is inside one hash tag, so it lands on one
//! cluster slot.

use idem::{IdempotencyKey, Scope};

/// Percent-encodes `part` as described in the [module docs](self).
pub(crate) fn encode(part: &str, out: &mut String) {
    for b in part.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~' | b'/' | b' ') {
            out.push(char::from(b));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(b >> 4)]));
            out.push(char::from(HEX[usize::from(b & 0xf)]));
        }
    }
}

const HEX: &[u8; 16] = b"0123456789ABCDEF";

/// The Redis key of a record.
pub(crate) fn record_key(prefix: &str, scope: &Scope, key: &IdempotencyKey) -> String {
    let mut out = String::with_capacity(prefix.len() + 8 + scope.tenant().len() * 2);
    out.push_str(prefix);
    out.push_str(":{");
    encode(scope.tenant(), &mut out);
    out.push(':');
    encode(scope.operation(), &mut out);
    out.push(':');
    encode(key.as_str(), &mut out);
    out.push('}');
    out
}

/// The `SCAN MATCH` pattern for every record, or one tenant's.
pub(crate) fn scan_pattern(prefix: &str, tenant: Option<&str>) -> String {
    let mut out = format!("{prefix}:{{");
    if let Some(tenant) = tenant {
        encode(tenant, &mut out);
        out.push(':');
    }
    out.push('*');
    out
}

/// Whether a key prefix is safe: 1 to 64 of ASCII letters, digits, `-_.`,
/// so it holds no hash-tag brace and no glob character.
pub(crate) fn valid_prefix(prefix: &str) -> bool {
    !prefix.is_empty()
        && prefix.len() <= 64
        && prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// The Redis Cluster slot of the key `name`: CRC16 (XMODEM) of its hash
/// tag (the part between the first `{` and the next `}`, when not empty)
/// or of the whole name, modulo 16384, as the cluster computes it. Used to
/// send `WAIT` to the node that holds a record.
#[cfg(feature = "cluster")]
pub(crate) fn slot(name: &str) -> u16 {
    let bytes = name.as_bytes();
    let hashed = bytes
        .iter()
        .position(|b| *b == b'{')
        .and_then(|open| {
            let rest = &bytes[open + 1..];
            let close = rest.iter().position(|b| *b == b'}')?;
            (close > 0).then(|| &rest[..close])
        })
        .unwrap_or(bytes);
    crc16(hashed) % 16_384
}

/// CRC-16/XMODEM (polynomial 0x1021, initial value 0), Redis Cluster's.
#[cfg(feature = "cluster")]
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for b in bytes {
        crc ^= u16::from(*b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 == 0 {
                crc << 1
            } else {
                (crc << 1) ^ 0x1021
            };
        }
    }
    crc
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(tenant: &str, operation: &str, key: &str) -> String {
        let scope = Scope::new(tenant, operation).expect("scope");
        record_key("idem", &scope, &key.parse().expect("key"))
    }

    #[test]
    fn braces_and_colons_are_encoded() {
        assert_eq!(
            name("acme", "POST /v1/payments", "k-1"),
            "idem:{acme:POST /v1/payments:k-1}"
        );
        let tricky = name("a}b", "x:y", "{k}*?[]\\%");
        assert_eq!(tricky, "idem:{a%7Db:x%3Ay:%7Bk%7D%2A%3F%5B%5D%5C%25}");
        // One hash tag: exactly one '{' and one '}', at the ends.
        assert_eq!(tricky.matches('{').count(), 1);
        assert_eq!(tricky.matches('}').count(), 1);
        assert!(tricky.ends_with('}'));
    }

    #[test]
    fn names_are_unambiguous() {
        // Parts that would collide if ':' were kept as is.
        assert_ne!(name("a:b", "c", "d"), name("a", "b:c", "d"));
        assert_ne!(name("a", "b:c", "d"), name("a", "b", "c:d"));
        assert_ne!(name("a%3Ab", "c", "d"), name("a:b", "c", "d"));
    }

    #[test]
    fn scan_patterns_carry_no_glob_from_input() {
        assert_eq!(scan_pattern("idem", None), "idem:{*");
        assert_eq!(scan_pattern("idem", Some("t*[x]")), "idem:{t%2A%5Bx%5D:*");
    }

    #[test]
    fn prefixes() {
        assert!(valid_prefix("idem"));
        assert!(valid_prefix("app-1.idem_v2"));
        for bad in ["", "a{b", "a}b", "a*", "a:b", "a b"] {
            assert!(!valid_prefix(bad), "{bad:?}");
        }
    }
}

#[cfg(all(test, feature = "cluster"))]
mod slot_tests {
    use super::{crc16, slot};

    /// The check value of CRC-16/XMODEM, and slots the Redis documentation
    /// and `CLUSTER KEYSLOT` give.
    #[test]
    fn slots_as_redis_computes_them() {
        assert_eq!(crc16(b"123456789"), 0x31C3);
        assert_eq!(slot("foo"), 12_182);
        assert_eq!(slot("{user1000}.following"), slot("user1000"));
        // Read off `redis-cli CLUSTER KEYSLOT` (Redis 7.0).
        assert_eq!(slot("foo{}{bar}"), 8_363);
        assert_eq!(slot("idem:{t:POST /v1:k}"), 1_520);
        assert_ne!(
            slot("foo{}{bar}"),
            slot("bar"),
            "an empty tag hashes the whole name"
        );
        assert_eq!(slot("idem:{t:POST /v1:k}"), slot("t:POST /v1:k"));
    }
}

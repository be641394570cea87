//! Who is calling, what they are doing, and the key they chose.
//!
//! A record is identified by `(tenant, operation, key)`. The [`Scope`] holds
//! the first two: the tenant comes from authenticated context and the
//! operation names what is done (`POST /v1/payments`, a consumer name). The
//! [`IdempotencyKey`] is the client's token.
//!
//! ```
//! use idem::{IdempotencyKey, KeyError, Scope};
//!
//! let key: IdempotencyKey = "order-42-attempt".parse()?;
//! assert_eq!(key.as_str(), "order-42-attempt");
//! assert_eq!("".parse::<IdempotencyKey>(), Err(KeyError::Empty));
//!
//! let scope = Scope::new("tenant-a", "POST /v1/payments")?;
//! assert_eq!(scope.tenant(), "tenant-a");
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

/// The longest key accepted, in bytes (every accepted byte is one character).
pub const MAX_KEY_LEN: usize = 255;

/// The longest tenant or operation accepted, in bytes.
pub const MAX_SCOPE_LEN: usize = 255;

/// A client-chosen idempotency key: 1 to 255 characters of visible ASCII
/// (`!` through `~`), or, for a key sent as a structured-field string
/// (`Idempotency-Key: "two words"`), printable ASCII, spaces included
/// ([`from_quoted`](Self::from_quoted)).
///
/// Construction validates, so holding an `IdempotencyKey` proves it is
/// well-formed. Cloning is cheap (shared, immutable).
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct IdempotencyKey(Arc<str>);

/// Why a string is not a valid [`IdempotencyKey`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    /// The key has no characters.
    #[error("idempotency key is empty; send 1 to 255 visible ASCII characters")]
    Empty,
    /// The key is longer than [`MAX_KEY_LEN`] bytes.
    #[error("idempotency key is {len} bytes long; the limit is {max}", max = MAX_KEY_LEN)]
    TooLong {
        /// The length that was sent, in bytes.
        len: usize,
    },
    /// The key holds a byte outside visible ASCII (space, control, non-ASCII).
    #[error(
        "idempotency key has byte 0x{byte:02x} at position {position}; only visible ASCII (0x21-0x7e) is allowed"
    )]
    InvalidByte {
        /// Zero-based byte offset of the first offending byte.
        position: usize,
        /// The offending byte.
        byte: u8,
    },
}

impl IdempotencyKey {
    /// Validates raw bytes (as they arrive in a header) as a key.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KeyError> {
        validate_key(bytes, false)?;
        Ok(Self::new_unchecked(bytes))
    }

    /// Validates the content of a structured-field string (RFC 8941: the
    /// characters between the quotes, unescaped) as a key: 1 to 255
    /// printable ASCII characters, where a space is allowed.
    pub fn from_quoted(bytes: &[u8]) -> Result<Self, KeyError> {
        validate_key(bytes, true)?;
        Ok(Self::new_unchecked(bytes))
    }

    fn new_unchecked(bytes: &[u8]) -> Self {
        let text = std::str::from_utf8(bytes).expect("printable ASCII is valid UTF-8");
        Self(Arc::from(text))
    }

    /// The key as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

fn validate_key(bytes: &[u8], space: bool) -> Result<(), KeyError> {
    if bytes.is_empty() {
        return Err(KeyError::Empty);
    }
    if bytes.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong { len: bytes.len() });
    }
    match bytes
        .iter()
        .position(|b| !(b.is_ascii_graphic() || (space && *b == b' ')))
    {
        Some(position) => Err(KeyError::InvalidByte {
            position,
            byte: bytes[position],
        }),
        None => Ok(()),
    }
}

impl FromStr for IdempotencyKey {
    type Err = KeyError;

    /// Reads a key as [`from_quoted`](IdempotencyKey::from_quoted) does
    /// (spaces allowed): a key a store or an operator gives back must read
    /// as the key stored, whichever form it arrived in.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::from_quoted(s.as_bytes())
    }
}

impl TryFrom<&str> for IdempotencyKey {
    type Error = KeyError;

    fn try_from(s: &str) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl AsRef<str> for IdempotencyKey {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("IdempotencyKey").field(&&*self.0).finish()
    }
}

/// The part of a record's identity that is not the key: who calls
/// (`tenant`) and what they do (`operation`).
///
/// Both are non-empty, at most [`MAX_SCOPE_LEN`] bytes, and free of control
/// characters, so they are safe to log, to put in a URL path segment once
/// percent-encoded, and to use as a storage key.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope {
    tenant: Arc<str>,
    operation: Arc<str>,
}

/// Which part of a [`Scope`] is wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScopeField {
    /// The tenant.
    Tenant,
    /// The operation.
    Operation,
}

impl fmt::Display for ScopeField {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Tenant => "tenant",
            Self::Operation => "operation",
        })
    }
}

/// Why a tenant or operation is not acceptable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScopeError {
    /// The field is empty.
    #[error("{0} is empty")]
    Empty(ScopeField),
    /// The field is longer than [`MAX_SCOPE_LEN`] bytes.
    #[error("{field} is {len} bytes long; the limit is {max}", max = MAX_SCOPE_LEN)]
    TooLong {
        /// Which field.
        field: ScopeField,
        /// Its length in bytes.
        len: usize,
    },
    /// The field holds a control character.
    #[error("{field} has a control character at byte {position}")]
    ControlChar {
        /// Which field.
        field: ScopeField,
        /// Byte offset of the character.
        position: usize,
    },
}

fn validate_scope_part(field: ScopeField, value: &str) -> Result<(), ScopeError> {
    if value.is_empty() {
        return Err(ScopeError::Empty(field));
    }
    if value.len() > MAX_SCOPE_LEN {
        return Err(ScopeError::TooLong {
            field,
            len: value.len(),
        });
    }
    // Visible ASCII and spaces, the common case, in one pass over the
    // bytes; anything else (a control byte, or text beyond ASCII, where
    // U+0080..U+009F are controls too) is looked at char by char.
    if value.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Ok(());
    }
    match value.char_indices().find(|(_, c)| c.is_control()) {
        Some((position, _)) => Err(ScopeError::ControlChar { field, position }),
        None => Ok(()),
    }
}

impl Scope {
    /// Validates and builds a scope.
    pub fn new(tenant: &str, operation: &str) -> Result<Self, ScopeError> {
        validate_scope_part(ScopeField::Tenant, tenant)?;
        validate_scope_part(ScopeField::Operation, operation)?;
        Ok(Self {
            tenant: Arc::from(tenant),
            operation: Arc::from(operation),
        })
    }

    /// Who is calling.
    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    /// What is being done.
    pub fn operation(&self) -> &str {
        &self.operation
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scope")
            .field("tenant", &&*self.tenant)
            .field("operation", &&*self.operation)
            .finish()
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.tenant, self.operation)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_every_visible_ascii_byte() {
        let all: String = (0x21u8..=0x7e).map(char::from).collect();
        let key: IdempotencyKey = all.parse().expect("visible ASCII is valid");
        assert_eq!(key.as_str(), all);
    }

    #[test]
    fn length_bounds() {
        assert_eq!("".parse::<IdempotencyKey>(), Err(KeyError::Empty));
        assert!("a".repeat(255).parse::<IdempotencyKey>().is_ok());
        assert_eq!(
            "a".repeat(256).parse::<IdempotencyKey>(),
            Err(KeyError::TooLong { len: 256 })
        );
    }

    #[test]
    fn rejects_space_control_and_non_ascii_with_position() {
        // Parsed text may hold a space (a quoted key read back); a bare
        // header value may not.
        assert_eq!(
            "ab c"
                .parse::<IdempotencyKey>()
                .map(|k| k.as_str().to_owned()),
            Ok("ab c".to_owned())
        );
        assert_eq!(
            IdempotencyKey::from_bytes(b"ab c"),
            Err(KeyError::InvalidByte {
                position: 2,
                byte: b' '
            })
        );
        assert_eq!(
            IdempotencyKey::from_bytes(b"abc\n"),
            Err(KeyError::InvalidByte {
                position: 3,
                byte: b'\n'
            })
        );
        assert_eq!(
            "é".parse::<IdempotencyKey>(),
            Err(KeyError::InvalidByte {
                position: 0,
                byte: 0xc3
            })
        );
        assert_eq!(
            IdempotencyKey::from_bytes(&[b'a', 0x7f]),
            Err(KeyError::InvalidByte {
                position: 1,
                byte: 0x7f
            })
        );
    }

    #[test]
    fn error_messages_say_what_to_do() {
        let msg = KeyError::TooLong { len: 300 }.to_string();
        assert!(msg.contains("300") && msg.contains("255"), "{msg}");
        let msg = KeyError::InvalidByte {
            position: 4,
            byte: 0x20,
        }
        .to_string();
        assert!(msg.contains("0x20") && msg.contains("position 4"), "{msg}");
    }

    #[test]
    fn scope_validation() {
        assert!(Scope::new("t", "POST /v1/payments").is_ok());
        assert!(Scope::new("tenant ünïcode", "op").is_ok());
        assert_eq!(
            Scope::new("", "op"),
            Err(ScopeError::Empty(ScopeField::Tenant))
        );
        assert_eq!(
            Scope::new("t", ""),
            Err(ScopeError::Empty(ScopeField::Operation))
        );
        assert_eq!(
            Scope::new("t", &"x".repeat(256)),
            Err(ScopeError::TooLong {
                field: ScopeField::Operation,
                len: 256
            })
        );
        assert_eq!(
            Scope::new("a\u{0}b", "op"),
            Err(ScopeError::ControlChar {
                field: ScopeField::Tenant,
                position: 1
            })
        );
        // DEL, and the C1 controls beyond ASCII, at their byte positions.
        for (op, position) in [("op\u{7f}", 2), ("é\u{85}x", 2), ("ab\u{9f}", 2)] {
            assert_eq!(
                Scope::new("t", op),
                Err(ScopeError::ControlChar {
                    field: ScopeField::Operation,
                    position
                }),
                "{op:?}"
            );
        }
        // Every single ASCII byte: refused exactly when it is a control.
        for b in 0u8..0x80 {
            let text = format!("x{}", char::from(b));
            assert_eq!(
                Scope::new(&text, "op").is_err(),
                b.is_ascii_control(),
                "{b:#04x}"
            );
        }
    }
}

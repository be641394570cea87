//! What a route's answers promise, in the forms clients and other specs
//! already read: named profiles, the switches they are made of, and the
//! format a route's keys must have.
//!
//! Two profiles exist. [`Profile::Stripe`] (the default) marks replays
//! `Idempotent-Replayed: true`, as Stripe and the Agentic Commerce
//! Protocol do. [`Profile::Ietf`] follows the IETF *Idempotency-Key*
//! draft and the common reading of its silences: `Idempotency-Replayed`,
//! an answer too large to keep replayed as its status and headers with an
//! empty body, `Retry-After` on every `409`, and the retention advertised
//! in `Idempotency-TTL`. A route takes a profile and may change any one
//! switch after it.
//!
//! ```
//! use idem_http::{Contract, KeyFormat, NotRetained, Profile};
//!
//! let contract = Contract::of(Profile::Ietf)
//!     .with_not_retained(NotRetained::Problem)
//!     .with_key_format(KeyFormat::UuidV7);
//! assert_eq!(contract.replay_headers[0].as_str(), "idempotency-replayed");
//! let key = idem::IdempotencyKey::from_bytes(b"0190b3a4-7c1e-7d2a-9f3b-5a6c7d8e9f01")?;
//! assert!(contract.check_key(&key).is_ok());
//! let key = idem::IdempotencyKey::from_bytes(b"order-42")?;
//! assert!(contract.check_key(&key).is_err());
//! # Ok::<(), idem::KeyError>(())
//! ```

use std::time::Duration;

use http::HeaderName;
use idem::IdempotencyKey;

use crate::headers::{IDEMPOTENCY_REPLAYED, IDEMPOTENT_REPLAYED};
use crate::{Problem, ProblemKind};

/// A named set of [`Contract`] switches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Profile {
    /// `Idempotent-Replayed: true` on replays, an answer not retained
    /// replayed as a problem document under its original status, no
    /// `Retry-After` on a held outcome, no retention header.
    #[default]
    Stripe,
    /// `Idempotency-Replayed: true` on replays, an answer not retained
    /// replayed as its status and headers with an empty body,
    /// `Retry-After` on every `409`, `Idempotency-TTL` on every protected
    /// answer.
    Ietf,
}

impl Profile {
    /// Every profile, for messages and documentation.
    pub const ALL: [Profile; 2] = [Profile::Stripe, Profile::Ietf];

    /// The name a configuration file gives it.
    pub const fn name(self) -> &'static str {
        match self {
            Self::Stripe => "stripe",
            Self::Ietf => "ietf",
        }
    }

    /// The profile of this name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// How a replay of an answer whose body was not kept (over
/// `max_stored_response`, or streamed) looks. Both forms carry
/// `Idempotency-Status: not-retained`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NotRetained {
    /// A problem document (`…/idempotency-response-not-retained`) under
    /// the original status: readable by people, but a client that reads
    /// only the status takes it for the result.
    #[default]
    Problem,
    /// The original status and headers with an empty body: the headers
    /// that describe the absent body (`Content-Type`, `Content-Encoding`,
    /// digests, `Content-Range`) are left out.
    Empty,
}

/// How long a held outcome's `409` tells the client to wait under the
/// IETF profile: a held record settles only when an operator or a lookup
/// acts, so a retry sooner learns nothing new.
pub const HELD_RETRY_AFTER: Duration = Duration::from_secs(60);

/// The contract switches of one route; see the [module docs](self).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Contract {
    /// The headers that mark a replay (`true`): one spelling or both.
    pub replay_headers: Vec<HeaderName>,
    /// How an answer not retained is replayed.
    pub not_retained: NotRetained,
    /// The `Retry-After` of a held outcome's `409` (`None`: none, since
    /// retrying changes nothing until it is settled).
    pub held_retry_after: Option<Duration>,
    /// Whether every protected answer says in `Idempotency-TTL` how many
    /// seconds the route keeps a key's answer.
    pub retention_header: bool,
    /// The format a key must have, beside length and visible ASCII.
    pub key_format: Option<KeyFormat>,
    /// The fewest bytes a key may have (default 1).
    pub key_min_length: usize,
}

impl Default for Contract {
    fn default() -> Self {
        Self::of(Profile::default())
    }
}

impl Contract {
    /// The switches of `profile`, with no key format.
    pub fn of(profile: Profile) -> Self {
        match profile {
            Profile::Stripe => Self {
                replay_headers: vec![IDEMPOTENT_REPLAYED],
                not_retained: NotRetained::Problem,
                held_retry_after: None,
                retention_header: false,
                key_format: None,
                key_min_length: 1,
            },
            Profile::Ietf => Self {
                replay_headers: vec![IDEMPOTENCY_REPLAYED],
                not_retained: NotRetained::Empty,
                held_retry_after: Some(HELD_RETRY_AFTER),
                retention_header: true,
                key_format: None,
                key_min_length: 1,
            },
        }
    }

    /// Takes `profile`'s switches, keeping the key rules.
    pub fn with_profile(self, profile: Profile) -> Self {
        Self {
            key_format: self.key_format,
            key_min_length: self.key_min_length,
            ..Self::of(profile)
        }
    }

    /// Sets the replay marker headers.
    pub fn with_replay_headers(mut self, names: Vec<HeaderName>) -> Self {
        self.replay_headers = names;
        self
    }

    /// Sets how an answer not retained is replayed.
    pub fn with_not_retained(mut self, form: NotRetained) -> Self {
        self.not_retained = form;
        self
    }

    /// Sets the `Retry-After` of a held outcome's `409`.
    pub fn with_held_retry_after(mut self, after: Option<Duration>) -> Self {
        self.held_retry_after = after;
        self
    }

    /// Sets whether protected answers carry `Idempotency-TTL`.
    pub fn with_retention_header(mut self, on: bool) -> Self {
        self.retention_header = on;
        self
    }

    /// Sets the format keys must have.
    pub fn with_key_format(mut self, format: KeyFormat) -> Self {
        self.key_format = Some(format);
        self
    }

    /// Sets the fewest bytes a key may have.
    pub fn with_key_min_length(mut self, bytes: usize) -> Self {
        self.key_min_length = bytes.max(1);
        self
    }

    /// Whether `key` keeps the route's key rules: `400
    /// …/idempotency-key-invalid`, naming the rule, when it does not.
    pub fn check_key(&self, key: &IdempotencyKey) -> Result<(), Problem> {
        let text = key.as_str();
        if text.len() < self.key_min_length {
            return Err(Problem::new(
                ProblemKind::KeyInvalid,
                format!(
                    "the key is {} bytes long; this route takes keys of at least {} bytes",
                    text.len(),
                    self.key_min_length
                ),
            ));
        }
        match &self.key_format {
            Some(format) if !format.matches(text) => Err(Problem::new(
                ProblemKind::KeyInvalid,
                format!("this route takes keys that are {}", format.describe()),
            )),
            _ => Ok(()),
        }
    }
}

/// A format keys must have. The UUID forms are the hyphenated form of
/// RFC 9562 (`8-4-4-4-12` hex digits, either case) that OpenAPI's
/// `format: uuid` names; a ULID is 26 Crockford base-32 characters.
#[derive(Debug, Clone)]
pub enum KeyFormat {
    /// Any UUID (RFC 9562 variant).
    Uuid,
    /// A random UUID, version 4.
    UuidV4,
    /// A time-ordered UUID, version 7 (what Apache Iceberg's REST catalog
    /// requires).
    UuidV7,
    /// A ULID.
    Ulid,
    /// A regular expression the whole key must match. Matching takes time
    /// linear in the key (no backtracking), so no key can stall it.
    Pattern(regex::Regex),
}

impl PartialEq for KeyFormat {
    fn eq(&self, other: &Self) -> bool {
        self.name() == other.name()
    }
}

impl Eq for KeyFormat {}

impl KeyFormat {
    /// The format a configuration names: `uuid`, `uuidv4`, `uuidv7`,
    /// `ulid`, or else a regular expression the whole key must match.
    pub fn parse(text: &str) -> Result<Self, regex::Error> {
        Ok(match text {
            "uuid" => Self::Uuid,
            "uuidv4" => Self::UuidV4,
            "uuidv7" => Self::UuidV7,
            "ulid" => Self::Ulid,
            pattern => Self::Pattern(
                regex::RegexBuilder::new(&format!("^(?:{pattern})$"))
                    .size_limit(1 << 20)
                    .build()?,
            ),
        })
    }

    /// Its name as configured (the pattern as written for a regex).
    pub fn name(&self) -> &str {
        match self {
            Self::Uuid => "uuid",
            Self::UuidV4 => "uuidv4",
            Self::UuidV7 => "uuidv7",
            Self::Ulid => "ulid",
            Self::Pattern(re) => re
                .as_str()
                .strip_prefix("^(?:")
                .and_then(|s| s.strip_suffix(")$"))
                .unwrap_or(re.as_str()),
        }
    }

    /// What it asks, for the refusal's detail.
    pub fn describe(&self) -> String {
        match self {
            Self::Uuid => "UUIDs (8-4-4-4-12 hex digits)".to_owned(),
            Self::UuidV4 => "version 4 UUIDs (8-4-4-4-12 hex digits)".to_owned(),
            Self::UuidV7 => "version 7 UUIDs (8-4-4-4-12 hex digits)".to_owned(),
            Self::Ulid => "ULIDs (26 Crockford base-32 characters)".to_owned(),
            Self::Pattern(_) => format!("matched whole by the pattern {}", self.name()),
        }
    }

    /// The pattern an OpenAPI schema states for it (the regex's own for a
    /// pattern).
    pub fn pattern(&self) -> String {
        const HEX: &str = "[0-9a-fA-F]";
        let uuid = |version: &str| {
            format!("^{HEX}{{8}}-{HEX}{{4}}-{version}{HEX}{{3}}-[89abAB]{HEX}{{3}}-{HEX}{{12}}$")
        };
        match self {
            Self::Uuid => uuid("[1-8]"),
            Self::UuidV4 => uuid("4"),
            Self::UuidV7 => uuid("7"),
            Self::Ulid => "^[0-7][0-9A-HJKMNP-TV-Za-hjkmnp-tv-z]{25}$".to_owned(),
            Self::Pattern(re) => re.as_str().to_owned(),
        }
    }

    /// Whether `key` has this format.
    pub fn matches(&self, key: &str) -> bool {
        match self {
            Self::Uuid => uuid_version(key).is_some_and(|v| (b'1'..=b'8').contains(&v)),
            Self::UuidV4 => uuid_version(key) == Some(b'4'),
            Self::UuidV7 => uuid_version(key) == Some(b'7'),
            Self::Ulid => is_ulid(key),
            Self::Pattern(re) => re.is_match(key),
        }
    }
}

/// The version digit of a hyphenated RFC 9562 UUID, `None` when `key` is
/// not one (wrong shape, not hex, or not the RFC's variant).
fn uuid_version(key: &str) -> Option<u8> {
    let b = key.as_bytes();
    let shaped = b.len() == 36
        && b.iter().enumerate().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => *c == b'-',
            _ => c.is_ascii_hexdigit(),
        });
    if !shaped || !matches!(b[19], b'8' | b'9' | b'a' | b'b' | b'A' | b'B') {
        return None;
    }
    Some(b[14])
}

/// Whether `key` is a ULID: 26 characters of Crockford's base 32 (no I,
/// L, O, U; either case), the first at most `7` (128 bits).
fn is_ulid(key: &str) -> bool {
    let b = key.as_bytes();
    b.len() == 26
        && (b'0'..=b'7').contains(&b[0])
        && b.iter().all(|c| {
            let c = c.to_ascii_uppercase();
            c.is_ascii_digit() || (c.is_ascii_uppercase() && !b"ILOU".contains(&c))
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(text: &str) -> IdempotencyKey {
        IdempotencyKey::from_bytes(text.as_bytes()).expect("key")
    }

    #[test]
    fn uuid_forms_are_told_apart_by_version_and_variant() {
        let v4 = "9b2f6c1e-3d4a-4f5b-8c6d-7e8f9a0b1c2d";
        let v7 = "0190B3A4-7C1E-7D2A-9F3B-5A6C7D8E9F01";
        for (format, yes, no) in [
            (KeyFormat::Uuid, vec![v4, v7], vec![]),
            (KeyFormat::UuidV4, vec![v4], vec![v7]),
            (KeyFormat::UuidV7, vec![v7], vec![v4]),
        ] {
            for k in yes {
                assert!(format.matches(k), "{format:?} {k}");
            }
            for k in no {
                assert!(!format.matches(k), "{format:?} {k}");
            }
        }
        for bad in [
            "9b2f6c1e3d4a4f5b8c6d7e8f9a0b1c2d",       // no hyphens
            "{9b2f6c1e-3d4a-4f5b-8c6d-7e8f9a0b1c2d}", // braced
            "9b2f6c1e-3d4a-4f5b-7c6d-7e8f9a0b1c2d",   // not the RFC variant
            "9b2f6c1e-3d4a-4f5b-8c6d-7e8f9a0b1c2g",   // not hex
            "9b2f6c1e-3d4a-0f5b-8c6d-7e8f9a0b1c2d",   // version 0
            "9b2f6c1e-3d4a-4f5b-8c6d-7e8f9a0b1c2d0",  // too long
            "9b2f",                                   // too short
            "",
        ] {
            assert!(!KeyFormat::Uuid.matches(bad), "{bad}");
        }
    }

    #[test]
    fn ulids_are_crockford_base32_within_128_bits() {
        assert!(KeyFormat::Ulid.matches("01ARZ3NDEKTSV4RRFFQ69G5FAV"));
        assert!(KeyFormat::Ulid.matches("01arz3ndektsv4rrffq69g5fav"));
        assert!(KeyFormat::Ulid.matches("7ZZZZZZZZZZZZZZZZZZZZZZZZZ"));
        assert!(!KeyFormat::Ulid.matches("8ZZZZZZZZZZZZZZZZZZZZZZZZZ"));
        assert!(!KeyFormat::Ulid.matches("01ARZ3NDEKTSV4RRFFQ69G5FAI"));
        assert!(!KeyFormat::Ulid.matches("01ARZ3NDEKTSV4RRFFQ69G5FA"));
    }

    #[test]
    fn a_pattern_matches_the_whole_key() {
        let adcp = KeyFormat::parse("[A-Za-z0-9_.:-]{16,255}").expect("pattern");
        assert!(adcp.matches("order:2026-12-06.001"));
        assert!(!adcp.matches("short"));
        // Anchored: a match inside the key is not enough.
        let digits = KeyFormat::parse("[0-9]+").expect("pattern");
        assert!(!digits.matches("a123"));
        assert!(digits.matches("123"));
        assert_eq!(digits.name(), "[0-9]+");
        // An alternation stays whole under the anchors.
        let either = KeyFormat::parse("a|b").expect("pattern");
        assert!(!either.matches("ab"));
        assert!(KeyFormat::parse("(").is_err());
    }

    #[test]
    fn the_stated_patterns_agree_with_the_checks() {
        let keys = [
            "9b2f6c1e-3d4a-4f5b-8c6d-7e8f9a0b1c2d",
            "0190b3a4-7c1e-7d2a-9f3b-5a6c7d8e9f01",
            "9b2f6c1e-3d4a-4f5b-7c6d-7e8f9a0b1c2d",
            "01ARZ3NDEKTSV4RRFFQ69G5FAV",
            "8ZZZZZZZZZZZZZZZZZZZZZZZZZ",
            "01ARZ3NDEKTSV4RRFFQ69G5FAU",
            "not-a-uuid",
        ];
        for format in [
            KeyFormat::Uuid,
            KeyFormat::UuidV4,
            KeyFormat::UuidV7,
            KeyFormat::Ulid,
        ] {
            let stated = regex::Regex::new(&format.pattern()).expect("stated pattern");
            for k in keys {
                assert_eq!(stated.is_match(k), format.matches(k), "{format:?} {k}");
            }
        }
    }

    #[test]
    fn check_key_names_the_rule_that_failed() {
        let c = Contract::default().with_key_min_length(16);
        let short = c.check_key(&key("abc")).expect_err("too short");
        assert_eq!(short.kind(), Some(ProblemKind::KeyInvalid));
        assert!(
            short.detail().contains("at least 16 bytes"),
            "{}",
            short.detail()
        );
        let c = c.with_key_format(KeyFormat::UuidV7);
        let wrong = c
            .check_key(&key("9b2f6c1e-3d4a-4f5b-8c6d-7e8f9a0b1c2d"))
            .expect_err("v4 is not v7");
        assert!(
            wrong.detail().contains("version 7 UUIDs"),
            "{}",
            wrong.detail()
        );
        assert!(
            c.check_key(&key("0190b3a4-7c1e-7d2a-9f3b-5a6c7d8e9f01"))
                .is_ok()
        );
    }

    #[test]
    fn a_profile_keeps_the_key_rules() {
        let c = Contract::default()
            .with_key_format(KeyFormat::Ulid)
            .with_key_min_length(26)
            .with_profile(Profile::Ietf);
        assert_eq!(c.key_format, Some(KeyFormat::Ulid));
        assert_eq!(c.key_min_length, 26);
        assert_eq!(c.replay_headers, vec![IDEMPOTENCY_REPLAYED]);
        assert_eq!(Profile::from_name("ietf"), Some(Profile::Ietf));
        assert_eq!(Profile::from_name("IETF"), None);
    }
}

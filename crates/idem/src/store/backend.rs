//! For store authors: what every backend shares so that all agree — the
//! decision on an existing record at `reserve` ([`decide_existing`]), the
//! one way to print a store URL ([`redact_url`]) and the one way to read
//! its `?name=value&…` options ([`QueryOptions`]). A new backend reads
//! `Store`'s contract (its module docs), decides existing records here (or
//! mirrors these rules inside its database, as the SQL and Lua backends
//! do), and runs the conformance suite of `idem-testkit`.

use std::time::Duration;

use super::ReserveRequest;
use crate::{LeaseExpiry, Record, Timestamp};

/// The decision every store makes when `reserve` finds an existing record,
/// written once so that all backends agree. Backends that decide inside the
/// database (SQL, Lua) mirror these rules; the conformance suite checks them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExistingDecision {
    /// The record is logically gone (a final record past its retention):
    /// replace it with a fresh attempt 1.
    Replace,
    /// Take over the lapsed lease as attempt + 1.
    TakeOver,
    /// Replay the final record.
    Replay,
    /// Someone else holds it, or (under [`LeaseExpiry::Hold`]) it is held
    /// for reconciliation.
    InProgress {
        /// When asking again is worthwhile.
        retry_after: Duration,
        /// Whether the earlier attempt may have taken effect with nobody
        /// running it now: the record is marked outcome-unknown, or its
        /// lease lapsed and the policy holds it.
        outcome_unknown: bool,
    },
    /// Different request under the same key.
    Mismatch,
}

/// Applies the reservation rules to an existing record at the store's `now`.
pub fn decide_existing(
    existing: &Record,
    req: &ReserveRequest<'_>,
    now: Timestamp,
) -> ExistingDecision {
    if existing.is_expired(now) {
        return ExistingDecision::Replace;
    }
    if existing.fingerprint != req.fingerprint {
        return ExistingDecision::Mismatch;
    }
    if existing.state.is_final() {
        return ExistingDecision::Replay;
    }
    if existing.lease_live(now) {
        return ExistingDecision::InProgress {
            retry_after: existing.lease.locked_until.since(now),
            outcome_unknown: existing.is_outcome_unknown(),
        };
    }
    match req.on_lease_expiry {
        LeaseExpiry::Retry => ExistingDecision::TakeOver,
        // Its owner stopped renewing: whatever it did is unknown.
        LeaseExpiry::Hold => ExistingDecision::InProgress {
            retry_after: req.lease,
            outcome_unknown: true,
        },
    }
}

/// A broker URL (or a comma-separated list of them, as NATS takes) fit for
/// messages and logs: each as [`redact_url`] makes it, and a user-info part
/// without a password masked whole, since a broker reads it as a token
/// (`nats://s3cr3t@host` is token authentication).
///
/// ```
/// use idem::store::redact_broker_url;
/// assert_eq!(redact_broker_url("nats://s3cr3t@h:4222"), "nats://***@h:4222");
/// assert_eq!(
///     redact_broker_url("nats://u:p1@a:4222,nats://u:p2@b:4222"),
///     "nats://u:***@a:4222,nats://u:***@b:4222"
/// );
/// assert_eq!(redact_broker_url("nats://127.0.0.1:4222"), "nats://127.0.0.1:4222");
/// ```
pub fn redact_broker_url(url: &str) -> String {
    url.split(',')
        .map(|one| redact(one.trim(), true))
        .collect::<Vec<_>>()
        .join(",")
}

/// A store URL fit for messages and logs: any password replaced by `***`,
/// both in the user-info part (`postgres://user:secret@host/db`) and in a
/// `password=` query option. Every backend and the gateway use this one.
pub fn redact_url(url: &str) -> String {
    redact(url, false)
}

/// [`redact_url`]; with `bare_user_secret`, a user-info part without a
/// password is masked whole too (a broker's token).
fn redact(url: &str, bare_user_secret: bool) -> String {
    let (scheme, rest) = match url.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, url),
    };
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let authority = match authority.rsplit_once('@') {
        Some((userinfo, host)) => match userinfo.split_once(':') {
            Some((user, _password)) => format!("{user}:***@{host}"),
            None if bare_user_secret => format!("***@{host}"),
            None => format!("{userinfo}@{host}"),
        },
        None => authority.to_owned(),
    };
    let tail = match tail.split_once('?') {
        Some((path, query)) => {
            let query: Vec<String> = query
                .split('&')
                .map(|pair| match pair.split_once('=') {
                    Some((name, _)) if name.eq_ignore_ascii_case("password") => {
                        format!("{name}=***")
                    }
                    _ => pair.to_owned(),
                })
                .collect();
            format!("{path}?{}", query.join("&"))
        }
        None => tail.to_owned(),
    };
    match scheme {
        Some(scheme) => format!("{scheme}://{authority}{tail}"),
        None => format!("{authority}{tail}"),
    }
}

/// The `?name=value&…` options of a store URL, read one by one in the
/// order written, so that every backend accepts the same syntax and words
/// its refusals the same way.
///
/// Values are taken as written, without percent-decoding (a driver's own
/// options are passed on untouched through [`QueryOption::pair`], and the
/// driver decodes them). Empty pairs (`a=1&&b=2`, a trailing `&`) are
/// skipped; when an option appears twice, the backend sees both, and the
/// later one usually wins.
///
/// ```
/// use std::time::Duration;
/// use idem::store::backend::{QueryOptionError, QueryOptions};
///
/// let (base, options) = QueryOptions::split("sqlite://idem.db?readers=2&busy_timeout_ms=100");
/// assert_eq!(base, "sqlite://idem.db");
/// let (mut readers, mut busy_timeout) = (4, Duration::from_secs(5));
/// for option in options {
///     match option.name() {
///         "readers" => readers = option.positive_usize()?,
///         "busy_timeout_ms" => busy_timeout = option.positive_millis()?,
///         _ => return Err(option.unknown(&["readers", "busy_timeout_ms"])),
///     }
/// }
/// assert_eq!((readers, busy_timeout), (2, Duration::from_millis(100)));
///
/// let (_, mut options) = QueryOptions::split("sqlite://idem.db?readers=none");
/// let refused = options.next().expect("one option").positive_usize();
/// assert_eq!(
///     refused.expect_err("not a number").to_string(),
///     "readers must be a positive integer, not \"none\""
/// );
/// # Ok::<(), QueryOptionError>(())
/// ```
#[derive(Debug, Clone)]
pub struct QueryOptions<'a> {
    pairs: std::str::Split<'a, char>,
}

impl<'a> QueryOptions<'a> {
    /// The options of a query string (the text after the `?`, without it).
    pub fn new(query: &'a str) -> Self {
        Self {
            pairs: query.split('&'),
        }
    }

    /// Splits a store URL at its first `?`: the URL before it, and the
    /// options after it (none when there is no `?`).
    pub fn split(url: &'a str) -> (&'a str, Self) {
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        (base, Self::new(query))
    }
}

impl<'a> Iterator for QueryOptions<'a> {
    type Item = QueryOption<'a>;

    fn next(&mut self) -> Option<Self::Item> {
        self.pairs
            .by_ref()
            .find(|pair| !pair.is_empty())
            .map(QueryOption::new)
    }
}

/// One `name=value` option of a store URL (see [`QueryOptions`]), with
/// typed readers of its value. Every reader's error names the option and
/// quotes the value, and is meant to become the reason of the backend's
/// own "invalid store URL" error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueryOption<'a> {
    pair: &'a str,
    name: &'a str,
    value: Option<&'a str>,
}

impl<'a> QueryOption<'a> {
    fn new(pair: &'a str) -> Self {
        match pair.split_once('=') {
            Some((name, value)) => Self {
                pair,
                name,
                value: Some(value),
            },
            None => Self {
                pair,
                name: pair,
                value: None,
            },
        }
    }

    /// The option's name: the text before its first `=` (all of it when
    /// there is no `=`).
    pub fn name(&self) -> &'a str {
        self.name
    }

    /// The option as written (`name=value`), to pass on to a driver.
    pub fn pair(&self) -> &'a str {
        self.pair
    }

    /// The text after the first `=`, as written; an option without `=`
    /// has no value ([`QueryOptionError::NoValue`]).
    pub fn value(&self) -> Result<&'a str, QueryOptionError> {
        self.value.ok_or_else(|| QueryOptionError::NoValue {
            pair: self.pair.to_owned(),
        })
    }

    /// `true` or `false`, spelled exactly so.
    pub fn flag(&self) -> Result<bool, QueryOptionError> {
        self.choice(&[("true", true), ("false", false)])
    }

    /// A whole number from 1 to `u32::MAX`.
    pub fn positive_u32(&self) -> Result<u32, QueryOptionError> {
        self.positive()
    }

    /// A whole number from 1 to `usize::MAX`.
    pub fn positive_usize(&self) -> Result<usize, QueryOptionError> {
        self.positive()
    }

    /// A whole, positive number of milliseconds (up to `u64::MAX`).
    pub fn positive_millis(&self) -> Result<Duration, QueryOptionError> {
        self.positive().map(Duration::from_millis)
    }

    /// A whole number of milliseconds, zero included (up to `u64::MAX`).
    pub fn millis(&self) -> Result<Duration, QueryOptionError> {
        let value = self.value()?;
        value
            .parse::<u64>()
            .map(Duration::from_millis)
            .map_err(|_| self.invalid(value, "a whole number of milliseconds".to_owned()))
    }

    /// One of a fixed set of words, spelled exactly so: the value paired
    /// with it in `choices`.
    pub fn choice<T: Copy>(&self, choices: &[(&str, T)]) -> Result<T, QueryOptionError> {
        let value = self.value()?;
        choices
            .iter()
            .find(|(word, _)| *word == value)
            .map(|(_, chosen)| *chosen)
            .ok_or_else(|| {
                let words: Vec<&str> = choices.iter().map(|(word, _)| *word).collect();
                self.invalid(value, one_of(&words))
            })
    }

    /// The error for an option the backend does not know, naming the ones
    /// it does.
    pub fn unknown(&self, known: &[&str]) -> QueryOptionError {
        QueryOptionError::Unknown {
            name: self.name.to_owned(),
            known: known.iter().map(|name| (*name).to_owned()).collect(),
        }
    }

    /// A whole number above zero.
    fn positive<T: std::str::FromStr + PartialOrd + Default>(&self) -> Result<T, QueryOptionError> {
        let value = self.value()?;
        value
            .parse::<T>()
            .ok()
            .filter(|n| *n > T::default())
            .ok_or_else(|| self.invalid(value, "a positive integer".to_owned()))
    }

    /// Its value refused by a rule of the store's own: `expected` says what
    /// it must be.
    pub fn invalid_value(&self, expected: String) -> QueryOptionError {
        self.invalid(self.value().unwrap_or(""), expected)
    }

    fn invalid(&self, value: &str, expected: String) -> QueryOptionError {
        QueryOptionError::Invalid {
            name: self.name.to_owned(),
            value: value.to_owned(),
            expected,
        }
    }
}

/// `a`, `a or b`, `a, b or c`.
fn one_of(words: &[&str]) -> String {
    match words {
        [] => String::new(),
        [only] => (*only).to_owned(),
        [rest @ .., last] => format!("{} or {last}", rest.join(", ")),
    }
}

/// Why a store URL option was refused; a backend makes it the reason of
/// its own "invalid store URL" error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum QueryOptionError {
    /// An option without `=` (`?pool`).
    #[error("option {pair:?} has no value")]
    NoValue {
        /// The option as written.
        pair: String,
    },
    /// A value the option does not take (`max_connections=lots`).
    #[error("{name} must be {expected}, not {value:?}")]
    Invalid {
        /// The option's name.
        name: String,
        /// The value given.
        value: String,
        /// What it takes, in words (`a positive integer`, `true or false`).
        expected: String,
    },
    /// An option the backend does not know.
    #[error("unknown option {name:?}{}", known_list(.known))]
    Unknown {
        /// The option's name.
        name: String,
        /// The options the backend knows.
        known: Vec<String>,
    },
}

fn known_list(known: &[String]) -> String {
    if known.is_empty() {
        String::new()
    } else {
        format!(" (known: {})", known.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_redacted() {
        for (url, want) in [
            (
                "postgres://app:s3cret@db:5432/idem",
                "postgres://app:***@db:5432/idem",
            ),
            (
                "postgresql://app:p@ss@word@db/idem?sslmode=require",
                "postgresql://app:***@db/idem?sslmode=require",
            ),
            (
                "postgres://db/idem?user=app&password=s3cret",
                "postgres://db/idem?user=app&password=***",
            ),
            ("postgres://app@db/idem", "postgres://app@db/idem"),
            ("postgres://db", "postgres://db"),
        ] {
            assert_eq!(redact_url(url), want, "{url}");
            assert!(!redact_url(url).contains("s3cret"));
        }
    }

    #[test]
    fn other_schemes_and_plain_urls() {
        assert_eq!(
            redact_url("redis://:pw@127.0.0.1"),
            "redis://:***@127.0.0.1"
        );
        assert_eq!(redact_url("rediss://u:s3cret@h"), "rediss://u:***@h");
        assert_eq!(redact_url("sqlite://idem.db"), "sqlite://idem.db");
        assert_eq!(redact_url("redis://u@h"), "redis://u@h");
        assert_eq!(redact_url("redis://h:6379"), "redis://h:6379");
        assert_eq!(
            redact_url("redis://:s3cret@h:6379/2"),
            "redis://:***@h:6379/2"
        );
    }

    #[test]
    fn query_options_in_order_empty_pairs_skipped() {
        let (base, options) = QueryOptions::split("pg://h/db?a=1&&b=x=y&c&=v&");
        assert_eq!(base, "pg://h/db");
        let seen: Vec<(&str, &str, Option<&str>)> = options
            .map(|o| (o.pair(), o.name(), o.value().ok()))
            .collect();
        assert_eq!(
            seen,
            [
                ("a=1", "a", Some("1")),
                ("b=x=y", "b", Some("x=y")),
                ("c", "c", None),
                ("=v", "", Some("v")),
            ]
        );
        let (base, mut options) = QueryOptions::split("sqlite://x.db");
        assert_eq!(base, "sqlite://x.db");
        assert!(options.next().is_none());
        assert_eq!(QueryOptions::new("").count(), 0);
        // Taken as written: no percent-decoding.
        let option = QueryOptions::new("schema=a%20b").next().expect("one");
        assert_eq!(option.value(), Ok("a%20b"));
    }

    #[test]
    fn typed_values_and_their_refusals() {
        fn read(pair: &str) -> QueryOption<'_> {
            QueryOptions::new(pair).next().expect("one option")
        }
        assert_eq!(read("n=7").positive_u32(), Ok(7));
        assert_eq!(read("n=+7").positive_usize(), Ok(7));
        assert_eq!(
            read("t=250").positive_millis(),
            Ok(Duration::from_millis(250))
        );
        assert_eq!(read("t=0").millis(), Ok(Duration::ZERO));
        assert_eq!(read("f=true").flag(), Ok(true));
        assert_eq!(read("f=false").flag(), Ok(false));
        assert_eq!(
            read("s=normal").choice(&[("full", 1), ("normal", 2)]),
            Ok(2)
        );
        for (result, text) in [
            (
                read("n=0").positive_u32().map(drop),
                "n must be a positive integer, not \"0\"",
            ),
            (
                read("n=-1").positive_usize().map(drop),
                "n must be a positive integer, not \"-1\"",
            ),
            (
                read("n=4294967296").positive_u32().map(drop),
                "n must be a positive integer, not \"4294967296\"",
            ),
            (
                read("t=0").positive_millis().map(drop),
                "t must be a positive integer, not \"0\"",
            ),
            (
                read("t=soon").millis().map(drop),
                "t must be a whole number of milliseconds, not \"soon\"",
            ),
            (
                read("f=yes").flag().map(drop),
                "f must be true or false, not \"yes\"",
            ),
            (
                read("s=off")
                    .choice(&[("a", 1), ("b", 2), ("c", 3)])
                    .map(drop),
                "s must be a, b or c, not \"off\"",
            ),
            (
                read("pool").flag().map(drop),
                "option \"pool\" has no value",
            ),
            (
                read("pool").value().map(drop),
                "option \"pool\" has no value",
            ),
        ] {
            assert_eq!(result.expect_err(text).to_string(), text);
        }
        assert_eq!(
            read("colour=blue").unknown(&["a", "b"]).to_string(),
            "unknown option \"colour\" (known: a, b)"
        );
        assert_eq!(
            read("colour=blue").unknown(&[]).to_string(),
            "unknown option \"colour\""
        );
    }
}

/// What bringing a store's schema to this build's version did: the
/// version found, and the version it left (the same when there was
/// nothing to do). The PostgreSQL and SQLite stores both report it.
///
/// ```
/// use idem::store::Migrated;
/// assert_eq!(Migrated { from: 0, to: 5 }.to_string(), "schema created: migrations 1 to 5 applied");
/// assert_eq!(Migrated { from: 5, to: 5 }.to_string(), "schema already at version 5; nothing to do");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migrated {
    /// The version found (0: no schema yet).
    pub from: i64,
    /// The version now, this build's.
    pub to: i64,
}

impl std::fmt::Display for Migrated {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (self.from, self.to) {
            (from, to) if from == to => write!(f, "schema already at version {to}; nothing to do"),
            (0, to) => write!(f, "schema created: migrations 1 to {to} applied"),
            (from, to) => write!(
                f,
                "schema upgraded from version {from} to {to}: migrations {} to {to} applied",
                from + 1
            ),
        }
    }
}

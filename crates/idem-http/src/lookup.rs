//! Lookups: how the layer asks the service behind it what became of a held
//! record, so that nothing has to run twice.
//!
//! A record is held when its attempt may have taken effect and nobody runs
//! it: the upstream timed out or broke off after the request was sent, or
//! the process that ran it died. A route that names a [`Lookup`] has such
//! records settled in the background ([`idem::reconcile`]): the layer sends
//! the lookup (say `GET /v1/payments/by-key/{key}`) to the inner service
//! with the client's `Idempotency-Key` and the tenant's credentials, and
//!
//! * `404` means it never happened: the key is released and the client's
//!   retry runs the work (believed only after the schedule's settle time);
//! * `2xx` means it happened: the record is completed with that answer (its
//!   status replaced by [`Lookup::with_status`] if set), and the client's
//!   retry gets it as a replay;
//! * anything else leaves the record held, to be asked again with backoff.
//!
//! ```
//! use std::time::Duration;
//! use http::{Method, StatusCode};
//! use idem::reconcile::Schedule;
//! use idem_http::{Lookup, RoutePolicy, Routes};
//!
//! let lookup = Lookup::new(Method::GET, "/v1/payments/by-key/{key}")?
//!     .with_status(StatusCode::CREATED)
//!     .with_schedule(Schedule::default().with_settle(Duration::from_secs(10)));
//! let routes = Routes::default()
//!     .route(Method::POST, "/v1/payments", RoutePolicy::default().with_lookup(lookup))?;
//! # Ok::<(), idem_http::PatternError>(())
//! ```

use std::fmt::Write as _;

use http::{Method, StatusCode, Uri};
use idem::IdempotencyKey;
use idem::reconcile::Schedule;

use crate::pattern::PatternError;

/// A route's lookup on the inner service; see the [module docs](self).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup {
    method: Method,
    path: String,
    parts: Vec<Part>,
    /// Whether `{key}` fills a path segment of its own (see
    /// [`Lookup::accepts`]).
    key_is_a_segment: bool,
    status: Option<StatusCode>,
    schedule: Schedule,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    Text(String),
    Key,
    Param(String),
}

impl Lookup {
    /// A lookup by `method` at `path`, where `{key}` stands for the
    /// client's key (percent-encoded) and `{name}` for the value of the
    /// route's own path parameter `name` (the route refuses a name its
    /// pattern lacks). A query may follow: `/v1/charges?key={key}`.
    pub fn new(method: Method, path: &str) -> Result<Self, PatternError> {
        let err = |reason| PatternError {
            pattern: path.to_owned(),
            reason,
        };
        if !path.starts_with('/') {
            return Err(err("must start with '/'"));
        }
        let mut parts = Vec::new();
        let mut rest = path;
        while let Some(open) = rest.find(['{', '}']) {
            if rest.as_bytes()[open] == b'}' {
                return Err(err("a '}' without its '{'"));
            }
            let close = rest[open..]
                .find('}')
                .ok_or_else(|| err("a '{' without its '}'"))?
                + open;
            let name = &rest[open + 1..close];
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(err("a placeholder is {key} or {name} of a path parameter"));
            }
            if open > 0 {
                parts.push(Part::Text(rest[..open].to_owned()));
            }
            parts.push(if name == "key" {
                Part::Key
            } else {
                Part::Param(name.to_owned())
            });
            rest = &rest[close + 1..];
        }
        if !rest.is_empty() {
            parts.push(Part::Text(rest.to_owned()));
        }
        if !parts.contains(&Part::Key) {
            return Err(err("the lookup must name the record by {key}"));
        }
        Ok(Self {
            method,
            path: path.to_owned(),
            key_is_a_segment: key_is_a_segment(&parts),
            parts,
            status: None,
            schedule: Schedule::default(),
        })
    }

    /// Records a `2xx` answer under this status instead of the lookup's
    /// own (e.g. `201`, what the original request would have answered).
    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = Some(status);
        self
    }

    /// Sets when and for how long held records are asked about.
    pub fn with_schedule(mut self, schedule: Schedule) -> Self {
        self.schedule = schedule;
        self
    }

    /// The method.
    pub fn method(&self) -> &Method {
        &self.method
    }

    /// The path template as written.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The status a `2xx` answer is recorded under, if set.
    pub fn status(&self) -> Option<StatusCode> {
        self.status
    }

    /// The schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The route parameters the path uses (besides `key`).
    pub fn params(&self) -> impl Iterator<Item = &str> {
        self.parts.iter().filter_map(|p| match p {
            Part::Param(name) => Some(name.as_str()),
            _ => None,
        })
    }

    /// Whether `key` can be looked up: `false` when the key would be a
    /// whole path segment of its own that is a dot segment (`.` or `..`,
    /// which percent-encoding leaves as they are). An upstream that
    /// resolves dot segments would answer for another path (`by-key/..`
    /// is the parent resource), and a record would be settled with
    /// another resource's answer.
    pub fn accepts(&self, key: &IdempotencyKey) -> bool {
        !self.key_is_a_segment || !matches!(key.as_str(), "." | "..")
    }

    /// The lookup's URI for `key`, taking route parameters from `param`;
    /// `None` when one is missing, or when the key cannot be looked up
    /// ([`accepts`](Self::accepts)).
    pub(crate) fn uri<'a>(
        &self,
        key: &IdempotencyKey,
        param: impl Fn(&str) -> Option<&'a str>,
    ) -> Option<Uri> {
        if !self.accepts(key) {
            return None;
        }
        let mut out = String::with_capacity(self.path.len() + key.as_str().len());
        for part in &self.parts {
            match part {
                Part::Text(text) => out.push_str(text),
                Part::Key => encode(&mut out, key.as_str()),
                Part::Param(name) => out.push_str(param(name)?),
            }
        }
        out.parse().ok()
    }
}

/// Whether `{key}` fills a whole path segment (`/by-key/{key}`, not
/// `/by-key/k-{key}` nor the query).
fn key_is_a_segment(parts: &[Part]) -> bool {
    let mut in_query = false;
    let mut segment_start = true;
    let mut parts = parts.iter().peekable();
    while let Some(part) = parts.next() {
        match part {
            Part::Text(text) => {
                in_query |= text.contains('?');
                segment_start = text.ends_with('/');
            }
            Part::Key if !in_query && segment_start => {
                let segment_end = match parts.peek() {
                    None => true,
                    Some(Part::Text(next)) => next.starts_with(['/', '?', '#']),
                    Some(_) => false,
                };
                if segment_end {
                    return true;
                }
                segment_start = false;
            }
            Part::Key | Part::Param(_) => segment_start = false,
        }
    }
    false
}

/// Percent-encodes all but the unreserved characters (RFC 3986 §2.3).
fn encode(out: &mut String, text: &str) {
    for b in text.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates() {
        let key: IdempotencyKey = "k/1?%~".parse().expect("key");
        let l = Lookup::new(Method::GET, "/v1/orders/{id}/by-key/{key}?x=1").expect("valid");
        assert_eq!(l.params().collect::<Vec<_>>(), ["id"]);
        let uri = l
            .uri(&key, |n| (n == "id").then_some("ord_7"))
            .expect("uri");
        assert_eq!(uri.path(), "/v1/orders/ord_7/by-key/k%2F1%3F%25~");
        assert_eq!(uri.query(), Some("x=1"));
        assert!(l.uri(&key, |_| None).is_none(), "a missing parameter");
        for bad in [
            "v1/{key}",
            "/v1/{key",
            "/v1/}{key}",
            "/v1/{}",
            "/v1/{a-b}/{key}",
            "/v1/payments",
        ] {
            assert!(Lookup::new(Method::GET, bad).is_err(), "{bad}");
        }
    }

    /// A key of `.` or `..` alone in a segment would name another path
    /// on an upstream that resolves dot segments; inside a segment, in
    /// the query, or with other characters it names only itself.
    #[test]
    fn no_key_escapes_its_segment() {
        let key = |k: &str| -> IdempotencyKey { k.parse().expect("key") };
        for template in ["/v1/payments/by-key/{key}", "/v1/by-key/{key}/status"] {
            let l = Lookup::new(Method::GET, template).expect("valid");
            for dots in [".", ".."] {
                assert!(!l.accepts(&key(dots)), "{template} {dots}");
                assert!(l.uri(&key(dots), |_| None).is_none(), "{template} {dots}");
            }
            for fine in ["...", ".a", "a..", "%2e%2e", "k-1"] {
                let uri = l.uri(&key(fine), |_| None).expect("uri");
                assert!(
                    uri.path().split('/').all(|s| s != "." && s != ".."),
                    "{uri}"
                );
            }
        }
        for template in ["/v1/by-key/k-{key}", "/v1/by-key?key={key}"] {
            let l = Lookup::new(Method::GET, template).expect("valid");
            for dots in [".", ".."] {
                let uri = l.uri(&key(dots), |_| None).expect("uri");
                assert!(
                    uri.path().split('/').all(|s| s != "." && s != ".."),
                    "{uri}"
                );
            }
        }
    }
}

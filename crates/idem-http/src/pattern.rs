//! Path patterns (`/v1/orders/{id}/capture`) and the normalised form of a
//! request path that routes match and fingerprints cover.

use std::borrow::Cow;

/// A path pattern that is not well-formed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PatternError {
    pub(crate) pattern: String,
    pub(crate) reason: &'static str,
}

impl std::fmt::Display for PatternError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "invalid path pattern {:?}: {}",
            self.pattern, self.reason
        )
    }
}

impl std::error::Error for PatternError {}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Param(String),
}

/// A path pattern: literal segments and `{name}` segments that match any
/// one non-empty segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathPattern {
    text: String,
    segments: Vec<Segment>,
}

impl PathPattern {
    /// Parses `/a/{id}/b`.
    pub fn parse(pattern: &str) -> Result<Self, PatternError> {
        let err = |reason| PatternError {
            pattern: pattern.to_owned(),
            reason,
        };
        let rest = pattern
            .strip_prefix('/')
            .ok_or_else(|| err("must start with '/'"))?;
        let segments = if rest.is_empty() {
            Vec::new()
        } else {
            rest.split('/')
                .map(|s| {
                    if s.is_empty() {
                        Err(err("empty segment ('//' or a trailing '/')"))
                    } else if let Some(name) = s.strip_prefix('{').and_then(|s| s.strip_suffix('}'))
                    {
                        if name.is_empty() || name.contains(['{', '}']) {
                            Err(err("a parameter is written {name}"))
                        } else {
                            Ok(Segment::Param(name.to_owned()))
                        }
                    } else if s.contains(['{', '}']) {
                        Err(err(
                            "braces only around a whole segment, as in /orders/{id}",
                        ))
                    } else {
                        Ok(Segment::Literal(s.to_owned()))
                    }
                })
                .collect::<Result<_, _>>()?
        };
        Ok(Self {
            text: pattern.to_owned(),
            segments,
        })
    }

    /// Whether `path` (without query, [normalised](normalize_path))
    /// matches, literal segments compared exactly.
    pub fn matches(&self, path: &str) -> bool {
        self.matches_with(path, false)
    }

    /// [`matches`](Self::matches), literal segments compared regardless of
    /// ASCII case when `ignore_case`.
    pub fn matches_with(&self, path: &str, ignore_case: bool) -> bool {
        let Some(rest) = path.strip_prefix('/') else {
            return false;
        };
        let mut parts = if rest.is_empty() {
            None
        } else {
            Some(rest.split('/'))
        }
        .into_iter()
        .flatten();
        for seg in &self.segments {
            match (seg, parts.next()) {
                (Segment::Literal(l), Some(p))
                    if l == p || (ignore_case && l.eq_ignore_ascii_case(p)) => {}
                (Segment::Param(_), Some(p)) if !p.is_empty() => {}
                _ => return false,
            }
        }
        parts.next().is_none()
    }

    /// Whether every path `other` matches is also matched by this pattern
    /// (same number of segments; each of ours a parameter or the same
    /// literal, compared regardless of ASCII case when `ignore_case`). A
    /// route whose pattern an earlier route of the same method covers can
    /// never be chosen, because the first match wins.
    ///
    /// ```
    /// use idem_http::PathPattern;
    /// let any = PathPattern::parse("/v1/orders/{id}")?;
    /// let one = PathPattern::parse("/v1/orders/refunds")?;
    /// assert!(any.covers(&one, false));
    /// assert!(!one.covers(&any, false));
    /// # Ok::<(), idem_http::PatternError>(())
    /// ```
    pub fn covers(&self, other: &PathPattern, ignore_case: bool) -> bool {
        self.segments.len() == other.segments.len()
            && self
                .segments
                .iter()
                .zip(&other.segments)
                .all(|pair| match pair {
                    (Segment::Param(_), _) => true,
                    (Segment::Literal(a), Segment::Literal(b)) => {
                        a == b || (ignore_case && a.eq_ignore_ascii_case(b))
                    }
                    (Segment::Literal(_), Segment::Param(_)) => false,
                })
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The names of its `{name}` segments, in order.
    pub fn param_names(&self) -> impl Iterator<Item = &str> {
        self.segments.iter().filter_map(|s| match s {
            Segment::Param(name) => Some(name.as_str()),
            Segment::Literal(_) => None,
        })
    }

    /// The value of parameter `name` in `path`, a path this pattern
    /// [`matches`](Self::matches).
    pub fn param<'p>(&self, name: &str, path: &'p str) -> Option<&'p str> {
        let mut parts = path.strip_prefix('/')?.split('/');
        self.segments
            .iter()
            .map(|seg| (seg, parts.next()))
            .find_map(|(seg, part)| match seg {
                Segment::Param(n) if n == name => part,
                _ => None,
            })
    }
}

/// A request path in the one form routes are matched and fingerprinted
/// on, so that no spelling of a path slips past its route's policy:
/// percent-encoded unreserved characters decoded (`%41` is `A`, `%2e` is
/// `.`; other escapes kept, their hex digits upper-cased), repeated
/// slashes merged, `.` and `..` segments removed (RFC 3986 §5.2.4) and a
/// trailing slash dropped. Borrowed when the path is already in that form.
///
/// ```
/// use idem_http::normalize_path;
/// assert_eq!(normalize_path("/v1//payments/"), "/v1/payments");
/// assert_eq!(normalize_path("/v1/x/../%70ayments"), "/v1/payments");
/// assert_eq!(normalize_path("/v1/a%2fb"), "/v1/a%2Fb");
/// assert_eq!(normalize_path("/"), "/");
/// ```
pub fn normalize_path(path: &str) -> Cow<'_, str> {
    if is_normal(path) {
        return Cow::Borrowed(path);
    }
    let b = path.as_bytes();
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut decoded = String::with_capacity(path.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && let (Some(hi), Some(lo)) = (
                b.get(i + 1).copied().and_then(hex),
                b.get(i + 2).copied().and_then(hex),
            )
        {
            let c = hi << 4 | lo;
            if c.is_ascii_alphanumeric() || b"-._~".contains(&c) {
                decoded.push(c as char);
            } else {
                decoded.push('%');
                decoded.push_str(&format!("{c:02X}"));
            }
            i += 3;
            continue;
        }
        // Non-ASCII arrives percent-encoded in a URI; a raw byte is kept.
        let ch = path[i..].chars().next().expect("in bounds");
        decoded.push(ch);
        i += ch.len_utf8();
    }
    let mut segments: Vec<&str> = Vec::new();
    for seg in decoded.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for seg in &segments {
        out.push('/');
        out.push_str(seg);
    }
    if out.is_empty() {
        out.push('/');
    }
    Cow::Owned(out)
}

/// The spelling of a [normalised](normalize_path) `path` that an upstream
/// routing leniently handles it as, when that differs from `path`:
///
/// * with `parameters`, each segment's `;` parameters dropped, and the
///   result normalised again: servlet containers route
///   `/v1/payments;jsessionid=1`, and resolve `/x/..;/v1/payments`, as
///   `/v1/payments`;
/// * with `suffixes`, a format suffix of the last segment dropped (a dot,
///   then 1 to 16 ASCII letters or digits, after a name):
///   `/v1/payments.json` is `/v1/payments` to Rails and to
///   suffix-matching frameworks.
///
/// A cheap look at a request that matched none of its method's routes; it
/// allocates only for a path with something to drop.
pub(crate) fn lenient_form(path: &str, parameters: bool, suffixes: bool) -> Option<String> {
    let mut form = Cow::Borrowed(path);
    if parameters && path.contains(';') {
        let mut stripped = String::with_capacity(path.len());
        for (i, segment) in path.split('/').enumerate() {
            if i > 0 {
                stripped.push('/');
            }
            stripped.push_str(segment.split(';').next().unwrap_or_default());
        }
        form = Cow::Owned(normalize_path(&stripped).into_owned());
    }
    if suffixes {
        let name_at = form.rfind('/').map_or(0, |slash| slash + 1);
        let last = &form[name_at..];
        if let Some(dot) = last.rfind('.')
            && dot > 0
            && (1..=16).contains(&(last.len() - dot - 1))
            && last[dot + 1..].bytes().all(|b| b.is_ascii_alphanumeric())
        {
            let without = &form[..name_at + dot];
            form = Cow::Owned(normalize_path(without).into_owned());
        }
    }
    match form {
        Cow::Owned(form) if form != path => Some(form),
        _ => None,
    }
}

/// Whether [`normalize_path`] may return `path` as it is: `/` alone, or
/// `/`-led segments none of which is empty, `.` or `..`, and no `%`
/// anywhere (an escape is decoded or spelled again by the slow path). One
/// pass over the bytes: this runs on every request, and the four substring
/// searches it replaces cost more than the rest of the routing.
fn is_normal(path: &str) -> bool {
    let b = path.as_bytes();
    if b == b"/" {
        return true;
    }
    if b.first() != Some(&b'/') {
        return false;
    }
    // The current segment's length and whether it is all dots so far.
    let (mut len, mut dots) = (0usize, true);
    for &c in &b[1..] {
        match c {
            b'%' => return false,
            b'/' => {
                if len == 0 || (dots && len <= 2) {
                    return false;
                }
                (len, dots) = (0, true);
            }
            _ => {
                len += 1;
                dots &= c == b'.';
            }
        }
    }
    !(len == 0 || (dots && len <= 2))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every path of up to 7 characters over the characters that matter
    /// (and one that does not): the one-pass check agrees with the plain
    /// statement of the form, and normalising twice changes nothing more.
    #[test]
    fn the_normal_form_check_agrees_with_its_definition() {
        let stated = |path: &str| {
            path.starts_with('/')
                && !path.contains('%')
                && !path.contains("//")
                && !path.contains("/./")
                && !path.contains("/../")
                && !path.ends_with("/.")
                && !path.ends_with("/..")
                && (path == "/" || !path.ends_with('/'))
        };
        let alphabet = ['/', '.', 'a', '%'];
        let mut paths = vec![String::new()];
        let mut checked = 0;
        for _ in 0..7 {
            let mut longer = Vec::new();
            for p in &paths {
                for c in alphabet {
                    let q = format!("{p}{c}");
                    assert_eq!(is_normal(&q), stated(&q), "{q:?}");
                    let normalized = normalize_path(&q);
                    assert_eq!(normalize_path(&normalized), normalized, "{q:?}");
                    assert_eq!(matches!(normalized, Cow::Borrowed(_)), is_normal(&q));
                    checked += 1;
                    longer.push(q);
                }
            }
            paths = longer;
        }
        assert_eq!(checked, (1..=7).map(|n| 4usize.pow(n)).sum::<usize>());
    }
}

//! Fields of a JSON body, named by RFC 6901 JSON Pointers: where a route
//! finds the key when no key header is sent (`key_from`), and which parts
//! of the body its fingerprint covers (`fingerprint_include` or
//! `fingerprint_exclude`).
//!
//! ```
//! use idem_http::{BodyFields, JsonPointer};
//!
//! let id: JsonPointer = "/order/id".parse()?;
//! let doc = idem::json_strict(br#"{"order": {"id": "ord_7"}, "sent_at": "12:00"}"#)?;
//! assert_eq!(id.get(&doc), Some(&idem::json::Value::String("ord_7".into())));
//!
//! // An honest retry that stamps a new `sent_at` keeps its fingerprint.
//! let fields = BodyFields::Exclude(vec!["/sent_at".parse()?]);
//! let retry = idem::json_strict(br#"{"order": {"id": "ord_7"}, "sent_at": "12:01"}"#)?;
//! assert_eq!(fields.select(doc), fields.select(retry));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::fmt;
use std::str::FromStr;

use idem::json::Value;

/// An RFC 6901 JSON Pointer naming one field below a document's root.
///
/// The empty pointer (the whole document) is refused: no route needs it,
/// and in `fingerprint_exclude` it would leave nothing of the body.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct JsonPointer {
    text: Box<str>,
    tokens: Box<[Box<str>]>,
}

/// Why a string is not a [`JsonPointer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PointerError(&'static str);

impl fmt::Display for PointerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for PointerError {}

impl FromStr for JsonPointer {
    type Err = PointerError;

    fn from_str(text: &str) -> Result<Self, PointerError> {
        if text.is_empty() {
            return Err(PointerError(
                "the empty pointer names the whole body; name a field, such as \"/order/id\"",
            ));
        }
        let Some(rest) = text.strip_prefix('/') else {
            return Err(PointerError(
                "a JSON Pointer starts with '/', as in \"/order/id\"",
            ));
        };
        let tokens = rest
            .split('/')
            .map(unescape)
            .collect::<Result<Box<[_]>, _>>()?;
        Ok(Self {
            text: text.into(),
            tokens,
        })
    }
}

/// One reference token: `~1` is `/`, `~0` is `~`, and no other `~` may
/// stand alone (RFC 6901 §3).
fn unescape(token: &str) -> Result<Box<str>, PointerError> {
    let mut out = String::with_capacity(token.len());
    let mut chars = token.chars();
    while let Some(c) = chars.next() {
        match c {
            '~' => match chars.next() {
                Some('0') => out.push('~'),
                Some('1') => out.push('/'),
                _ => {
                    return Err(PointerError(
                        "'~' must be written \"~0\", and '/' inside a name \"~1\"",
                    ));
                }
            },
            c => out.push(c),
        }
    }
    Ok(out.into_boxed_str())
}

/// An array index token: digits, no leading zero (RFC 6901 §4).
fn index(token: &str) -> Option<usize> {
    let digits = token.bytes().all(|b| b.is_ascii_digit());
    if token.is_empty() || !digits || (token.len() > 1 && token.starts_with('0')) {
        return None;
    }
    token.parse().ok()
}

impl JsonPointer {
    /// Its reference tokens, unescaped (`/a~1b/c` is `a/b`, `c`).
    pub fn tokens(&self) -> &[Box<str>] {
        &self.tokens
    }

    /// The pointer as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The value it names in `doc`, if there is one.
    pub fn get<'v>(&self, doc: &'v Value) -> Option<&'v Value> {
        self.tokens
            .iter()
            .try_fold(doc, |value, token| match value {
                Value::Object(map) => map.get(&**token),
                Value::Array(items) => items.get(index(token)?),
                _ => None,
            })
    }

    /// Takes the value it names out of `doc`: an object member is
    /// removed; an array element is replaced by `null`, so that it keeps
    /// its place and no other pointer's index moves.
    fn remove(&self, doc: &mut Value) {
        let Some((last, parents)) = self.tokens.split_last() else {
            return;
        };
        let parent = parents.iter().try_fold(doc, |value, token| match value {
            Value::Object(map) => map.get_mut(&**token),
            Value::Array(items) => items.get_mut(index(token)?),
            _ => None,
        });
        match parent {
            Some(Value::Object(map)) => {
                map.remove(&**last);
            }
            Some(Value::Array(items)) => {
                if let Some(item) = index(last).and_then(|i| items.get_mut(i)) {
                    *item = Value::Null;
                }
            }
            _ => {}
        }
    }
}

impl fmt::Display for JsonPointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

/// Which parts of a JSON body a route's fingerprint covers. The method,
/// operation, path, query and `fingerprint_headers` are covered whatever
/// this says; a body that is not JSON is always covered whole.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum BodyFields {
    /// The whole document (the default).
    #[default]
    All,
    /// Only these fields: a retry that changes anything else is the same
    /// request. A field that is absent is covered as absent, so adding it
    /// later is another request.
    Include(Vec<JsonPointer>),
    /// Everything but these fields (a `sent_at` a client stamps into each
    /// retry, say). An excluded array element keeps its place (as `null`),
    /// so the array's length stays covered and no other index shifts.
    Exclude(Vec<JsonPointer>),
}

impl BodyFields {
    /// What of `doc` the fingerprint covers: the document itself for
    /// [`All`](Self::All); for `Include`, an array of `[pointer, value]`
    /// pairs in the configured order (`[pointer]` alone for an absent
    /// field); for `Exclude`, the document with those fields taken out
    /// (array elements nulled in place).
    pub fn select(&self, mut doc: Value) -> Value {
        match self {
            Self::All => doc,
            Self::Include(fields) => Value::Array(
                fields
                    .iter()
                    .map(|p| {
                        let mut pair = vec![Value::String(p.as_str().to_owned())];
                        pair.extend(p.get(&doc).cloned());
                        Value::Array(pair)
                    })
                    .collect(),
            ),
            Self::Exclude(fields) => {
                for p in fields {
                    p.remove(&mut doc);
                }
                doc
            }
        }
    }

    /// A label for the fingerprint, so that a body covered in part never
    /// fingerprints like a whole body that happens to read the same:
    /// `None` for [`All`](Self::All).
    pub(crate) fn label(&self) -> Option<String> {
        let (kind, fields) = match self {
            Self::All => return None,
            Self::Include(f) => ("include", f),
            Self::Exclude(f) => ("exclude", f),
        };
        // Each pointer's length first: no two lists share a label.
        let mut label = String::from(kind);
        for name in fields.iter().map(JsonPointer::as_str) {
            use fmt::Write as _;
            let _ = write!(label, " {}:{name}", name.len());
        }
        Some(label)
    }
}

/// Removes the field `path` names below `object` (a key's own field,
/// before the rest of a request is fingerprinted); nothing when it is not
/// there.
pub(crate) fn remove_below(object: &mut idem::json::Map, path: &[String]) {
    match path {
        [] => {}
        [last] => {
            object.remove(last);
        }
        [first, rest @ ..] => {
            if let Some(Value::Object(inner)) = object.get_mut(first) {
                remove_below(inner, rest);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A document written as `serde_json::json!` writes it, read as the
    /// fingerprint reads it.
    macro_rules! json {
        ($($doc:tt)+) => {
            idem::json_strict(serde_json::json!($($doc)+).to_string().as_bytes()).expect("JSON")
        };
    }

    fn p(text: &str) -> JsonPointer {
        text.parse().expect("a pointer")
    }

    #[test]
    fn pointers_follow_rfc_6901() {
        let doc = json!({"a/b": 1, "m~n": 2, "list": [10, 20], "": {"x": 3}});
        assert_eq!(p("/a~1b").get(&doc), Some(&json!(1)));
        assert_eq!(p("/m~0n").get(&doc), Some(&json!(2)));
        assert_eq!(p("/list/1").get(&doc), Some(&json!(20)));
        assert_eq!(p("//x").get(&doc), Some(&json!(3)));
        // A leading zero, a sign, or past the end is no index.
        assert_eq!(p("/list/01").get(&doc), None);
        assert_eq!(p("/list/+1").get(&doc), None);
        assert_eq!(p("/list/2").get(&doc), None);
        assert_eq!(p("/list/-").get(&doc), None);
        assert_eq!(p("/a~1b/deeper").get(&doc), None);
    }

    #[test]
    fn malformed_pointers_are_refused_with_the_reason() {
        for bad in ["", "order/id", "/a~", "/a~2", "/~x"] {
            let err = bad.parse::<JsonPointer>().expect_err(bad);
            assert!(!err.to_string().is_empty());
        }
        let err = "order/id"
            .parse::<JsonPointer>()
            .expect_err("no leading slash");
        assert!(err.to_string().contains("starts with '/'"));
    }

    #[test]
    fn include_covers_the_named_fields_and_marks_absence() {
        let fields = BodyFields::Include(vec![p("/amount"), p("/currency")]);
        let a = fields.select(json!({"amount": 5, "currency": "eur", "sent_at": 1}));
        let b = fields.select(json!({"currency": "eur", "amount": 5, "sent_at": 2}));
        assert_eq!(a, b);
        let absent = fields.select(json!({"amount": 5}));
        let null = fields.select(json!({"amount": 5, "currency": null}));
        assert_ne!(absent, null, "an absent field is not a null one");
        assert_ne!(a, fields.select(json!({"amount": 6, "currency": "eur"})));
    }

    #[test]
    fn exclude_takes_out_fields_at_any_depth() {
        let fields = BodyFields::Exclude(vec![p("/sent_at"), p("/meta/trace"), p("/tags/0")]);
        let doc =
            json!({"amount": 5, "sent_at": 1, "meta": {"trace": "t", "k": 1}, "tags": ["x", "y"]});
        assert_eq!(
            fields.select(doc),
            json!({"amount": 5, "meta": {"k": 1}, "tags": [null, "y"]})
        );
        // Two indices of one array: each names the element it named in the
        // document sent, so what is left covered is the same either way.
        let two = BodyFields::Exclude(vec![p("/tags/0"), p("/tags/1")]);
        let a = two.select(json!({"tags": ["a", "b", "c"]}));
        let b = two.select(json!({"tags": ["a", "b", "d"]}));
        assert_ne!(a, b, "tags[2] is covered");
        assert_eq!(a, two.select(json!({"tags": ["x", "y", "c"]})));
        // Nothing to take out: the document as it is.
        assert_eq!(fields.select(json!([1])), json!([1]));
    }

    #[test]
    fn labels_tell_lists_apart() {
        assert_eq!(BodyFields::All.label(), None);
        let one = BodyFields::Include(vec![p("/a b")]);
        let two = BodyFields::Include(vec![p("/a"), p("/b")]);
        assert_ne!(one.label(), two.label());
        assert_ne!(
            BodyFields::Include(vec![p("/a")]).label(),
            BodyFields::Exclude(vec![p("/a")]).label()
        );
    }
}

//! GraphQL routes: every request is a `POST` of one document to one path,
//! so a route that speaks GraphQL ([`RoutePolicy::with_graphql`](crate::RoutePolicy::with_graphql))
//! parses the document and judges the operation the request selects:
//! a `mutation` is protected, a `query` or `subscription` passes through
//! unrecorded. The operation is the selected operation's type and name
//! (`mutation CreatePayment`); the fingerprint covers the normalised
//! document (its tokens without whitespace, comments, commas, and the
//! definitions the operation does not use), the operation name and the
//! canonical variables without the key's own. Refusals speak GraphQL:
//! an `errors` array whose `extensions.code` names the case.
//!
//! ```
//! use http::HeaderMap;
//! use idem_http::graphql::{GraphQl, Judged};
//!
//! let gql = GraphQl::new().with_key_pointers(vec!["/variables/idempotencyKey".parse()?]);
//! let create = br#"{"query":"mutation Create($idempotencyKey: String) { createPayment(cents: 500) { id } }",
//!   "variables":{"idempotencyKey":"pay-1"}}"#;
//! match gql.judge(&HeaderMap::new(), None, create) {
//!     Judged::Protect(op) => {
//!         assert_eq!(op.key.as_str(), "pay-1");
//!         assert_eq!(op.operation, "mutation Create");
//!     }
//!     other => panic!("{other:?}"),
//! }
//! let look = br#"{"query":"{ payments { id } }"}"#;
//! assert!(matches!(gql.judge(&HeaderMap::new(), None, look), Judged::Pass));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! One file per part: this file (the rules and the judging of a request),
//! `document.rs` (the parsed document: the selected operation and its
//! normal form), `answer.rs` (refusals as GraphQL errors, what an
//! answer's `errors` and `data` mean for its record).

mod answer;
mod document;
#[cfg(test)]
mod tests;

use bytes::Bytes;
use http::{HeaderMap, HeaderName};
use idem::IdempotencyKey;
use idem::json::{Map, Value};
use sha2::{Digest, Sha256};

pub use answer::{Outcome, classify, refusal};
pub use document::{Limits, OperationType};

use crate::request::{key_in, key_required};
use crate::{JsonPointer, Problem, ProblemKind};

/// The media type of a request whose body is the document itself.
pub const GRAPHQL_DOCUMENT: &str = "application/graphql";

/// How a route's GraphQL requests are judged: where a mutation's key is,
/// whether it is required, and how large a document is parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraphQl {
    /// Headers the key may be in, the first the request carries winning.
    pub key_headers: Vec<HeaderName>,
    /// Fields of the request the key may be in (`/variables/idempotencyKey`,
    /// `/extensions/idempotencyKey`), after the headers, the first present
    /// winning.
    pub key_pointers: Vec<JsonPointer>,
    /// Refuse a mutation without a key; otherwise it passes unprotected.
    pub require_key: bool,
    /// The parser's limits.
    pub limits: Limits,
}

impl Default for GraphQl {
    fn default() -> Self {
        Self::new()
    }
}

/// A protected mutation: its key, its operation within the route, and
/// the bytes its fingerprint is taken over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operation {
    /// The key.
    pub key: IdempotencyKey,
    /// `mutation <name>`, `mutation` when anonymous, or `persisted
    /// <name>` for a persisted query.
    pub operation: String,
    /// Canonical JSON of what the request means: the normal document (or
    /// a persisted query's hash), the operation name and the variables
    /// without the key's own.
    pub fingerprinted: Bytes,
}

/// What a route does with one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Judged {
    /// Forward it as it is: a query or subscription, a batch of them, or
    /// a mutation without a key where none is required.
    Pass,
    /// Answer this GraphQL error: nothing forwarded, nothing recorded.
    Refuse(Problem),
    /// Protect it.
    Protect(Operation),
}

/// A request's parts, as GraphQL over HTTP sends them.
struct Request<'a> {
    query: Option<&'a str>,
    operation_name: Option<&'a str>,
    variables: Option<&'a Map>,
    /// `extensions.persistedQuery.sha256Hash`, lowercase hex.
    persisted: Option<String>,
}

fn invalid(detail: impl Into<String>) -> Judged {
    Judged::Refuse(Problem::new(ProblemKind::GraphQlRequestInvalid, detail))
}

impl GraphQl {
    /// Protects every mutation, its key in `Idempotency-Key`, not
    /// required, with the default [`Limits`].
    pub fn new() -> Self {
        Self {
            key_headers: vec![crate::IDEMPOTENCY_KEY],
            key_pointers: Vec::new(),
            require_key: false,
            limits: Limits::default(),
        }
    }

    /// Sets the headers the key may be in.
    pub fn with_key_headers(mut self, headers: Vec<HeaderName>) -> Self {
        self.key_headers = headers;
        self
    }

    /// Sets the fields of the request the key may be in.
    pub fn with_key_pointers(mut self, pointers: Vec<JsonPointer>) -> Self {
        self.key_pointers = pointers;
        self
    }

    /// Sets whether a mutation needs a key.
    pub fn with_require_key(mut self, require: bool) -> Self {
        self.require_key = require;
        self
    }

    /// Sets the parser's limits.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// Judges a request to the route: its headers, its `Content-Type`,
    /// and its body.
    ///
    /// What cannot be judged is refused, never forwarded: a body that is
    /// neither a GraphQL request in JSON nor a document
    /// (`application/graphql`), a document that does not parse, or one
    /// whose operation the request does not select. The service would
    /// refuse each of them too; forwarded, one it read otherwise could
    /// run a mutation unprotected.
    ///
    /// A batch (a JSON array) passes when it holds no mutation, and is
    /// refused whole when it holds one: each mutation would need its own
    /// record and the batch one answer.
    pub fn judge(&self, headers: &HeaderMap, content_type: Option<&str>, body: &[u8]) -> Judged {
        if content_type.is_some_and(is_document) {
            let Ok(query) = std::str::from_utf8(body) else {
                return invalid("the document is not UTF-8");
            };
            let request = Request {
                query: Some(query),
                operation_name: None,
                variables: None,
                persisted: None,
            };
            return self.judge_request(headers, &Value::Null, &request);
        }
        let doc = match idem::json_strict(body) {
            Ok(doc) => doc,
            Err(idem::JsonRefusal::Ambiguous(why)) => {
                return Judged::Refuse(Problem::new(ProblemKind::BodyAmbiguous, why));
            }
            Err(_) => {
                return invalid(
                    "a GraphQL route takes a JSON request ({\"query\", \"operationName\", \"variables\"}) or an application/graphql document",
                );
            }
        };
        match &doc {
            Value::Array(requests) => {
                if requests.is_empty() {
                    return invalid("an empty batch");
                }
                let mut refused = None;
                for request in requests {
                    match self.judge_value(headers, request) {
                        Judged::Pass => {}
                        Judged::Protect(_) => {
                            return Judged::Refuse(Problem::new(
                                ProblemKind::GraphQlBatchRefused,
                                "a batch holding a mutation is refused; send each mutation alone",
                            ));
                        }
                        r @ Judged::Refuse(_) => refused = refused.or(Some(r)),
                    }
                }
                refused.unwrap_or(Judged::Pass)
            }
            request => self.judge_value(headers, request),
        }
    }

    fn judge_value(&self, headers: &HeaderMap, value: &Value) -> Judged {
        let Value::Object(members) = value else {
            return invalid("a GraphQL request is a JSON object");
        };
        let query = match members.get("query") {
            None | Some(Value::Null) => None,
            Some(Value::String(q)) => Some(q.as_str()),
            Some(_) => return invalid("query is a string"),
        };
        let operation_name = match members.get("operationName") {
            None | Some(Value::Null) => None,
            Some(Value::String(n)) => Some(n.as_str()),
            Some(_) => return invalid("operationName is a string"),
        };
        let variables = match members.get("variables") {
            None | Some(Value::Null) => None,
            Some(Value::Object(v)) => Some(v),
            Some(_) => return invalid("variables is an object"),
        };
        let persisted = match members.get("extensions") {
            None | Some(Value::Null) => None,
            Some(Value::Object(extensions)) => match extensions.get("persistedQuery") {
                None | Some(Value::Null) => None,
                Some(Value::Object(pq)) => match pq.get("sha256Hash") {
                    Some(Value::String(h))
                        if h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit()) =>
                    {
                        Some(h.to_ascii_lowercase())
                    }
                    _ => {
                        return invalid("extensions.persistedQuery.sha256Hash is 64 hex digits");
                    }
                },
                Some(_) => return invalid("extensions.persistedQuery is an object"),
            },
            Some(_) => return invalid("extensions is an object"),
        };
        let request = Request {
            query,
            operation_name,
            variables,
            persisted,
        };
        self.judge_request(headers, value, &request)
    }

    fn judge_request(&self, headers: &HeaderMap, value: &Value, request: &Request<'_>) -> Judged {
        let selected = match request.query {
            Some(query) => match document::select(query, request.operation_name, &self.limits) {
                Ok(selected) => Some(selected),
                Err(why) => return invalid(why),
            },
            None if request.persisted.is_some() => None,
            None => {
                return invalid(
                    "no query: the request names neither a document nor a persisted query",
                );
            }
        };
        // Only a mutation runs something; a persisted query without its
        // document cannot be told apart, so it is protected when keyed.
        if selected
            .as_ref()
            .is_some_and(|s| s.kind != OperationType::Mutation)
        {
            return Judged::Pass;
        }
        let found = key_in(
            headers,
            &self.key_headers,
            &self.key_pointers,
            value,
            "the request's",
        );
        let (key, field) = match found {
            Ok(Some(found)) => found,
            Ok(None) if self.require_key => {
                let what = match &selected {
                    Some(_) => "a mutation",
                    None => {
                        "a persisted query sent without its document (its type cannot be judged)"
                    }
                };
                return Judged::Refuse(key_required(what, &self.key_headers, &self.key_pointers));
            }
            Ok(None) => return Judged::Pass,
            Err(problem) => return Judged::Refuse(problem),
        };
        let name = request
            .operation_name
            .or(selected.as_ref().and_then(|s| s.name.as_deref()));
        // A persisted query is one request whether its document comes
        // with its hash or not: both are judged by the hash, where the
        // document sent (if any) is the one the hash names.
        let hash = match (&request.persisted, request.query) {
            (Some(hash), Some(query)) if *hash == hex::encode(Sha256::digest(query)) => {
                Some(hash.as_str())
            }
            (Some(hash), None) => Some(hash.as_str()),
            _ => None,
        };
        let operation = match (hash, name) {
            (Some(_), Some(name)) => format!("persisted {name}"),
            (Some(_), None) => "persisted".to_owned(),
            (None, Some(name)) => format!("mutation {name}"),
            (None, None) => "mutation".to_owned(),
        };
        let mut variables = request.variables.cloned().unwrap_or_default();
        if let Some(path) = field
            .as_deref()
            .and_then(|p| p.split_first())
            .filter(|(first, _)| *first == "variables")
            .map(|(_, rest)| rest)
        {
            crate::pointer::remove_below(&mut variables, path);
        }
        let mut meaning = Map::new();
        match (hash, &selected) {
            (Some(hash), _) => {
                meaning.insert("persisted".to_owned(), Value::String(hash.to_owned()));
            }
            (None, Some(selected)) => {
                meaning.insert(
                    "document".to_owned(),
                    Value::String(selected.normal.clone()),
                );
            }
            (None, None) => unreachable!("a request without a document has a hash"),
        }
        meaning.insert(
            "operationName".to_owned(),
            name.map_or(Value::Null, |n| Value::String(n.to_owned())),
        );
        meaning.insert("variables".to_owned(), Value::Object(variables));
        let fingerprinted = Bytes::from(idem::canonical_json_value(&Value::Object(meaning), 256));
        Judged::Protect(Operation {
            key,
            operation,
            fingerprinted,
        })
    }
}

/// Whether a `Content-Type` names a bare GraphQL document.
fn is_document(content_type: &str) -> bool {
    content_type
        .split(';')
        .next()
        .is_some_and(|t| t.trim().eq_ignore_ascii_case(GRAPHQL_DOCUMENT))
}

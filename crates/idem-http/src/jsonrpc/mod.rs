//! JSON-RPC 2.0 routes: every call is a `POST` to one path, so a route
//! that speaks JSON-RPC ([`RoutePolicy::with_jsonrpc`](crate::RoutePolicy::with_jsonrpc))
//! judges each call by its `method` (and, for MCP's `tools/call`, the
//! tool's `name`): which methods are protected, where their key is (a
//! header, or JSON Pointers into the call), and whether it is required.
//! The operation is the method (and tool); the fingerprint covers the
//! method and the canonical `params` without the key's own field and
//! `_meta`, never the call's `id`, which differs on every retry. Replays
//! and refusals speak JSON-RPC: the stored answer comes back with the
//! retry's `id`, and a refusal is an error object with a stable code.
//!
//! ```
//! use http::HeaderMap;
//! use idem_http::jsonrpc::{Judged, JsonRpc, MethodRule};
//!
//! let rpc = JsonRpc::new(vec![
//!     MethodRule::new("tools/call")
//!         .with_key_pointers(vec!["/params/_meta/idempotencyKey".parse()?])
//!         .with_require_key(true),
//! ]);
//! let call = br#"{"jsonrpc":"2.0","id":7,"method":"tools/call",
//!   "params":{"name":"charge","arguments":{"cents":500},"_meta":{"idempotencyKey":"k-1"}}}"#;
//! match rpc.judge(&HeaderMap::new(), call) {
//!     Judged::Protect(call) => {
//!         assert_eq!(call.key.as_str(), "k-1");
//!         assert_eq!(call.operation, "tools/call charge");
//!     }
//!     other => panic!("{other:?}"),
//! }
//! let list = br#"{"jsonrpc":"2.0","id":8,"method":"tools/list"}"#;
//! assert!(matches!(rpc.judge(&HeaderMap::new(), list), Judged::Pass));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! One file per part: this file (the rules and the judging of a call),
//! `answer.rs` (refusals as error objects, replays with the retry's id,
//! what an answer's error means for its record).

mod answer;
#[cfg(test)]
mod tests;

use bytes::Bytes;
use http::{HeaderMap, HeaderName};
use idem::IdempotencyKey;
use idem::json::Value;

pub use answer::{ErrorClass, classify, error_code, refusal, with_id};

use crate::request::{key_in, key_required};
use crate::{JsonPointer, Problem, ProblemKind};

/// Which tools of `tools/call` a rule covers.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Tools {
    /// Every tool.
    #[default]
    All,
    /// Only these.
    Allow(Vec<String>),
    /// All but these.
    Deny(Vec<String>),
}

impl Tools {
    fn covers(&self, tool: &str) -> bool {
        match self {
            Self::All => true,
            Self::Allow(names) => names.iter().any(|n| n == tool),
            Self::Deny(names) => !names.iter().any(|n| n == tool),
        }
    }
}

/// The method MCP calls tools with: its operation also names the tool.
pub const TOOLS_CALL: &str = "tools/call";

/// The notification by which an MCP client gives up on a call.
pub const CANCELLED: &str = "notifications/cancelled";

/// How the calls of one method are protected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MethodRule {
    /// The method (`tools/call`, `message/send`, `payments.create`).
    pub method: String,
    /// For `tools/call`, which tools (default: all).
    pub tools: Tools,
    /// Headers the key may be in, the first the request carries winning.
    pub key_headers: Vec<HeaderName>,
    /// Fields of the call the key may be in (`/params/_meta/idempotencyKey`),
    /// after the headers, the first present winning.
    pub key_pointers: Vec<JsonPointer>,
    /// Refuse a call without a key; otherwise it passes unprotected.
    pub require_key: bool,
}

impl MethodRule {
    /// Protects `method`, its key in `Idempotency-Key` or MCP's
    /// `/params/_meta/idempotencyKey`, not required.
    pub fn new(method: &str) -> Self {
        Self {
            method: method.to_owned(),
            tools: Tools::All,
            key_headers: vec![crate::IDEMPOTENCY_KEY],
            key_pointers: vec![
                "/params/_meta/idempotencyKey"
                    .parse()
                    .expect("a valid pointer"),
            ],
            require_key: false,
        }
    }

    /// Sets which tools of `tools/call` the rule covers.
    pub fn with_tools(mut self, tools: Tools) -> Self {
        self.tools = tools;
        self
    }

    /// Sets the headers the key may be in.
    pub fn with_key_headers(mut self, headers: Vec<HeaderName>) -> Self {
        self.key_headers = headers;
        self
    }

    /// Sets the fields of the call the key may be in.
    pub fn with_key_pointers(mut self, pointers: Vec<JsonPointer>) -> Self {
        self.key_pointers = pointers;
        self
    }

    /// Sets whether a key is required.
    pub fn with_require_key(mut self, require: bool) -> Self {
        self.require_key = require;
        self
    }
}

/// A route's JSON-RPC methods; calls of methods no rule names, and
/// notifications, pass through unprotected.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct JsonRpc {
    rules: Vec<MethodRule>,
}

/// A protected call: its key, its operation within the route, its `id`,
/// and the bytes its fingerprint is taken over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    /// The key.
    pub key: IdempotencyKey,
    /// `method`, or `tools/call <tool>`.
    pub operation: String,
    /// The call's `id`, as a JSON text (`7`, `"abc"`).
    pub id: Bytes,
    /// Canonical JSON of `{"method", "params"}`, `params` without the
    /// key's field and `_meta`.
    pub fingerprinted: Bytes,
}

/// What a route does with one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Judged {
    /// Forward it as it is: not a call a rule protects (or not JSON-RPC
    /// at all, for the service to answer), a notification, or a call
    /// without a key where none is required.
    Pass,
    /// Answer this error object: nothing forwarded, nothing recorded.
    Refuse {
        /// The call's `id` as a JSON text (`null` when it has none).
        id: Bytes,
        /// Why.
        problem: Problem,
    },
    /// Protect it.
    Protect(Call),
    /// A client's `notifications/cancelled`: answered `202 Accepted` here
    /// and never forwarded. The gateway runs a call it protects to its
    /// end whatever its client does (a client that gives up must not
    /// leave a half-run call whose answer is "cancelled" for good); the
    /// retry gets the answer.
    Absorb,
}

impl JsonRpc {
    /// A route protecting the methods `rules` name, the first rule that
    /// matches a call deciding.
    pub fn new(rules: Vec<MethodRule>) -> Self {
        Self { rules }
    }

    /// The rules.
    pub fn rules(&self) -> &[MethodRule] {
        &self.rules
    }

    /// The rule covering `method` (and `tool`), if any.
    fn rule(&self, method: &str, tool: Option<&str>) -> Option<&MethodRule> {
        self.rules.iter().find(|r| {
            r.method == method
                && match tool {
                    Some(tool) => r.tools.covers(tool),
                    None => true,
                }
        })
    }

    /// Judges a request to the route: its headers and body.
    ///
    /// A batch (a JSON array) passes when no call in it is protected, and
    /// is refused when one is: each call of a batch would need its own
    /// record and the batch one answer, and the MCP protocol no longer
    /// sends batches.
    pub fn judge(&self, headers: &HeaderMap, body: &[u8]) -> Judged {
        let doc = match idem::json_strict(body) {
            Ok(doc) => doc,
            // Not JSON, or JSON two readers read apart: for the service
            // to answer (its parse error), never recorded.
            Err(_) => return Judged::Pass,
        };
        match &doc {
            Value::Array(calls) => {
                let protected = calls.iter().any(|c| {
                    matches!(
                        self.judge_call(headers, c),
                        Judged::Protect(_) | Judged::Refuse { .. }
                    )
                });
                if protected {
                    return Judged::Refuse {
                        id: Bytes::from_static(b"null"),
                        problem: Problem::new(
                            ProblemKind::JsonRpcBatchRefused,
                            "a batch holding a protected call is refused; send each protected call alone",
                        ),
                    };
                }
                Judged::Pass
            }
            call => self.judge_call(headers, call),
        }
    }

    fn judge_call(&self, headers: &HeaderMap, call: &Value) -> Judged {
        let Value::Object(members) = call else {
            return Judged::Pass;
        };
        if let (Some(Value::String(method)), None) = (members.get("method"), members.get("id"))
            && method == CANCELLED
        {
            return Judged::Absorb;
        }
        let (Some(Value::String(method)), Some(id)) = (members.get("method"), members.get("id"))
        else {
            // No method (a response), or a notification: nothing to keep.
            return Judged::Pass;
        };
        let params = members.get("params");
        let tool = match (method.as_str(), params) {
            (TOOLS_CALL, Some(Value::Object(p))) => match p.get("name") {
                Some(Value::String(name)) => Some(name.as_str()),
                _ => None,
            },
            _ => None,
        };
        if method == TOOLS_CALL && tool.is_none() {
            return Judged::Pass;
        }
        let Some(rule) = self.rule(method, tool) else {
            return Judged::Pass;
        };
        let id_text = Bytes::from(idem::canonical_json_value(id, 16));
        let refuse = |problem: Problem| Judged::Refuse {
            id: id_text.clone(),
            problem,
        };
        let (key, field) = match key_in(
            headers,
            &rule.key_headers,
            &rule.key_pointers,
            call,
            "the call's",
        ) {
            Ok(Some(found)) => found,
            Ok(None) if rule.require_key => {
                return refuse(key_required(method, &rule.key_headers, &rule.key_pointers));
            }
            Ok(None) => return Judged::Pass,
            Err(problem) => return refuse(problem),
        };
        let operation = match tool {
            Some(tool) => format!("{method} {tool}"),
            None => method.clone(),
        };
        // The meaning of the call: method and params, without the key's
        // own field (a retry may send it elsewhere) and `_meta` (progress
        // tokens and the client's bookkeeping), never its `id`.
        let mut params = params.cloned().unwrap_or(Value::Null);
        // A key in the call's `params` is left out of them.
        if let (Some(path), Value::Object(p)) = (&field, &mut params)
            && let Some(("params", below)) = path.split_first().map(|(f, r)| (f.as_str(), r))
        {
            crate::pointer::remove_below(p, below);
        }
        if let Value::Object(p) = &mut params {
            p.remove("_meta");
        }
        let mut meaning = idem::json::Map::new();
        meaning.insert("method".to_owned(), Value::String(method.clone()));
        meaning.insert("params".to_owned(), params);
        let fingerprinted = Bytes::from(idem::canonical_json_value(&Value::Object(meaning), 256));
        Judged::Protect(Call {
            key,
            operation,
            id: id_text,
            fingerprinted,
        })
    }
}

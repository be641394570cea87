//! Which requests are protected, under which operation name and policy.
//!
//! Routes match by method and path pattern (`/v1/payments`,
//! `/v1/orders/{id}/capture`); the operation is `METHOD pattern`, so every
//! order's capture shares one policy while keys stay per tenant. A `POST` or
//! `PATCH` that matches no route is protected with the default policy under
//! `METHOD path`; other methods pass through untouched unless a route opts
//! them in.
//!
//! ```
//! use http::Method;
//! use idem_http::{RoutePolicy, Routes};
//!
//! let routes = Routes::new(RoutePolicy::default())
//!     .route(Method::POST, "/v1/orders/{id}/capture", RoutePolicy::default().with_require_key(true))?;
//! let m = routes.matching(&Method::POST, "/v1/orders/42/capture").expect("protected");
//! assert_eq!(m.operation, "POST /v1/orders/{id}/capture");
//! assert!(m.policy.require_key);
//! assert!(routes.matching(&Method::GET, "/v1/orders/42").is_none());
//! # Ok::<(), idem_http::PatternError>(())
//! ```

use std::borrow::Cow;
use std::sync::Arc;

use http::{HeaderName, Method, StatusCode, header};
use idem::Policy;

use crate::graphql::GraphQl;
use crate::jsonrpc::JsonRpc;
use crate::lookup::Lookup;
use crate::pattern::{PathPattern, PatternError, lenient_form, normalize_path};
use crate::webhook::Webhook;
use crate::{BodyFields, Contract, IDEMPOTENCY_KEY, JsonPointer};

/// HTTP-level policy of one route, around the engine's [`Policy`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RoutePolicy {
    /// Retention, lease, lapses, fail mode, in-flight handling, release statuses.
    pub engine: Policy,
    /// Refuse requests without a key (`400`) instead of passing them through.
    pub require_key: bool,
    /// Largest request body accepted, in bytes (`413` above).
    pub max_request_body: usize,
    /// Largest response body stored for replay; larger ones are recorded as
    /// a tombstone (status and headers, body not retained).
    pub max_stored_response: usize,
    /// Status for a key reused with another request (422 per the IETF
    /// draft; 400 as Stripe does).
    pub mismatch_status: StatusCode,
    /// Headers the key is read from, the first the request carries
    /// winning (default `Idempotency-Key`).
    pub key_headers: Vec<HeaderName>,
    /// The field of a JSON body the key is read from when no key header
    /// is sent (default: none; the body is then read before the tenant).
    pub key_from: Option<JsonPointer>,
    /// Headers that are part of the fingerprint (default `content-type`).
    pub fingerprint_headers: Vec<HeaderName>,
    /// Which fields of a JSON body the fingerprint covers (default: all).
    pub fingerprint_body: BodyFields,
    /// Response headers never stored nor replayed, besides those that
    /// never are whatever this says: `set-cookie`, `content-length` and
    /// the hop-by-hop ones (default: none more).
    pub unstored_headers: Vec<HeaderName>,
    /// How a held record of this route (its outcome unknown) is looked up
    /// on the inner service, to settle it ([`Lookup`]); `None`: it is held
    /// for an operator.
    pub lookup: Option<Arc<Lookup>>,
    /// What a request without the credential its tenant comes from gets
    /// (default: refused, `401 tenant-missing`).
    pub on_missing_tenant: MissingTenant,
    /// What a request whose path is not spelled as the route judges it
    /// gets (default: forwarded in the judged spelling).
    pub path_spelling: PathSpelling,
    /// What the route's answers promise and the format of its keys
    /// (default: the `stripe` profile, any key).
    pub contract: Contract,
    /// The webhook sender whose signed deliveries the route receives
    /// ([`with_webhook`](Self::with_webhook)); `None`: a keyed route.
    pub webhook: Option<Arc<Webhook>>,
    /// The JSON-RPC methods the route protects ([`with_jsonrpc`](Self::with_jsonrpc));
    /// `None`: a keyed route.
    pub jsonrpc: Option<Arc<JsonRpc>>,
    /// How the route's GraphQL requests are judged ([`with_graphql`](Self::with_graphql));
    /// `None`: a keyed route.
    pub graphql: Option<Arc<GraphQl>>,
}

/// What a request on a route gets when its path is not spelled as the
/// route judges it: normalisation changes it (dot segments, repeated
/// slashes, escaped unreserved characters; a trailing slash aside), or it
/// matches the route only with its `;` parameters or format suffix
/// ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PathSpelling {
    /// Matched and fingerprinted in its normal form, and forwarded in that
    /// form (a trailing slash as sent), so that the upstream runs the
    /// request that was judged.
    #[default]
    Normalise,
    /// `400 request-path-not-canonical`, whether a key is sent or not:
    /// nothing forwarded, nothing recorded. For an upstream that would
    /// read another spelling differently.
    Refuse,
}

/// What a protected request gets when it lacks the credential its tenant
/// comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MissingTenant {
    /// `401 tenant-missing`: nothing forwarded, nothing recorded.
    #[default]
    Refuse,
    /// Forwarded unprotected, with `Idempotency-Status: unprotected`,
    /// counted and logged: for an upstream that answers such requests
    /// itself (with its own `401`).
    Pass,
}

impl Default for RoutePolicy {
    fn default() -> Self {
        Self {
            engine: Policy::default(),
            require_key: false,
            max_request_body: 1024 * 1024,
            max_stored_response: 1024 * 1024,
            mismatch_status: StatusCode::UNPROCESSABLE_ENTITY,
            key_headers: vec![IDEMPOTENCY_KEY],
            key_from: None,
            fingerprint_headers: vec![header::CONTENT_TYPE],
            fingerprint_body: BodyFields::All,
            unstored_headers: Vec::new(),
            lookup: None,
            on_missing_tenant: MissingTenant::Refuse,
            path_spelling: PathSpelling::Normalise,
            contract: Contract::default(),
            webhook: None,
            jsonrpc: None,
            graphql: None,
        }
    }
}

impl RoutePolicy {
    /// Sets the engine policy.
    pub fn with_engine(mut self, engine: Policy) -> Self {
        self.engine = engine;
        self
    }

    /// Sets whether a key is required.
    pub fn with_require_key(mut self, require: bool) -> Self {
        self.require_key = require;
        self
    }

    /// Sets the request body limit.
    pub fn with_max_request_body(mut self, bytes: usize) -> Self {
        self.max_request_body = bytes;
        self
    }

    /// Sets the stored response limit.
    pub fn with_max_stored_response(mut self, bytes: usize) -> Self {
        self.max_stored_response = bytes;
        self
    }

    /// Sets the mismatch status.
    pub fn with_mismatch_status(mut self, status: StatusCode) -> Self {
        self.mismatch_status = status;
        self
    }

    /// Sets what a request without its tenant's credential gets.
    pub fn with_on_missing_tenant(mut self, on_missing: MissingTenant) -> Self {
        self.on_missing_tenant = on_missing;
        self
    }

    /// Sets what a request whose path is not spelled as the route judges
    /// it gets.
    pub fn with_path_spelling(mut self, spelling: PathSpelling) -> Self {
        self.path_spelling = spelling;
        self
    }

    /// Reads the key from the first of these headers the request carries.
    pub fn with_key_headers(mut self, names: Vec<HeaderName>) -> Self {
        self.key_headers = names;
        self
    }

    /// Reads the key from this field of a JSON body when no key header
    /// is sent.
    pub fn with_key_from(mut self, field: JsonPointer) -> Self {
        self.key_from = Some(field);
        self
    }

    /// Sets which fields of a JSON body the fingerprint covers.
    pub fn with_fingerprint_body(mut self, fields: BodyFields) -> Self {
        self.fingerprint_body = fields;
        self
    }

    /// Sets what the route's answers promise and the format of its keys.
    pub fn with_contract(mut self, contract: Contract) -> Self {
        self.contract = contract;
        self
    }

    /// Receives `webhook`'s signed deliveries: each is verified over its
    /// raw body before anything else, its key is its delivery id (no key
    /// header is read, and every delivery has one) and its tenant the
    /// sender ([`Webhook::tenant`]).
    pub fn with_webhook(mut self, webhook: Webhook) -> Self {
        self = self.keyed_in_body(true);
        self.webhook = Some(Arc::new(webhook));
        self
    }

    /// A route whose requests say in their body where their key is (and
    /// whether they need one): no route-wide key header or field is read
    /// before the body, and the route refuses nothing for want of one
    /// unless `require_key`.
    fn keyed_in_body(mut self, require_key: bool) -> Self {
        self.key_headers = Vec::new();
        self.key_from = None;
        self.require_key = require_key;
        self
    }

    /// Speaks JSON-RPC 2.0: each call is judged by its method ([`JsonRpc`]),
    /// its key read where its method's rule says (no route-wide key
    /// header), its answers and refusals JSON-RPC's. An MCP session id is
    /// never stored with an answer: a retry may come on another session.
    pub fn with_jsonrpc(mut self, jsonrpc: JsonRpc) -> Self {
        self = self.keyed_in_body(false);
        let session = HeaderName::from_static("mcp-session-id");
        if !self.unstored_headers.contains(&session) {
            self.unstored_headers.push(session);
        }
        self.jsonrpc = Some(Arc::new(jsonrpc));
        self
    }

    /// Speaks GraphQL: each request is judged by the operation it selects
    /// ([`GraphQl`]): a mutation is protected, its key read where
    /// `graphql` says (no route-wide key header); a query or
    /// subscription passes through unrecorded. Refusals are GraphQL
    /// errors.
    pub fn with_graphql(mut self, graphql: GraphQl) -> Self {
        self = self.keyed_in_body(false);
        self.graphql = Some(Arc::new(graphql));
        self
    }

    /// Sets how held records of this route are looked up.
    pub fn with_lookup(mut self, lookup: Lookup) -> Self {
        self.lookup = Some(Arc::new(lookup));
        self
    }
}

#[derive(Debug, Clone)]
struct Route {
    method: Method,
    pattern: PathPattern,
    /// `METHOD pattern`, made once.
    operation: String,
    policy: Arc<RoutePolicy>,
}

/// The metrics label of protected requests that matched no configured
/// route and run under the defaults (their paths would make the label
/// unbounded).
pub const UNMATCHED_ROUTE: &str = "unmatched";
/// The metrics label of requests the layer does not protect at all: no
/// configured route matches them and the defaults leave their method alone.
pub const UNPROTECTED_ROUTE: &str = "none";

/// The route table; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct Routes {
    routes: Vec<Route>,
    defaults: Arc<RoutePolicy>,
    ignore_case: bool,
    ignore_parameters: bool,
    ignore_suffixes: bool,
}

/// A protected request's route.
#[derive(Debug, Clone)]
pub struct RouteMatch<'a> {
    /// Index of the route (`routes.len()` for the defaults), stable for the
    /// table's life.
    pub index: usize,
    /// The operation name: `METHOD pattern`, or `METHOD path` for defaults.
    pub operation: Cow<'a, str>,
    /// The route's policy.
    pub policy: &'a Arc<RoutePolicy>,
    /// The metrics label: the operation for a configured route,
    /// [`UNMATCHED_ROUTE`] for the defaults.
    pub label: &'a str,
    /// The route's path pattern (`None` for the defaults).
    pub pattern: Option<&'a PathPattern>,
    /// Whether the path matched as it is (normalised), not only with its
    /// `;` parameters or format suffix ignored.
    pub exact: bool,
}

impl Default for Routes {
    fn default() -> Self {
        Self::new(RoutePolicy::default())
    }
}

impl Routes {
    /// A table with no routes: `POST`/`PATCH` protected by `defaults`.
    pub fn new(defaults: RoutePolicy) -> Self {
        Self {
            routes: Vec::new(),
            defaults: Arc::new(defaults),
            ignore_case: true,
            ignore_parameters: true,
            ignore_suffixes: true,
        }
    }

    /// Matches routes' literal segments regardless of ASCII case
    /// (`/V1/Payments` takes `/v1/payments`'s policy, as ASP.NET and other
    /// case-insensitive routers run it); parameters and the fingerprint
    /// keep the case sent. On by default, for the reasons of
    /// [`with_ignore_path_parameters`](Self::with_ignore_path_parameters);
    /// off, routes that differ only in case can both be configured. Set it
    /// before adding routes: [`route`](Self::route) refuses a shadowed
    /// route by the table's rule at the time.
    pub fn with_ignore_case(mut self, ignore_case: bool) -> Self {
        self.ignore_case = ignore_case;
        self
    }

    /// Matches a path whose segments carry `;` parameters to the route of
    /// the path without them (`/v1/payments;jsessionid=1` and
    /// `/x/..;/v1/payments` take `/v1/payments`'s policy), as servlet
    /// containers route them. On by default: a route that matches more
    /// spellings only protects more, and the fingerprint keeps the path
    /// sent. A spelling that matches a route as it is takes that route.
    pub fn with_ignore_path_parameters(mut self, ignore: bool) -> Self {
        self.ignore_parameters = ignore;
        self
    }

    /// Matches a path whose last segment ends in a format suffix (a dot,
    /// then up to 16 ASCII letters or digits) to the route of the path
    /// without it (`/v1/payments.json` takes `/v1/payments`'s policy), as
    /// Rails and suffix-matching frameworks route them. On by default,
    /// for the reasons of
    /// [`with_ignore_path_parameters`](Self::with_ignore_path_parameters).
    pub fn with_ignore_path_suffixes(mut self, ignore: bool) -> Self {
        self.ignore_suffixes = ignore;
        self
    }

    /// Adds a route (first match wins). A route that an earlier one
    /// [shadows](Self::shadowing) is refused: it could never be chosen.
    pub fn route(
        mut self,
        method: Method,
        pattern: &str,
        policy: RoutePolicy,
    ) -> Result<Self, PatternError> {
        let pattern = PathPattern::parse(pattern)?;
        if self.shadowing(&method, &pattern).is_some() {
            return Err(PatternError {
                pattern: pattern.as_str().to_owned(),
                reason: "an earlier route of the same method matches every path this one does, so this one would never be chosen (the first match wins)",
            });
        }
        if let Some(lookup) = &policy.lookup
            && lookup
                .params()
                .any(|name| !pattern.param_names().any(|p| p == name))
        {
            return Err(PatternError {
                pattern: lookup.path().to_owned(),
                reason: "the lookup names a parameter the route's path does not have",
            });
        }
        self.routes.push(Route {
            operation: format!("{method} {}", pattern.as_str()),
            method,
            pattern,
            policy: Arc::new(policy),
        });
        Ok(self)
    }

    /// The index of the earlier route that would take every request a
    /// route `method pattern` would match, if there is one: such a route is
    /// unreachable. (A configuration error to report with its line: the
    /// gateway asks before [`route`](Self::route) refuses it.)
    pub fn shadowing(&self, method: &Method, pattern: &PathPattern) -> Option<usize> {
        self.routes
            .iter()
            .position(|r| r.method == method && r.pattern.covers(pattern, self.ignore_case))
    }

    /// The table with `change` applied to every policy, the defaults'
    /// too (what a store's limits impose on every route, say).
    pub fn map_policies(mut self, mut change: impl FnMut(&mut RoutePolicy)) -> Self {
        for route in &mut self.routes {
            change(Arc::make_mut(&mut route.policy));
        }
        change(Arc::make_mut(&mut self.defaults));
        self
    }

    /// The default policy.
    pub fn defaults(&self) -> &Arc<RoutePolicy> {
        &self.defaults
    }

    /// The metrics labels of every route, in index order: the configured
    /// routes' operations, then [`UNMATCHED_ROUTE`], then [`UNPROTECTED_ROUTE`].
    pub fn labels(&self) -> impl Iterator<Item = &str> {
        self.routes
            .iter()
            .map(|r| r.operation.as_str())
            .chain([UNMATCHED_ROUTE, UNPROTECTED_ROUTE])
    }

    /// The metrics label of route `index` (see [`labels`](Self::labels)).
    pub fn label(&self, index: usize) -> &str {
        self.routes.get(index).map_or(
            if index == self.routes.len() {
                UNMATCHED_ROUTE
            } else {
                UNPROTECTED_ROUTE
            },
            |r| r.operation.as_str(),
        )
    }

    /// Number of policies: one per route plus the defaults (the last index).
    pub fn policies(&self) -> impl Iterator<Item = &Arc<RoutePolicy>> {
        self.routes
            .iter()
            .map(|r| &r.policy)
            .chain(std::iter::once(&self.defaults))
    }

    /// The path pattern of route `index` (`None` for the defaults).
    pub fn pattern(&self, index: usize) -> Option<&PathPattern> {
        self.routes.get(index).map(|r| &r.pattern)
    }

    /// Each configured route's method, pattern and policy, in order.
    pub(crate) fn entries(
        &self,
    ) -> impl Iterator<Item = (&Method, &PathPattern, &Arc<RoutePolicy>)> {
        self.routes
            .iter()
            .map(|r| (&r.method, &r.pattern, &r.policy))
    }

    /// Each configured route's operation and policy, in order.
    pub(crate) fn configured(&self) -> impl Iterator<Item = (&str, &Arc<RoutePolicy>)> {
        self.routes
            .iter()
            .map(|r| (r.operation.as_str(), &r.policy))
    }

    /// The route protecting this request, if any, matched on the
    /// [normalised](normalize_path) `path`, or else on that path with what
    /// the table ignores ([parameters](Self::with_ignore_path_parameters),
    /// [suffixes](Self::with_ignore_path_suffixes)) dropped.
    pub fn matching(&self, method: &Method, path: &str) -> Option<RouteMatch<'_>> {
        self.matching_normalized(method, &normalize_path(path))
    }

    /// [`matching`](Self::matching) for a path already normalised (the
    /// layer normalises once, and fingerprints the same form).
    pub(crate) fn matching_normalized(
        &self,
        method: &Method,
        path: &str,
    ) -> Option<RouteMatch<'_>> {
        let find = |path: &str| {
            self.routes
                .iter()
                .enumerate()
                .find(|(_, r)| r.method == method && r.pattern.matches_with(path, self.ignore_case))
        };
        let found = match find(path) {
            Some(found) => Some((found, true)),
            // No route of this method: no spelling of the path can match one.
            None if !self.routes.iter().any(|r| r.method == method) => None,
            None => lenient_form(path, self.ignore_parameters, self.ignore_suffixes)
                .and_then(|lenient| find(&lenient))
                .map(|found| (found, false)),
        };
        if let Some(((index, route), exact)) = found {
            return Some(RouteMatch {
                index,
                operation: Cow::Borrowed(&route.operation),
                policy: &route.policy,
                label: &route.operation,
                pattern: Some(&route.pattern),
                exact,
            });
        }
        (method == Method::POST || method == Method::PATCH).then(|| RouteMatch {
            index: self.routes.len(),
            // Joined by hand: `format!` costs several times as much, on
            // every request to an unrouted path.
            operation: Cow::Owned([method.as_str(), " ", path].concat()),
            policy: &self.defaults,
            label: UNMATCHED_ROUTE,
            pattern: None,
            exact: true,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns() {
        let p = PathPattern::parse("/v1/orders/{id}/capture").expect("valid");
        assert!(p.matches("/v1/orders/42/capture"));
        assert!(!p.matches("/v1/orders//capture"));
        assert!(!p.matches("/v1/orders/42"));
        assert!(!p.matches("/v1/orders/42/capture/x"));
        assert!(PathPattern::parse("/").expect("root").matches("/"));
        for bad in ["v1", "/v1//x", "/v1/", "/{}", "/a{id}", "/{a}b"] {
            assert!(PathPattern::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(p.param_names().collect::<Vec<_>>(), ["id"]);
        assert_eq!(p.param("id", "/v1/orders/42/capture"), Some("42"));
        assert_eq!(p.param("other", "/v1/orders/42/capture"), None);
    }

    #[test]
    fn a_route_that_an_earlier_one_shadows_is_refused() {
        let p = RoutePolicy::default;
        let routes = Routes::default()
            .route(Method::POST, "/v1/orders/{id}", p())
            .expect("valid");
        // Same method, and every path it matches the first takes.
        for shadowed in [
            "/v1/orders/{id}",
            "/v1/orders/{other}",
            "/v1/orders/refunds",
        ] {
            let err = routes
                .clone()
                .route(Method::POST, shadowed, p())
                .expect_err(shadowed);
            assert!(err.to_string().contains("never be chosen"), "{err}");
            let pattern = PathPattern::parse(shadowed).expect("valid");
            assert_eq!(routes.shadowing(&Method::POST, &pattern), Some(0));
        }
        // Another method, another length, or a narrower earlier route: reachable.
        let routes = routes
            .route(Method::PUT, "/v1/orders/{id}", p())
            .and_then(|r| r.route(Method::POST, "/v1/orders/{id}/capture", p()))
            .and_then(|r| r.route(Method::POST, "/v1/refunds/{id}", p()))
            .expect("reachable");
        let specific_first = Routes::default()
            .route(Method::POST, "/v1/orders/refunds", p())
            .and_then(|r| r.route(Method::POST, "/v1/orders/{id}", p()));
        assert!(specific_first.is_ok());
        // Case-insensitive tables compare literals regardless of case.
        let ci = Routes::default()
            .with_ignore_case(true)
            .route(Method::POST, "/v1/Payments", p())
            .expect("valid");
        assert!(ci.route(Method::POST, "/v1/payments", p()).is_err());
        assert_eq!(routes.labels().count(), 6);
    }

    #[test]
    fn no_spelling_of_a_path_slips_past_its_route() {
        let routes = Routes::default()
            .route(
                Method::PUT,
                "/v1/payments",
                RoutePolicy::default().with_require_key(true),
            )
            .expect("valid");
        for path in [
            "/v1/payments",
            "/v1/payments/",
            "//v1///payments",
            "/v1/./payments",
            "/v1/x/../payments",
            "/v1/%70ayments",
            "/v1/%2e/payments",
            "/v1/x/%2E%2E/payments",
        ] {
            let m = routes.matching(&Method::PUT, path);
            assert_eq!(m.map(|m| m.index), Some(0), "{path}");
        }
        // Other escapes stay escaped (a%2Fb is one segment, not two).
        assert_eq!(normalize_path("/v1/a%2fb/c"), "/v1/a%2Fb/c");
        assert_eq!(normalize_path("/../.."), "/");
        assert!(matches!(normalize_path("/v1/payments"), Cow::Borrowed(_)));
        // Case: ignored unless asked otherwise.
        assert_eq!(
            routes
                .matching(&Method::PUT, "/V1/Payments")
                .map(|m| m.index),
            Some(0)
        );
        let exact = routes.with_ignore_case(false);
        assert!(exact.matching(&Method::PUT, "/V1/Payments").is_none());
    }

    /// Spellings that servlet containers (`;jsessionid=1`) and Rails or
    /// suffix-matching frameworks (`.json`) route to the same handler take
    /// the route's policy; a route spelled with the suffix still wins its
    /// own requests, and both leniencies can be turned off.
    #[test]
    fn parameters_and_suffixes_an_upstream_ignores_do_not_skip_a_route() {
        let p = RoutePolicy::default;
        let routes = Routes::default()
            .route(
                Method::POST,
                "/v1/payments",
                RoutePolicy::default().with_require_key(true),
            )
            .and_then(|r| r.route(Method::POST, "/v1/orders/{id}/capture", p()))
            .and_then(|r| r.route(Method::POST, "/v1/export.csv", p()))
            .and_then(|r| r.route(Method::POST, "/v1/export", p()))
            .expect("valid");
        let index = |routes: &Routes, path: &str| {
            routes
                .matching(&Method::POST, path)
                .filter(|m| m.pattern.is_some())
                .map(|m| (m.index, m.exact))
        };
        for path in [
            "/v1/payments;jsessionid=1",
            "/v1/payments.json",
            "/v1/payments.json;jsessionid=1",
            "/v1;v=2/payments",
            "/v1/payments/;x",
            "/x/..;/v1/payments",
        ] {
            assert_eq!(index(&routes, path), Some((0, false)), "{path}");
        }
        assert_eq!(index(&routes, "/v1/payments"), Some((0, true)));
        assert_eq!(
            index(&routes, "/v1/orders/o.1/capture.json"),
            Some((1, false))
        );
        assert_eq!(index(&routes, "/v1/orders/o.1/capture"), Some((1, true)));
        // What matches as sent wins over what matches leniently.
        assert_eq!(index(&routes, "/v1/export.csv"), Some((2, true)));
        assert_eq!(index(&routes, "/v1/export.json"), Some((3, false)));
        // Not suffixes: a dot-led segment, nor what is not a short word.
        for path in [
            "/v1/.json",
            "/v1/payments.",
            "/v1/payments.j-s",
            "/v1/payments%3Bx",
        ] {
            assert_eq!(index(&routes, path), None, "{path}");
        }
        let exact = routes
            .with_ignore_path_parameters(false)
            .with_ignore_path_suffixes(false);
        assert_eq!(index(&exact, "/v1/payments;jsessionid=1"), None);
        assert_eq!(index(&exact, "/v1/payments.json"), None);
        assert_eq!(index(&exact, "/v1/payments"), Some((0, true)));
    }

    #[test]
    fn a_lookup_may_name_only_the_route_s_parameters() {
        let lookup = |path: &str| {
            RoutePolicy::default().with_lookup(Lookup::new(Method::GET, path).expect("template"))
        };
        let ok = Routes::default().route(
            Method::POST,
            "/v1/orders/{id}/capture",
            lookup("/v1/orders/{id}/captures/by-key/{key}"),
        );
        assert!(ok.is_ok());
        let err = Routes::default()
            .route(
                Method::POST,
                "/v1/payments",
                lookup("/v1/payments/{id}/{key}"),
            )
            .expect_err("no {id} in the route");
        assert!(err.to_string().contains("does not have"), "{err}");
    }

    #[test]
    fn default_protection_and_opt_in() {
        let routes = Routes::default()
            .route(
                Method::PUT,
                "/v1/things/{id}",
                RoutePolicy::default().with_require_key(true),
            )
            .expect("valid");
        assert!(routes.matching(&Method::GET, "/x").is_none());
        assert!(routes.matching(&Method::DELETE, "/x").is_none());
        let post = routes
            .matching(&Method::POST, "/x/1")
            .expect("post protected");
        assert_eq!(post.operation, "POST /x/1");
        assert_eq!(post.index, 1);
        assert!(routes.matching(&Method::PATCH, "/x").is_some());
        let put = routes
            .matching(&Method::PUT, "/v1/things/9")
            .expect("opted in");
        assert_eq!(
            (put.index, put.operation.as_ref()),
            (0, "PUT /v1/things/{id}")
        );
        assert!(routes.matching(&Method::PUT, "/v1/other").is_none());
    }
}

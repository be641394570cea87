//! What a request brings before the engine is asked: its body within the
//! limit, its key, and the path it is forwarded on as judged.

use super::*;

pub(super) fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// A request body, read already or not yet.
pub(super) enum Received<B> {
    Read(Bytes),
    Unread(B),
}

impl<B: From<Bytes>> Received<B> {
    /// The body to forward as it is.
    pub(super) fn into_body(self) -> B {
        match self {
            Self::Read(bytes) => B::from(bytes),
            Self::Unread(body) => body,
        }
    }
}

/// Why a request body was not read: the log's reason and the answer.
pub(super) struct BodyRefused {
    pub(super) reason: &'static str,
    pub(super) problem: Problem,
}

/// Reads a protected request's body within the route's limit.
pub(super) async fn read_body<B>(
    parts: &Parts,
    body: B,
    policy: &RoutePolicy,
) -> Result<Bytes, BodyRefused>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let too_large = || BodyRefused {
        reason: "idempotency_body_too_large",
        problem: Problem::new(
            ProblemKind::BodyTooLarge,
            format!(
                "the request body is larger than the {} bytes this route accepts",
                policy.max_request_body
            ),
        ),
    };
    if content_length(&parts.headers).is_some_and(|n| n > policy.max_request_body as u64) {
        return Err(too_large());
    }
    match read_request(body, policy.max_request_body).await {
        Ok(bytes) => Ok(bytes),
        Err(RequestBodyError::TooLarge) => Err(too_large()),
        Err(RequestBodyError::TimedOut(err)) => Err(BodyRefused {
            reason: "idempotency_body_timeout",
            problem: Problem::new(
                ProblemKind::BodyTimeout,
                format!("the request body stalled: {err}; nothing was recorded or forwarded"),
            ),
        }),
        Err(RequestBodyError::Unreadable(err)) => Err(BodyRefused {
            reason: "idempotency_body_unreadable",
            problem: Problem::new(
                ProblemKind::BodyUnreadable,
                format!("the request body could not be read to its end: {err}"),
            ),
        }),
    }
}

/// Whether a request without a key header may carry its key in the body:
/// the route names a `key_from` field, and only a JSON body can hold it
/// (any other is forwarded, or refused, unread, as on a route without
/// `key_from`); or the route receives webhooks, whose every delivery is
/// read and verified before its id is believed; or it speaks JSON-RPC or
/// GraphQL, whose requests say in their body whether they are protected.
pub(super) fn key_in_body(policy: &RoutePolicy, headers: &HeaderMap) -> bool {
    policy.webhook.is_some()
        || policy.jsonrpc.is_some()
        || policy.graphql.is_some()
        || (policy.key_from.is_some() && is_json(headers))
}

/// The answer to a protected route's request that carries no key: a
/// refusal where the route requires one; `None` passes it through.
pub(super) fn missing_key<B>(
    policy: &RoutePolicy,
    operation: &str,
) -> Option<Response<ResponseBody<B>>> {
    if !policy.require_key {
        return None;
    }
    tracing::info!(reason = "idempotency_missing_key", %operation);
    let headers: Vec<String> = policy.key_headers.iter().map(header_label).collect();
    let mut wanted = match headers.as_slice() {
        [] => String::new(),
        // The default, as it always read: "requires an Idempotency-Key header".
        [one] => format!("an {one} header"),
        many => format!("one of the headers {}", many.join(", ")),
    };
    if let Some(field) = &policy.key_from {
        let body = format!("the JSON body's {field}");
        wanted = if wanted.is_empty() {
            body
        } else {
            format!("{wanted} or {body}")
        };
    }
    Some(problem(
        Problem::new(
            ProblemKind::KeyMissing,
            format!("{operation} requires {wanted}"),
        ),
        Decision::MissingKey,
    ))
}

/// A `Connection` header that names the key or the tenant's header: the
/// layer would read them, and the next hop strip them, so the upstream
/// would run a request other than the one judged. Refused (`400`).
pub(super) fn connection_names_what_was_read<T: TenantExtractor>(
    parts: &Parts,
    policy: &RoutePolicy,
    tenant: &T,
) -> Option<Problem> {
    if !parts.headers.contains_key(header::CONNECTION) {
        return None;
    }
    let named = crate::headers::hop_by_hop_names(&parts.headers);
    if let Some(key) = policy.key_headers.iter().find(|h| named.contains(h)) {
        return Some(Problem::new(
            ProblemKind::KeyInvalid,
            format!(
                "the Connection header names {key}, which would be removed before the upstream; nothing was forwarded"
            ),
        ));
    }
    let credentials = tenant.credentials(parts);
    let name = credentials.keys().find(|h| named.contains(h))?;
    Some(Problem::new(
        ProblemKind::TenantInvalid,
        format!(
            "the Connection header names {name}, which would be removed before the upstream; nothing was forwarded"
        ),
    ))
}

/// Whether a request path `sent` is the spelling its route judged: it
/// matched its route `exact`ly, and it is what is forwarded for it
/// ([`judged_path`]; `normalized` is `None` when normalising left it as
/// it is).
pub(super) fn spelled_as_judged(sent: &str, normalized: Option<&str>, exact: bool) -> bool {
    exact && normalized.is_none_or(|n| judged_path(sent, n) == sent)
}

/// The path a request sent as `sent` and judged on `normalized` goes
/// upstream with: the normal form, and a trailing slash as sent, so that
/// upstreams that route `/payments/` and `/payments` apart (Django's
/// `APPEND_SLASH`) keep working.
pub(super) fn judged_path(sent: &str, normalized: &str) -> String {
    let mut path = String::with_capacity(sent.len());
    path.push_str(normalized);
    if sent.len() > 1 && sent.ends_with('/') && normalized != "/" {
        path.push('/');
    }
    path
}

/// Puts the path a protected request was matched and fingerprinted on in
/// its URI, so that the upstream runs the request that was judged: an
/// upstream that does not resolve `%2e%2e` would otherwise run
/// `/orders/B/%2e%2e/A/capture` as B's capture under A's fingerprint
/// ([`judged_path`]).
pub(super) fn forward_as_judged<B>(req: &mut Request<B>, normalized: &str) {
    let sent = req.uri().path();
    let mut path = judged_path(sent, normalized);
    if path == sent {
        return;
    }
    if let Some(query) = req.uri().query() {
        path.push('?');
        path.push_str(query);
    }
    let mut uri = req.uri().clone().into_parts();
    uri.path_and_query = path.parse().ok();
    if let Ok(uri) = http::Uri::from_parts(uri) {
        *req.uri_mut() = uri;
    }
}

/// Removes what the request's peer may not carry on to the service (see
/// [`TenantExtractor::remove_untrusted`]): on every path that forwards a
/// request whose tenant was not judged trusted.
pub(super) fn remove_untrusted<T: TenantExtractor, B>(tenant: &T, req: &mut Request<B>) {
    let peer = req.extensions().get::<PeerAddr>().copied();
    tenant.remove_untrusted(req.headers_mut(), peer.as_ref());
}

/// Forwards `req` as it is and labels the answer with `decision`. The
/// request goes to the inner service at once, not when the future is
/// first polled: held in the future, it was one more copy of the request
/// (and of the future around it) on every request.
pub(super) fn pass_through<I, ReqBody, ResBody>(
    mut inner: I,
    req: Request<ReqBody>,
    decision: Decision,
) -> impl Future<Output = Answer<ResBody, I::Error>>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    let called = inner.call(req);
    async move {
        Ok(with_decision(
            called.await?.map(ResponseBody::inner),
            decision,
        ))
    }
}

//! Held outcomes: an attempt whose outcome is unknown, the hand-off to the
//! reconciliation, and the answer to a request that meets a held record.

use super::*;

/// What an attempt needs to hand its record to the reconciliation when its
/// outcome turns out unknown, or what a request that met a held record
/// tells it: the route's lookup, with the tenant's credentials and the
/// concrete path's parameters.
pub(super) struct Handoff<S> {
    reconciliation: Reconciliation<S, HttpLookup>,
    credentials: HeaderMap,
    params: Vec<(String, String)>,
}

impl<S: Store> Handoff<S> {
    /// Keeps this request's lookup for the record.
    pub(super) fn remember(&self, scope: &Scope, key: &IdempotencyKey) {
        self.reconciliation
            .reconciler()
            .remember(scope, key, self.credentials.clone(), |name| {
                self.params
                    .iter()
                    .find(|(n, _)| n == name)
                    .map(|(_, v)| v.clone())
            });
    }
}

impl<S: Store, T: TenantExtractor> Shared<S, T> {
    /// The hand-off for a request of route `route`, if its record can be
    /// reconciled.
    pub(super) fn handoff(
        &self,
        route: usize,
        parts: &http::request::Parts,
        path: &str,
        scope: &Scope,
    ) -> Option<Handoff<S>> {
        let reconciliation = self.reconciliation.as_ref()?;
        if !reconciliation.reconciler().covers(scope.operation()) {
            return None;
        }
        let params = self
            .routes
            .pattern(route)
            .map(|p| {
                p.param_names()
                    .filter_map(|n| Some((n.to_owned(), p.param(n, path)?.to_owned())))
                    .collect()
            })
            .unwrap_or_default();
        Some(Handoff {
            reconciliation: reconciliation.clone(),
            credentials: self.tenant.credentials(parts),
            params,
        })
    }
}

/// An answer that does not prove the request was not executed: the record
/// is held as an unknown outcome and the answer goes to the client as it
/// came, with `Retry-After` when a lookup will settle the record.
pub(super) async fn held_as_unknown<S: Store, B>(
    mut parts: http::response::Parts,
    body: ResponseBody<B>,
    guard: Guard<S>,
    handoff: Option<Handoff<S>>,
    cause: &str,
) -> Response<ResponseBody<B>> {
    tracing::warn!(reason = "idempotency_outcome_unknown", tenant = guard.scope().tenant(), operation = guard.scope().operation(), key = %guard.key(), status = parts.status.as_u16(), cause);
    trace::record(trace::RECORD_STATE, "outcome_unknown");
    if let Some(after) = unknown(guard, cause, handoff).await {
        parts.headers.insert(
            header::RETRY_AFTER,
            HeaderValue::from(retry_after_secs(after)),
        );
    }
    with_decision(Response::from_parts(parts, body), Decision::OutcomeUnknown)
}

/// Marks the attempt's outcome unknown; with a hand-off, the record goes to
/// the reconciliation (settled with this attempt's lease). Returns when
/// the first lookup is due, if one will be made.
pub(super) async fn unknown<S: Store>(
    guard: Guard<S>,
    cause: &str,
    handoff: Option<Handoff<S>>,
) -> Option<Duration> {
    let (scope, key, lease) = (guard.scope().clone(), guard.key().clone(), *guard.lease());
    let marked = guard.unknown(cause).await;
    let ok = marked.is_ok();
    log_recording(&scope, &key, "outcome unknown", marked);
    let handoff = handoff.filter(|_| ok)?;
    handoff.remember(&scope, &key);
    let first = handoff.reconciliation.hold(&scope, &key, lease);
    if first.is_none() {
        handoff.reconciliation.reconciler().forget(&scope, &key);
    }
    first
}

/// The answer to a request that met a held record (its outcome unknown,
/// nobody running it): being reconciled (when the next lookup is due),
/// about to be run again (`on_lease_expiry = "retry"`), or held for an
/// operator.
pub(super) fn held<S: Store>(
    handoff: Option<Handoff<S>>,
    policy: &RoutePolicy,
    scope: &Scope,
    key: &IdempotencyKey,
    retry_after: Duration,
) -> Problem {
    if let Some(handoff) = handoff {
        handoff.remember(scope, key);
        let next = handoff.reconciliation.held(scope, key);
        if next.is_none() {
            handoff.reconciliation.reconciler().forget(scope, key);
        }
        if let Some(next) = next {
            return Problem::new(
                ProblemKind::OutcomeReconciling,
                "an earlier attempt with this key may have taken effect; the upstream is being asked what became of it: retry after the indicated delay to get its answer",
            )
            .with_retry_after(next);
        }
    } else if policy.engine.on_lease_expiry == LeaseExpiry::Retry {
        return Problem::new(
            ProblemKind::InProgress,
            "an earlier attempt with this key may have taken effect; this route runs it again with the same key once its lease lapses (on_lease_expiry = \"retry\")",
        )
        .with_retry_after(retry_after);
    }
    tracing::info!(reason = "idempotency_held", tenant = scope.tenant(), operation = scope.operation(), %key, "a held record: nothing reconciles it automatically");
    let answer = Problem::new(
        ProblemKind::OutcomeHeld,
        "an earlier attempt with this key may have taken effect and nothing can tell automatically whether it did; the request is held for an operator and will not run again. Retrying will not change the answer until it is resolved",
    );
    match policy.contract.held_retry_after {
        Some(after) => answer.with_retry_after(after),
        None => answer,
    }
}

/// How lookups reach `inner`: a fresh clone per lookup, readied, called;
/// its answer read up to [`LOOKUP_BODY_LIMIT`]. An answer the inner
/// service made because its upstream failed is an error, not a verdict.
pub(super) fn lookup_sender<I, ReqBody, ResBody>(inner: I) -> Sender
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
    I::Future: Send + 'static,
    ReqBody: From<Bytes> + Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let inner = std::sync::Mutex::new(inner);
    Arc::new(move |lookup: LookupRequest| {
        let mut svc = inner.lock().unwrap_or_else(|p| p.into_inner()).clone();
        Box::pin(async move {
            let mut req = Request::new(ReqBody::from(Bytes::new()));
            *req.method_mut() = lookup.method;
            *req.uri_mut() = lookup.uri;
            *req.headers_mut() = lookup.headers;
            std::future::poll_fn(|cx| svc.poll_ready(cx))
                .await
                .map_err(|_| BoxError::from("the service is not ready for the lookup"))?;
            let resp = svc
                .call(req)
                .await
                .map_err(|_| BoxError::from("the service failed the lookup"))?;
            let (parts, body) = resp.into_parts();
            if parts.extensions.get::<UpstreamOutcome>().is_some() {
                return Err(format!(
                    "the lookup got no answer from the upstream ({})",
                    parts.status
                )
                .into());
            }
            match keep_response(body, LOOKUP_BODY_LIMIT).await {
                Kept::Whole(bytes, _) => Ok((parts.status, parts.headers, bytes)),
                Kept::TooLarge { .. } => Err("the lookup's answer is too large to record".into()),
                Kept::Broken(err) => Err(err),
            }
        })
    })
}

/// The largest lookup answer recorded as a held record's answer.
pub const LOOKUP_BODY_LIMIT: usize = 1024 * 1024;

pub(super) fn log_recording(
    scope: &Scope,
    key: &idem::IdempotencyKey,
    what: &str,
    result: Result<(), idem::StoreError>,
) {
    if let Err(err) = result {
        tracing::error!(reason = "idempotency_record_failed", tenant = scope.tenant(), operation = scope.operation(), %key, %err, what);
    }
}

//! The request flow: route the request, judge it, ask the engine, and act
//! on its answer.

use super::execute::execute;
use super::held::{held, lookup_sender};
use super::incoming::{
    Received, connection_names_what_was_read, forward_as_judged, key_in_body, missing_key,
    pass_through, read_body, remove_untrusted, spelled_as_judged,
};
use super::replay::replayed;
use super::*;
use crate::graphql::Judged as GraphQlJudged;
use crate::jsonrpc::Judged as RpcJudged;

impl<S: Store, T: TenantExtractor> Shared<S, T> {
    pub(super) fn start_reconciliation(&self) {
        if let Some(r) = &self.reconciliation
            && tokio::runtime::Handle::try_current().is_ok()
        {
            self.started.get_or_init(|| {
                r.spawn();
            });
        }
    }

    /// Routes the request, and answers it: what needs no waiting here
    /// and now (a keyless request goes to the inner service at once), the
    /// rest in `protect`. Every answer is counted.
    ///
    /// Only the future the request needs is boxed. One async function for
    /// all of them held the request, and room for `protect`'s whole state
    /// machine, in every request's box (2,976 bytes, copied into it each
    /// time); a keyless request's box now holds the inner service's future.
    pub(super) fn handle<I, ReqBody, ResBody>(
        this: &Arc<Self>,
        inner: I,
        req: Request<ReqBody>,
    ) -> Pin<Box<dyn Future<Output = Answer<ResBody, I::Error>> + Send>>
    where
        I: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone + Send + 'static,
        I::Future: Send + 'static,
        I::Error: Send + 'static,
        ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
        ReqBody::Error: Into<BoxError>,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let started = Instant::now();
        // Lookups reach the inner service from the first request on: that
        // is where the service and its body types are known.
        if let Some(r) = &this.reconciliation
            && !r.reconciler().connected()
        {
            r.reconciler().connect(|| lookup_sender(inner.clone()));
            this.start_reconciliation();
        }
        // Matched, fingerprinted and forwarded in one spelling. Kept only
        // when it differs from the path sent (rare): no allocation on the
        // common path.
        let normalized = match normalize_path(req.uri().path()) {
            Cow::Borrowed(_) => None,
            Cow::Owned(path) => Some(path.into_boxed_str()),
        };
        let route = this.routes.matching_normalized(
            req.method(),
            normalized.as_deref().unwrap_or(req.uri().path()),
        );
        // Every answer the layer makes to a gRPC call is a gRPC status.
        let grpc = crate::grpc::is_grpc(req.headers());
        let counted = Counted {
            grpc,
            shared: Arc::clone(this),
            // Labels index: configured routes, then the defaults, then "none".
            index: route.as_ref().map_or(this.engines.len(), |r| r.index),
            matched: route.is_some(),
            started,
        };
        // A refusal, or `None` to forward the request as it is.
        let refused = match route {
            None => None,
            Some(route)
                if route.policy.path_spelling == PathSpelling::Refuse
                    && !spelled_as_judged(req.uri().path(), normalized.as_deref(), route.exact) =>
            {
                tracing::info!(reason = "path_not_canonical", operation = %route.operation);
                let detail = "this route takes its path only as spelled in its normal form";
                Some(problem(
                    Problem::new(ProblemKind::PathNotCanonical, detail),
                    Decision::BadRequest,
                ))
            }
            Some(route) => match key_from_headers(req.headers(), &route.policy.key_headers) {
                Err(p) => {
                    tracing::info!(reason = "idempotency_invalid_key", operation = %route.operation, detail = p.detail());
                    Some(problem(p, Decision::InvalidKey))
                }
                Ok(None) if !key_in_body(route.policy, req.headers()) => {
                    missing_key(route.policy, &route.operation)
                }
                Ok(key) => {
                    let mut req = req;
                    if let Some(path) = &normalized {
                        forward_as_judged(&mut req, path);
                    }
                    let this = Arc::clone(this);
                    let protected = Protected {
                        index: route.index,
                        operation: route.operation.into_owned(),
                        policy: Arc::clone(route.policy),
                        normalized,
                    };
                    return Box::pin(async move {
                        let policy = Arc::clone(&protected.policy);
                        let answer = Self::protect(&this, inner, req, key, protected).await;
                        counted.record(answer.map(|resp| advertise_retention(resp, &policy)))
                    });
                }
            },
        };
        match refused {
            Some(refusal) => Box::pin(async move { counted.record(Ok(refusal)) }),
            None => {
                let mut req = req;
                remove_untrusted(&*this.tenant, &mut req);
                let forwarded = pass_through(inner, req, Decision::PassThrough);
                Box::pin(async move { counted.record(forwarded.await) })
            }
        }
    }

    pub(super) async fn protect<I, ReqBody, ResBody>(
        this: &Arc<Self>,
        inner: I,
        req: Request<ReqBody>,
        header_key: Option<IdempotencyKey>,
        route: Protected,
    ) -> Answer<ResBody, I::Error>
    where
        I: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
        I::Future: Send + 'static,
        I::Error: Send + 'static,
        ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
        ReqBody::Error: Into<BoxError>,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let Protected {
            index,
            operation,
            policy,
            normalized,
        } = route;
        let (parts, body) = req.into_parts();
        if let Some(refused) = connection_names_what_was_read(&parts, &policy, &*this.tenant) {
            tracing::info!(reason = "idempotency_connection_header", %operation, detail = refused.detail());
            return Ok(problem(refused, Decision::BadRequest));
        }
        // Without a key header (`handle` sends such a request here only
        // when `key_in_body` holds), the body is read first: whether the
        // request is protected at all depends on it.
        // A JSON-RPC route's protected call, or a GraphQL route's
        // mutation.
        let mut judged: Option<Judged> = None;
        let (key, body) = match header_key {
            Some(key) => (key, Received::Unread(body)),
            None => {
                let bytes = match read_body(&parts, body, &policy).await {
                    Ok(bytes) => bytes,
                    Err(refused) => {
                        tracing::info!(reason = refused.reason, %operation, detail = refused.problem.detail());
                        return Ok(problem(refused.problem, Decision::BadRequest));
                    }
                };
                let found = match (
                    &policy.webhook,
                    &policy.jsonrpc,
                    &policy.graphql,
                    &policy.key_from,
                ) {
                    // The signature is checked over the body as received,
                    // before the id in it is believed.
                    (Some(hook), _, _, _) => match hook.verify(&parts.headers, &bytes) {
                        Ok(key) => {
                            this.metrics.webhook(&this.routes, index, None);
                            Ok(Some(key))
                        }
                        Err(refusal) => {
                            this.metrics
                                .webhook(&this.routes, index, Some(refusal.reason));
                            tracing::warn!(reason = "webhook_refused", %operation, provider = hook.provider().name(), refused = refusal.reason.as_str(), detail = refusal.detail());
                            return Ok(problem(refusal.problem(), Decision::Unverified));
                        }
                    },
                    (None, Some(rpc), _, _) => match rpc.judge(&parts.headers, &bytes) {
                        RpcJudged::Pass => Ok(None),
                        RpcJudged::Absorb => {
                            tracing::info!(reason = "jsonrpc_cancel_absorbed", %operation);
                            let mut resp = Response::new(ResponseBody::full(Bytes::new()));
                            *resp.status_mut() = StatusCode::ACCEPTED;
                            return Ok(with_decision(resp, Decision::PassThrough));
                        }
                        RpcJudged::Protect(call) => {
                            let key = call.key;
                            judged = Some(Judged {
                                operation: call.operation,
                                fingerprinted: call.fingerprinted,
                                form: Form::JsonRpc(call.id),
                            });
                            Ok(Some(key))
                        }
                        RpcJudged::Refuse { id, problem: p } => {
                            tracing::info!(reason = "idempotency_invalid_key", %operation, kind = p.slug(), detail = p.detail());
                            return Ok(refused(&p, crate::jsonrpc::refusal(&id, &p)));
                        }
                    },
                    (None, None, Some(gql), _) => {
                        let content_type = parts
                            .headers
                            .get(header::CONTENT_TYPE)
                            .and_then(|v| v.to_str().ok());
                        match gql.judge(&parts.headers, content_type, &bytes) {
                            GraphQlJudged::Pass => Ok(None),
                            GraphQlJudged::Protect(mutation) => {
                                let key = mutation.key;
                                judged = Some(Judged {
                                    operation: mutation.operation,
                                    fingerprinted: mutation.fingerprinted,
                                    form: Form::GraphQl(accept(&parts.headers).map(str::to_owned)),
                                });
                                Ok(Some(key))
                            }
                            GraphQlJudged::Refuse(p) => {
                                tracing::info!(reason = "graphql_refused", %operation, kind = p.slug(), detail = p.detail());
                                let answer = crate::graphql::refusal(&p, accept(&parts.headers));
                                return Ok(refused(&p, answer));
                            }
                        }
                    }
                    (None, None, None, Some(field)) => key_from_body(&parts, &bytes, field),
                    (None, None, None, None) => Ok(None),
                };
                match found {
                    Ok(Some(key)) => (key, Received::Read(bytes)),
                    Ok(None) => {
                        if let Some(refusal) = missing_key(&policy, &operation) {
                            return Ok(refusal);
                        }
                        let mut req = Request::from_parts(parts, ReqBody::from(bytes));
                        remove_untrusted(&*this.tenant, &mut req);
                        return pass_through(inner, req, Decision::PassThrough).await;
                    }
                    Err(p) if p.kind() == Some(ProblemKind::BodyAmbiguous) => {
                        tracing::info!(reason = "idempotency_body_encoding", %operation, detail = p.detail());
                        return Ok(problem(p, Decision::BadRequest));
                    }
                    Err(p) => {
                        tracing::info!(reason = "idempotency_invalid_key", %operation, detail = p.detail());
                        return Ok(problem(p, Decision::InvalidKey));
                    }
                }
            }
        };
        // A call's operation within its route: `POST /mcp tools/call
        // charge`, `POST /graphql mutation CreatePayment`.
        let (operation, fingerprinted, form) = match judged {
            Some(j) => (
                format!("{operation} {}", j.operation),
                Some(j.fingerprinted),
                Some(j.form),
            ),
            None => (operation, None, None),
        };
        // A replay of a JSON-RPC call is given the retry's `id`.
        let rpc_id = match &form {
            Some(Form::JsonRpc(id)) => Some(id.clone()),
            _ => None,
        };
        let route = Protected {
            index,
            operation,
            policy,
            normalized,
        };
        let answer = Self::keyed(this, inner, parts, body, key, route, fingerprinted, rpc_id).await;
        // Every answer the layer makes to a call is said in its protocol.
        match form {
            Some(form) => answer.map(|resp| form.restate(resp)),
            None => answer,
        }
    }

    /// A request whose key is known, its body read or not: checks the key
    /// and the tenant, fingerprints the request (a JSON-RPC call by its
    /// meaning, `fingerprinted`), and hands it to `decide` in a task of
    /// its own (which gives a replay the call's `rpc_id`).
    #[allow(clippy::too_many_arguments)]
    async fn keyed<I, ReqBody, ResBody>(
        this: &Arc<Self>,
        inner: I,
        parts: http::request::Parts,
        body: Received<ReqBody>,
        key: IdempotencyKey,
        route: Protected,
        fingerprinted: Option<Bytes>,
        rpc_id: Option<Bytes>,
    ) -> Answer<ResBody, I::Error>
    where
        I: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
        I::Future: Send + 'static,
        I::Error: Send + 'static,
        ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
        ReqBody::Error: Into<BoxError>,
        ResBody: Body<Data = Bytes> + Send + 'static,
        ResBody::Error: Into<BoxError>,
    {
        let Protected {
            index,
            operation,
            policy,
            normalized,
        } = route;
        let engine = &this.engines[index];
        if let Some(lookup) = &policy.lookup
            && !lookup.accepts(&key)
        {
            let p = Problem::new(
                ProblemKind::KeyInvalid,
                "this route's lookup puts the key in a path segment of its own, which cannot be '.' or '..'",
            );
            tracing::info!(reason = "idempotency_invalid_key", %operation, detail = p.detail());
            return Ok(problem(p, Decision::InvalidKey));
        }
        if let Err(p) = policy.contract.check_key(&key) {
            tracing::info!(reason = "idempotency_invalid_key", %operation, detail = p.detail());
            return Ok(problem(p, Decision::InvalidKey));
        }
        // A webhook's tenant is its sender, which its signature proved.
        let tenant = match &policy.webhook {
            Some(hook) => Ok(crate::Tenant::Identity(Cow::Borrowed(hook.tenant()))),
            None => this.tenant.tenant(&parts),
        };
        let scope = match tenant.and_then(|t| {
            Scope::new(&this.hashing.tenant(&t), &operation)
                .map_err(|e| Problem::new(ProblemKind::TenantInvalid, e.to_string()))
        }) {
            Ok(scope) => scope,
            Err(p)
                if p.kind() == Some(ProblemKind::TenantMissing)
                    && policy.on_missing_tenant == MissingTenant::Pass =>
            {
                tracing::warn!(reason = "idempotency_unprotected", %operation, %key, detail = p.detail(), "no tenant credential: forwarded unprotected (on_missing_tenant = pass)");
                let mut req = Request::from_parts(parts, body.into_body());
                remove_untrusted(&*this.tenant, &mut req);
                let mut resp = pass_through(inner, req, Decision::Unprotected).await?;
                resp.headers_mut()
                    .insert(IDEMPOTENCY_STATUS, HeaderValue::from_static("unprotected"));
                return Ok(resp);
            }
            Err(p) => {
                tracing::info!(reason = "idempotency_bad_tenant", %operation, kind = p.slug(), detail = p.detail());
                return Ok(problem(p, Decision::BadRequest));
            }
        };
        let bytes = match body {
            Received::Read(bytes) => bytes,
            Received::Unread(body) => match read_body(&parts, body, &policy).await {
                Ok(bytes) => bytes,
                Err(refused) => {
                    tracing::info!(reason = refused.reason, tenant = scope.tenant(), operation = scope.operation(), %key, detail = refused.problem.detail());
                    return Ok(problem(refused.problem, Decision::BadRequest));
                }
            },
        };
        let path = normalized.as_deref().unwrap_or(parts.uri.path());
        let (fp, v1_fp) = match fingerprints(
            &this.hashing,
            &parts,
            path,
            &operation,
            &policy.fingerprint_headers,
            &policy.fingerprint_body,
            fingerprinted.as_ref().unwrap_or(&bytes),
        ) {
            Ok(fps) => fps,
            Err(p) => {
                tracing::info!(reason = "idempotency_body_encoding", tenant = scope.tenant(), operation = scope.operation(), %key);
                return Ok(problem(p, Decision::BadRequest));
            }
        };
        // While records from before keyed hashing may live, the request is
        // also looked for where they would be.
        let v1 = v1_fp
            .filter(|_| policy.webhook.is_none())
            .and_then(|fingerprint| {
                let tenant = this.tenant.v1_tenant(&parts)?;
                Some(V1Address {
                    scope: Scope::new(&tenant, &operation).ok()?,
                    fingerprint,
                })
            });
        // From the reservation on, everything runs in a task of its own: a
        // client that disconnects must not drop a reservation just made, nor
        // cancel the work or the recording of its result (its retry would
        // otherwise wait out the lease or run the work again). Boxed: the
        // task then holds a pointer, not the whole state machine, which
        // spawning copied into place on every request (`bench/cpu-budget`:
        // replays 24.4–24.8 → 22.7–22.8 µs of gateway CPU per request).
        // Even an answer the record cache holds goes through the task:
        // answering it in the caller's task (one poll before spawning) was
        // tried and measured slower on replays (`bench/ab`, same minutes:
        // 0.82–0.89× the requests/s at 1 and 64 connections).
        let decided = Box::pin(decide(
            Arc::clone(this),
            index,
            engine.clone(),
            inner,
            parts,
            bytes,
            scope,
            key,
            fp,
            v1,
            normalized,
            policy,
            rpc_id,
        ));
        // The task runs in the request's span when traces are kept.
        let task = if trace::active() {
            tokio::spawn(decided.instrument(tracing::Span::current()))
        } else {
            tokio::spawn(decided)
        };
        match task.await {
            Ok(answer) => answer,
            Err(join) => {
                // A panic in the inner service: its guard was dropped and the
                // lease will lapse; the caller learns the outcome is unknown.
                tracing::error!(reason = "idempotency_outcome_unknown", error = %join, "the request task failed");
                Ok(problem(
                    Problem::new(
                        ProblemKind::UpstreamBroken,
                        "processing failed unexpectedly; the outcome is unknown",
                    ),
                    Decision::OutcomeUnknown,
                ))
            }
        }
    }
}

/// Asks the engine and acts on its answer; runs detached from the client.
#[allow(clippy::too_many_arguments)]
pub(super) async fn decide<I, S, T, ReqBody, ResBody>(
    shared: Arc<Shared<S, T>>,
    route: usize,
    engine: Engine<S>,
    inner: I,
    parts: http::request::Parts,
    bytes: Bytes,
    scope: Scope,
    key: idem::IdempotencyKey,
    fp: idem::Fingerprint,
    v1: Option<V1Address>,
    normalized: Option<Box<str>>,
    policy: Arc<RoutePolicy>,
    rpc_id: Option<Bytes>,
) -> Answer<ResBody, I::Error>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    S: Store,
    T: TenantExtractor,
    ReqBody: Body<Data = Bytes> + From<Bytes> + Send + 'static,
    ReqBody::Error: Into<BoxError>,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    trace::record(trace::KEY, key.as_str());
    let begin = match &v1 {
        Some(v1) => engine.begin_accepting_v1(&scope, &key, fp, v1).await,
        None => engine.begin(&scope, &key, fp).await,
    };
    // A record the fingerprint does not match may have been written by
    // the version before for this very request: its fingerprint is
    // computed only then.
    let begin = match begin {
        Ok(Begin::Mismatch { state }) => {
            let path = normalized.as_deref().unwrap_or(parts.uri.path());
            match crate::previous_fingerprint(
                &shared.hashing,
                &parts,
                path,
                scope.operation(),
                &policy.fingerprint_headers,
                &policy.fingerprint_body,
                &bytes,
            ) {
                Some(previous) => engine.recheck_mismatch(&scope, &key, state, previous).await,
                None => Ok(Begin::Mismatch { state }),
            }
        }
        other => other,
    };
    match begin {
        Ok(Begin::Execute(guard)) => {
            if let Some(rerun) = guard.rerun() {
                shared.metrics.rerun(&shared.routes, route, rerun.reason);
            }
            let path = normalized.as_deref().unwrap_or(parts.uri.path());
            let handoff = shared.handoff(route, &parts, path, &scope);
            let req = Request::from_parts(parts, ReqBody::from(bytes));
            execute(inner, req, guard, policy, handoff).await
        }
        Ok(Begin::Replay(mut replay)) => {
            // A JSON-RPC answer goes back with the retry's own id.
            if let Some(id) = &rpc_id {
                let content_type = replay
                    .response
                    .headers
                    .iter()
                    .find(|(n, _)| n == "content-type")
                    .and_then(|(_, v)| std::str::from_utf8(v).ok());
                let body = crate::jsonrpc::with_id(&replay.response.body, content_type, id);
                replay.response.body = body;
            }
            tracing::info!(reason = "idempotency_replay", tenant = scope.tenant(), operation = scope.operation(), %key, state = %replay.state, resource_id = replay.resource_id.as_deref(), status = replay.response.status);
            trace::record(trace::RECORD_STATE, replay.state.as_str());
            Ok(with_decision(
                replayed(replay, &policy.contract),
                Decision::Replayed,
            ))
        }
        Ok(Begin::InProgress {
            retry_after,
            outcome_unknown,
        }) => {
            tracing::info!(reason = "idempotency_in_progress", tenant = scope.tenant(), operation = scope.operation(), %key, outcome_unknown);
            trace::record(
                trace::RECORD_STATE,
                if outcome_unknown {
                    "outcome_unknown"
                } else {
                    "processing"
                },
            );
            let answer = if outcome_unknown {
                let path = normalized.as_deref().unwrap_or(parts.uri.path());
                let handoff = shared.handoff(route, &parts, path, &scope);
                held(handoff, &policy, &scope, &key, retry_after)
            } else {
                // The attempt renews its lease while it runs, so the lease
                // says nothing of when it ends: ask again soon.
                Problem::new(
                    ProblemKind::InProgress,
                    "a request with this key is still being processed; retry after the indicated delay",
                )
                .with_retry_after(retry_after.min(IN_PROGRESS_RETRY_AFTER))
            };
            Ok(problem(answer, Decision::InProgress))
        }
        Ok(Begin::Mismatch { state }) => {
            tracing::info!(reason = "idempotency_mismatch", tenant = scope.tenant(), operation = scope.operation(), %key, %state);
            trace::record(trace::RECORD_STATE, state.as_str());
            Ok(problem(
                Problem::new(
                    ProblemKind::KeyReused,
                    format!("this Idempotency-Key was used for a different request ({state}); use a new key for a new request"),
                )
                .with_status(policy.mismatch_status),
                Decision::Mismatch,
            ))
        }
        Ok(Begin::Unprotected(err)) => {
            tracing::warn!(reason = "idempotency_unprotected", tenant = scope.tenant(), operation = scope.operation(), %key, %err);
            let req = Request::from_parts(parts, ReqBody::from(bytes));
            let mut resp = pass_through(inner, req, Decision::Unprotected).await?;
            resp.headers_mut()
                .insert(IDEMPOTENCY_STATUS, HeaderValue::from_static("unprotected"));
            Ok(resp)
        }
        Err(EngineError::Store(err)) => {
            tracing::warn!(reason = "idempotency_store_error", tenant = scope.tenant(), operation = scope.operation(), %key, %err);
            Ok(problem(
                Problem::new(
                    ProblemKind::StoreUnavailable,
                    "the idempotency store is unavailable; nothing was forwarded",
                )
                .with_retry_after(Duration::from_secs(1)),
                Decision::StoreError,
            ))
        }
        Err(err) => {
            tracing::warn!(reason = "idempotency_store_error", tenant = scope.tenant(), operation = scope.operation(), %key, %err);
            Ok(problem(
                Problem::new(ProblemKind::StoreUnavailable, err.to_string()),
                Decision::StoreError,
            ))
        }
    }
}

/// A request a JSON-RPC or GraphQL route protects, as its route judged
/// it from its body.
struct Judged {
    /// Its operation within the route (`tools/call charge`, `mutation
    /// CreatePayment`).
    operation: String,
    /// What its fingerprint covers: the request's meaning.
    fingerprinted: Bytes,
    /// The form the layer's own answers to it take.
    form: Form,
}

/// The protocol a judged request's answers are said in.
enum Form {
    /// A JSON-RPC error object with the call's `id`.
    JsonRpc(Bytes),
    /// A GraphQL error, in the media type the client's `Accept` names.
    GraphQl(Option<String>),
}

impl Form {
    /// The answer to the request: a refusal the layer made (in flight,
    /// key reused, held, store down) said in this form, labelled as
    /// before; any other answer is the service's, or a replay (a JSON-RPC
    /// one already given the call's `id`).
    fn restate<B>(&self, resp: Response<ResponseBody<B>>) -> Response<ResponseBody<B>> {
        match self {
            Self::JsonRpc(id) => ResponseBody::restate(resp, |p| crate::jsonrpc::refusal(id, p)),
            Self::GraphQl(accept) => {
                ResponseBody::restate(resp, |p| crate::graphql::refusal(p, accept.as_deref()))
            }
        }
    }
}

/// A request a protocol route refused as it read it, `answer` saying so
/// in the route's protocol, labelled by the problem: a missing key, an
/// invalid one, or a request it cannot take.
fn refused<B>(
    p: &Problem,
    answer: Response<http_body_util::Full<Bytes>>,
) -> Response<ResponseBody<B>> {
    let decision = match p.kind() {
        Some(ProblemKind::KeyMissing) => Decision::MissingKey,
        Some(ProblemKind::KeyInvalid | ProblemKind::KeyAmbiguous) => Decision::InvalidKey,
        _ => Decision::BadRequest,
    };
    with_decision(answer.map(|body| ResponseBody::Full { body }), decision)
}

/// The request's `Accept`, when it is text.
fn accept(headers: &http::HeaderMap) -> Option<&str> {
    headers.get(header::ACCEPT).and_then(|v| v.to_str().ok())
}

/// Adds `Idempotency-TTL` (the route's retention, in seconds) to an
/// answer about a key the route keeps (run, replayed, reused, in flight,
/// held), when its contract says so: not to a request refused before the
/// store was asked, nor one that went through unprotected.
fn advertise_retention<B>(mut resp: Response<B>, policy: &RoutePolicy) -> Response<B> {
    let kept = matches!(
        resp.extensions().get::<Decision>(),
        Some(
            Decision::Executed
                | Decision::Replayed
                | Decision::Mismatch
                | Decision::InProgress
                | Decision::OutcomeUnknown
        )
    );
    if policy.contract.retention_header && kept {
        resp.headers_mut().insert(
            IDEMPOTENCY_TTL,
            HeaderValue::from(policy.engine.retention.as_secs()),
        );
    }
    resp
}

//! The record's owner runs the work, detached from the client, and records
//! the answer as the route's policy says.

use super::held::{Handoff, held_as_unknown, log_recording, unknown};
use super::*;

/// Runs the work as the record's owner, detached from the caller.
pub(super) async fn execute<I, S, ReqBody, ResBody>(
    mut inner: I,
    req: Request<ReqBody>,
    mut guard: Guard<S>,
    policy: Arc<RoutePolicy>,
    handoff: Option<Handoff<S>>,
) -> Answer<ResBody, I::Error>
where
    I: Service<Request<ReqBody>, Response = Response<ResBody>> + Send + 'static,
    I::Future: Send + 'static,
    I::Error: Send + 'static,
    S: Store,
    ReqBody: Send + 'static,
    ResBody: Body<Data = Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    guard.keep_alive();
    let mut req = req;
    req.extensions_mut().insert(Reserved {
        scope: guard.scope().clone(),
        key: guard.key().clone(),
        lease: *guard.lease(),
    });
    let work = inner.call(req);
    {
        let (scope, key) = (guard.scope().clone(), guard.key().clone());
        let resp = match work.await {
            Ok(resp) => resp,
            Err(err) => {
                unknown(guard, "inner service failed", handoff).await;
                return Err(err);
            }
        };
        let (mut parts, body) = resp.into_parts();
        // The layer's own marker, never the upstream's to set.
        parts.headers.remove(NOT_RETAINED);
        // A gRPC answer's `grpc-status`, a JSON-RPC answer's error object,
        // and a GraphQL answer's `errors` and `data` decide with its
        // status, so a successful answer (and a GraphQL request error's
        // `400`) is read, within the stored limit, before it is judged; an
        // event stream too, which is then kept whole.
        let mut body = Pending::Unread(body);
        let mut judged_status = parts.status.as_u16();
        // A GraphQL answer that says nothing ran.
        let mut not_run = false;
        // A gRPC answer is `200` whatever became of the call: its status
        // is in its trailers, after the messages.
        let grpc = crate::grpc::is_grpc(&parts.headers);
        let judges_body = match (&policy.jsonrpc, &policy.graphql) {
            _ if grpc => parts.status.is_success(),
            (Some(_), _) => parts.status.is_success(),
            (None, Some(_)) => parts.status.is_success() || parts.status == StatusCode::BAD_REQUEST,
            (None, None) => false,
        };
        if judges_body
            && parts.extensions.get::<UpstreamOutcome>().is_none()
            && let Pending::Unread(unread) = body
        {
            let kept = keep_response(unread, policy.max_stored_response).await;
            if let Kept::Whole(bytes, trailers) = &kept {
                let content_type = parts
                    .headers
                    .get(header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok());
                if grpc {
                    let code = crate::grpc::status(&parts.headers, trailers.as_ref());
                    judged_status = crate::grpc::judged_status(code);
                } else if policy.jsonrpc.is_some() {
                    judged_status = match crate::jsonrpc::classify(bytes, content_type) {
                        crate::jsonrpc::ErrorClass::Result => judged_status,
                        crate::jsonrpc::ErrorClass::Final => 400,
                        crate::jsonrpc::ErrorClass::Server => 500,
                    };
                } else {
                    match crate::graphql::classify(bytes) {
                        crate::graphql::Outcome::Ran => {}
                        crate::graphql::Outcome::NotRun => not_run = true,
                        crate::graphql::Outcome::Failed => judged_status = 500,
                    }
                }
            }
            body = Pending::Read(kept);
        }
        // What the inner service knows of the side effect decides first;
        // otherwise the answer's status does, by the route's policy.
        let (resolution, cause) = match parts.extensions.get::<UpstreamOutcome>() {
            Some(UpstreamOutcome::NotSent) => (
                idem::Resolution::Release,
                "upstream not reached; key released",
            ),
            Some(UpstreamOutcome::MaybeSent) => (
                idem::Resolution::Unknown,
                "upstream failed after the request was sent",
            ),
            Some(UpstreamOutcome::Recorded) => {
                guard.recorded_elsewhere();
                return Ok(with_decision(
                    Response::from_parts(parts, body.into_body()),
                    Decision::Executed,
                ));
            }
            None if not_run => (
                idem::Resolution::Release,
                "the GraphQL answer says execution never began; key released",
            ),
            None => match policy.engine.resolution_for(judged_status) {
                idem::Resolution::Release => {
                    (idem::Resolution::Release, "transient status; key released")
                }
                idem::Resolution::Unknown => (
                    idem::Resolution::Unknown,
                    "the upstream's status does not prove the request was not executed",
                ),
                recorded => (recorded, ""),
            },
        };
        match resolution {
            idem::Resolution::Release => {
                trace::record(trace::RECORD_STATE, "released");
                log_recording(&scope, &key, cause, guard.release().await);
                return Ok(with_decision(
                    Response::from_parts(parts, body.into_body()),
                    Decision::Executed,
                ));
            }
            idem::Resolution::Unknown => {
                return Ok(held_as_unknown(parts, body.into_body(), guard, handoff, cause).await);
            }
            idem::Resolution::Complete | idem::Resolution::Fail => {}
        }
        let streamed = is_streamed(&parts.headers);
        let kept = match body {
            Pending::Read(kept) => kept,
            Pending::Unread(body) if streamed => Kept::TooLarge {
                prefix: Bytes::new(),
                rest: Box::pin(body),
            },
            Pending::Unread(body) => keep_response(body, policy.max_stored_response).await,
        };
        let stored_headers = storable_headers(&parts.headers, &policy.unstored_headers);
        let status = parts.status.as_u16();
        trace::record(
            trace::RECORD_STATE,
            match policy.engine.resolution_for(judged_status) {
                idem::Resolution::Fail => "failed",
                _ => "completed",
            },
        );
        match kept {
            Kept::Whole(bytes, trailers) => {
                let mut headers = stored_headers;
                if let Some(trailers) = &trailers {
                    headers.extend(storable_trailers(trailers, &policy.unstored_headers));
                }
                let stored = StoredResponse {
                    status,
                    headers,
                    body: bytes.clone(),
                };
                if let Err(err) = guard.finish(stored).await {
                    tracing::error!(reason = "idempotency_record_failed", tenant = scope.tenant(), operation = scope.operation(), %key, %err);
                }
                tracing::info!(reason = "idempotency_executed", tenant = scope.tenant(), operation = scope.operation(), %key, status, resolution = ?policy.engine.resolution_for(judged_status));
                Ok(with_decision(
                    Response::from_parts(parts, ResponseBody::with_trailers(bytes, trailers)),
                    Decision::Executed,
                ))
            }
            Kept::TooLarge { prefix, rest } => {
                let mut headers = stored_headers;
                headers.push((NOT_RETAINED.as_str().to_owned(), Bytes::from_static(b"1")));
                let tombstone = StoredResponse {
                    status,
                    headers,
                    body: Bytes::new(),
                };
                if let Err(err) = guard.finish(tombstone).await {
                    tracing::error!(reason = "idempotency_record_failed", tenant = scope.tenant(), operation = scope.operation(), %key, %err);
                }
                tracing::info!(reason = "idempotency_body_not_retained", tenant = scope.tenant(), operation = scope.operation(), %key, status, streamed);
                let body = ResponseBody::Prefixed {
                    prefix: (!prefix.is_empty()).then_some(prefix),
                    rest,
                };
                Ok(with_decision(
                    Response::from_parts(parts, body),
                    Decision::Executed,
                ))
            }
            Kept::Broken(err) => {
                tracing::warn!(reason = "idempotency_outcome_unknown", tenant = scope.tenant(), operation = scope.operation(), %key, %err, "response body broke off");
                let first_lookup = unknown(guard, "response body broke off", handoff).await;
                let mut answer = Problem::new(
                    ProblemKind::UpstreamBroken,
                    "the response broke off after the request was processed; its outcome is unknown",
                );
                if let Some(after) = first_lookup {
                    answer = answer.with_retry_after(after);
                }
                Ok(problem(answer, Decision::OutcomeUnknown))
            }
        }
    }
}

/// An answer's body: not read yet, or read already (a JSON-RPC route
/// reads a successful answer to judge its error object).
enum Pending<B> {
    Unread(B),
    Read(Kept<B>),
}

impl<B> Pending<B> {
    /// The body to answer with, whatever was read of it.
    fn into_body(self) -> ResponseBody<B> {
        match self {
            Self::Unread(body) => ResponseBody::inner(body),
            Self::Read(Kept::Whole(bytes, trailers)) => {
                ResponseBody::with_trailers(bytes, trailers)
            }
            Self::Read(Kept::TooLarge { prefix, rest }) => ResponseBody::Prefixed {
                prefix: (!prefix.is_empty()).then_some(prefix),
                rest,
            },
            Self::Read(Kept::Broken(_)) => ResponseBody::full(Bytes::new()),
        }
    }
}

/// Server-sent events and the like are never buffered for storage, but
/// on a JSON-RPC route, whose successful answers are read whole.
pub(super) fn is_streamed(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| {
            ct.trim_start()
                .to_ascii_lowercase()
                .starts_with("text/event-stream")
        })
}

//! Replays: the original answer rebuilt from its record, marked as the
//! route's contract says.

use super::*;

/// The headers that describe a body's bytes: an answer replayed without
/// its body leaves them out, since no body matches them.
const BODY_HEADERS: [HeaderName; 6] = [
    header::CONTENT_TYPE,
    header::CONTENT_ENCODING,
    header::CONTENT_RANGE,
    HeaderName::from_static("content-digest"),
    HeaderName::from_static("repr-digest"),
    HeaderName::from_static("digest"),
];

/// Rebuilds the original answer from the store.
pub(super) fn replayed<B>(replay: Replay, contract: &Contract) -> Response<ResponseBody<B>> {
    let StoredResponse {
        status,
        headers,
        body,
    } = replay.response;
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    let tombstone = headers.iter().any(|(n, _)| n == NOT_RETAINED.as_str());
    let mut resp = if tombstone {
        let mut resp = match contract.not_retained {
            NotRetained::Problem => {
                let (parts, body) = Problem::new(
                    ProblemKind::ResponseNotRetained,
                    "this request was already processed; its original response body was too large (or streamed) to keep",
                )
                .with_status(status)
                .to_response()
                .into_parts();
                Response::from_parts(parts, ResponseBody::Full { body })
            }
            NotRetained::Empty => {
                let mut resp = Response::new(ResponseBody::full(Bytes::new()));
                *resp.status_mut() = status;
                resp
            }
        };
        for (name, value) in &headers {
            if name == NOT_RETAINED.as_str() || BODY_HEADERS.iter().any(|h| h == name.as_str()) {
                continue;
            }
            append(resp.headers_mut(), name, value);
        }
        resp.headers_mut()
            .insert(IDEMPOTENCY_STATUS, HeaderValue::from_static("not-retained"));
        resp
    } else {
        let mut fields = HeaderMap::new();
        let mut trailers = HeaderMap::new();
        for (name, value) in &headers {
            match name.strip_prefix(TRAILER_PREFIX) {
                Some(trailer) => append(&mut trailers, trailer, value),
                None => append(&mut fields, name, value),
            }
        }
        let mut resp = Response::new(ResponseBody::with_trailers(body, Some(trailers)));
        *resp.status_mut() = status;
        *resp.headers_mut() = fields;
        resp
    };
    for name in &contract.replay_headers {
        resp.headers_mut()
            .insert(name.clone(), HeaderValue::from_static("true"));
    }
    resp
}

/// Adds a stored header to a replay, through the one gate of what is
/// replayable: a record written by hand, or by an older gateway, cannot
/// frame the replay nor hand out a session.
pub(super) fn append(headers: &mut HeaderMap, name: &str, value: &Bytes) {
    if let (Ok(name), Ok(value)) = (
        HeaderName::from_bytes(name.as_bytes()),
        HeaderValue::from_bytes(value),
    ) && replayable_name(&name)
    {
        headers.append(name, value);
    }
}

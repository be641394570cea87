//! Replays: the original answer rebuilt from its record.

use super::*;

/// Rebuilds the original answer from the store.
pub(super) fn replayed<B>(replay: Replay) -> Response<ResponseBody<B>> {
    let StoredResponse {
        status,
        headers,
        body,
    } = replay.response;
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::OK);
    let tombstone = headers.iter().any(|(n, _)| n == NOT_RETAINED.as_str());
    let mut resp = if tombstone {
        let (mut parts, body) = Problem::new(
            ProblemKind::ResponseNotRetained,
            "this request was already processed; its original response body was too large (or streamed) to keep",
        )
        .with_status(status)
        .to_response()
        .into_parts();
        for (name, value) in &headers {
            if name == NOT_RETAINED.as_str() || name == header::CONTENT_TYPE.as_str() {
                continue;
            }
            append(&mut parts.headers, name, value);
        }
        Response::from_parts(parts, ResponseBody::Full { body })
    } else {
        let mut resp = Response::new(ResponseBody::full(body));
        *resp.status_mut() = status;
        for (name, value) in &headers {
            append(resp.headers_mut(), name, value);
        }
        resp
    };
    resp.headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
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

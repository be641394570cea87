//! Bodies: reading requests within a limit, keeping responses for replay,
//! and the response body type the layer returns.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Response};

use crate::Problem;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};

/// Errors of bodies the layer hands out.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// The body of every response the layer returns: a buffered answer
/// (replay, problem, recorded response), the inner service's own body
/// (pass-through), or an inner body whose start was already read while
/// trying to store it.
pub enum ResponseBody<B> {
    /// Fully in memory.
    Full {
        /// The bytes.
        body: Full<Bytes>,
    },
    /// The inner service's body, untouched.
    Inner {
        /// The inner body.
        body: Pin<Box<B>>,
    },
    /// The part already read, then the rest of the inner body.
    Prefixed {
        /// Read already; sent first.
        prefix: Option<Bytes>,
        /// The remainder.
        rest: Pin<Box<B>>,
    },
    /// In memory, then trailer fields (a gRPC answer's `grpc-status`).
    Trailed {
        /// The bytes, sent first (`None` once sent, or when empty).
        body: Option<Bytes>,
        /// The trailers, sent last; boxed, so that every other answer's
        /// body, moved from wrapper to wrapper, stays as small as before.
        trailers: Option<Box<HeaderMap>>,
    },
}

impl<B> ResponseBody<B> {
    /// A buffered body.
    pub fn full(bytes: impl Into<Bytes>) -> Self {
        Self::Full {
            body: Full::new(bytes.into()),
        }
    }

    /// A buffered body followed by `trailers`; without any, a plain
    /// buffered one.
    pub fn with_trailers(bytes: impl Into<Bytes>, trailers: Option<HeaderMap>) -> Self {
        match trailers {
            Some(trailers) if !trailers.is_empty() => {
                let bytes = bytes.into();
                Self::Trailed {
                    body: (!bytes.is_empty()).then_some(bytes),
                    trailers: Some(Box::new(trailers)),
                }
            }
            _ => Self::full(bytes),
        }
    }

    /// A problem's whole response (status, problem+json, `Retry-After`).
    /// The problem rides in the response's extensions, so that a route
    /// that answers in another form (JSON-RPC) can say the same.
    pub fn problem(problem: &Problem) -> Response<Self> {
        let (mut parts, body) = problem.to_response().into_parts();
        parts.extensions.insert(problem.clone());
        Response::from_parts(parts, Self::Full { body })
    }

    /// An answer the layer (or the inner service, for an upstream that
    /// failed) said as a problem, said again in the form a route's
    /// clients read (`say` makes it: a JSON-RPC error object, a GraphQL
    /// error, a gRPC status), its extensions and other headers kept; any
    /// other answer as it is.
    pub fn restate(
        resp: Response<Self>,
        say: impl FnOnce(&Problem) -> Response<Full<Bytes>>,
    ) -> Response<Self> {
        let Some(problem) = resp.extensions().get::<Problem>().cloned() else {
            return resp;
        };
        let (parts, _) = resp.into_parts();
        let (mut answer, body) = say(&problem).into_parts();
        answer.extensions = parts.extensions;
        for (name, value) in &parts.headers {
            if name != http::header::CONTENT_TYPE && name != http::header::CONTENT_LENGTH {
                answer.headers.entry(name).or_insert_with(|| value.clone());
            }
        }
        Response::from_parts(answer, Self::Full { body })
    }

    /// The inner service's body.
    pub fn inner(body: B) -> Self {
        Self::Inner {
            body: Box::pin(body),
        }
    }
}

impl<B> std::fmt::Debug for ResponseBody<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Full { .. } => "ResponseBody::Full",
            Self::Inner { .. } => "ResponseBody::Inner",
            Self::Prefixed { .. } => "ResponseBody::Prefixed",
            Self::Trailed { .. } => "ResponseBody::Trailed",
        })
    }
}

impl<B> Body for ResponseBody<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        match self.get_mut() {
            Self::Full { body } => Pin::new(body)
                .poll_frame(cx)
                .map_err(|never| match never {}),
            Self::Inner { body } => body.as_mut().poll_frame(cx).map_err(Into::into),
            Self::Prefixed { prefix, rest } => match prefix.take() {
                Some(bytes) => Poll::Ready(Some(Ok(Frame::data(bytes)))),
                None => rest.as_mut().poll_frame(cx).map_err(Into::into),
            },
            Self::Trailed { body, trailers } => Poll::Ready(match body.take() {
                Some(bytes) => Some(Ok(Frame::data(bytes))),
                None => trailers.take().map(|t| Ok(Frame::trailers(*t))),
            }),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Full { body } => body.is_end_stream(),
            Self::Inner { body } => body.is_end_stream(),
            Self::Prefixed { prefix, rest } => prefix.is_none() && rest.is_end_stream(),
            Self::Trailed { body, trailers } => body.is_none() && trailers.is_none(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Full { body } => body.size_hint(),
            Self::Inner { body } => body.size_hint(),
            Self::Prefixed { prefix, rest } => {
                let extra = prefix.as_ref().map_or(0, |p| p.len() as u64);
                let inner = rest.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower() + extra);
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper + extra);
                }
                hint
            }
            Self::Trailed { body, .. } => {
                SizeHint::with_exact(body.as_ref().map_or(0, |b| b.len() as u64))
            }
        }
    }
}

/// Why a request body could not be taken.
#[derive(Debug)]
pub(crate) enum RequestBodyError {
    /// Over the limit.
    TooLarge,
    /// The body stream gave up waiting for the client: an error that is,
    /// or wraps, an [`std::io::Error`] of kind `TimedOut`.
    TimedOut(BoxError),
    /// The body broke off or failed.
    Unreadable(BoxError),
}

/// Reads a request body completely, refusing it past `limit` bytes.
pub(crate) async fn read_request<B>(body: B, limit: usize) -> Result<Bytes, RequestBodyError>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) if err.is::<LengthLimitError>() => Err(RequestBodyError::TooLarge),
        Err(err) if is_timeout(&*err) => Err(RequestBodyError::TimedOut(err)),
        Err(err) => Err(RequestBodyError::Unreadable(err)),
    }
}

/// Whether an error, or one of its causes, is an I/O time-out.
fn is_timeout(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        cur = e.source();
    }
    false
}

/// What reading a response body for storage found.
pub(crate) enum Kept<B> {
    /// The whole body, within the limit, and its trailers if it had any.
    Whole(Bytes, Option<HeaderMap>),
    /// Over the limit: what was read, and the rest still to stream.
    TooLarge { prefix: Bytes, rest: Pin<Box<B>> },
    /// The body failed part-way.
    Broken(BoxError),
}

/// Reads a response body for storage, stopping once it passes `limit`.
pub(crate) async fn keep_response<B>(body: B, limit: usize) -> Kept<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body = Box::pin(body);
    let mut buf = BytesMut::new();
    let mut trailers: Option<HeaderMap> = None;
    loop {
        match body.frame().await {
            None => return Kept::Whole(buf.freeze(), trailers),
            Some(Err(err)) => return Kept::Broken(err.into()),
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    buf.extend_from_slice(&data);
                    if buf.len() > limit {
                        return Kept::TooLarge {
                            prefix: buf.freeze(),
                            rest: body,
                        };
                    }
                }
                // Kept with the body: a gRPC answer's status is in them.
                Err(frame) => {
                    if let Ok(more) = frame.into_trailers() {
                        trailers.get_or_insert_with(HeaderMap::new).extend(more);
                    }
                }
            },
        }
    }
}

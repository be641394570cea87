//! [`ClientBody`]: a request body read from a client under the
//! `[limits]` body time-outs, and read ahead before its request takes an
//! in-flight slot.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use idem_http::BoxError;
use tokio::time::Sleep;

/// A request body from a client connection that fails with an
/// [`std::io::ErrorKind::TimedOut`] error when the client pauses longer
/// than the allowed time between chunks, or takes longer than the allowed
/// time in all. The timers exist only while the body is waiting: a body
/// that arrives with its head costs nothing.
///
/// What [`read_ahead`](Self::read_ahead) took from the client is given
/// out first, as it came (trailers included), then the error that ended
/// it, if one did: whoever reads the body answers it as any other.
#[derive(Debug)]
pub struct ClientBody {
    /// What was read ahead and not yet given out (boxed: the body moves
    /// with its request through every layer; a body of one chunk, most of
    /// them, costs this one allocation and no queue).
    ahead: Option<Box<Ahead>>,
    body: Incoming,
    idle: Option<Duration>,
    timer: Option<Pin<Box<Sleep>>>,
    /// When the whole body must be in (`None`: no limit).
    until: Option<tokio::time::Instant>,
    total: Option<Pin<Box<Sleep>>>,
}

/// Frames read ahead of a request's admission, in the order they came.
#[derive(Debug, Default)]
struct Ahead {
    /// The first, when it is data: the whole of most bodies, held without
    /// a queue (and so without an allocation).
    first: Option<Bytes>,
    /// The frames after it (or all of them, when the first is trailers).
    more: VecDeque<Frame<Bytes>>,
    /// Data bytes in `first` and `more`.
    len: u64,
    /// What ended the reading (a time-out), given out after the frames.
    broken: Option<BoxError>,
}

impl Ahead {
    fn push(&mut self, frame: Frame<Bytes>) {
        if let Some(data) = frame.data_ref() {
            self.len += data.len() as u64;
        }
        if self.first.is_none() && self.more.is_empty() {
            match frame.into_data() {
                Ok(data) => self.first = Some(data),
                Err(trailers) => self.more.push_back(trailers),
            }
        } else {
            self.more.push_back(frame);
        }
    }

    fn pop(&mut self) -> Option<Frame<Bytes>> {
        let frame = match self.first.take() {
            Some(data) => Frame::data(data),
            None => self.more.pop_front()?,
        };
        if let Some(data) = frame.data_ref() {
            self.len -= data.len() as u64;
        }
        Some(frame)
    }

    fn is_empty(&self) -> bool {
        self.first.is_none() && self.more.is_empty() && self.broken.is_none()
    }
}

impl ClientBody {
    /// Wraps `body`, allowing pauses of at most `idle` and `total` in all
    /// from now (`None`: no such limit).
    pub fn new(body: Incoming, idle: Option<Duration>, total: Option<Duration>) -> Self {
        Self {
            ahead: None,
            body,
            idle,
            timer: None,
            until: total.map(|t| tokio::time::Instant::now() + t),
            total: None,
        }
    }

    /// Reads from the client until the body's end, or until more than
    /// `up_to` bytes are in (the rest then streams as it comes), under the
    /// time-outs; an error ends it, to be given out in its turn.
    pub async fn read_ahead(&mut self, up_to: usize) {
        let up_to = u64::try_from(up_to).unwrap_or(u64::MAX);
        let mut ahead = Ahead::default();
        while ahead.len <= up_to {
            match std::future::poll_fn(|cx| self.poll_client(cx)).await {
                None => break,
                Some(Ok(frame)) => ahead.push(frame),
                Some(Err(err)) => {
                    ahead.broken = Some(err);
                    break;
                }
            }
        }
        if !ahead.is_empty() {
            self.ahead = Some(Box::new(ahead));
        }
    }

    /// Whether nothing was read ahead: then the body is the client's
    /// stream as it comes.
    pub fn nothing_ahead(&self) -> bool {
        self.ahead.is_none()
    }

    /// The client's stream, when nothing was read ahead of it.
    pub fn into_incoming(self) -> Incoming {
        debug_assert!(self.nothing_ahead(), "what was read ahead is kept");
        self.body
    }

    /// The next frame from the client, under the time-outs.
    fn poll_client(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self;
        if let Poll::Ready(frame) = Pin::new(&mut this.body).poll_frame(cx) {
            this.timer = None;
            return Poll::Ready(frame.map(|f| f.map_err(Into::into)));
        }
        if let Some(until) = this.until {
            let total = this
                .total
                .get_or_insert_with(|| Box::pin(tokio::time::sleep_until(until)));
            if total.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Some(Err(Box::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the request body took longer than body_total_timeout in all",
                )))));
            }
        }
        let Some(idle) = this.idle else {
            return Poll::Pending;
        };
        let timer = this
            .timer
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(idle)));
        ready!(timer.as_mut().poll(cx));
        this.timer = None;
        Poll::Ready(Some(Err(Box::new(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no request body data from the client for {idle:?}"),
        )))))
    }
}

impl Body for ClientBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        if let Some(ahead) = &mut this.ahead {
            let next = match ahead.pop() {
                Some(frame) => Some(Ok(frame)),
                None => ahead.broken.take().map(Err),
            };
            if ahead.is_empty() {
                this.ahead = None;
            }
            if let Some(next) = next {
                return Poll::Ready(Some(next));
            }
        }
        this.poll_client(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.nothing_ahead() && self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let Some(ahead) = &self.ahead else {
            return self.body.size_hint();
        };
        if self.body.is_end_stream() && ahead.broken.is_none() {
            return SizeHint::with_exact(ahead.len);
        }
        let rest = self.body.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(ahead.len.saturating_add(rest.lower()));
        if let Some(upper) = rest.upper() {
            hint.set_upper(ahead.len.saturating_add(upper));
        }
        hint
    }
}

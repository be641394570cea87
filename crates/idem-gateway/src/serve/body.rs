//! [`ClientBody`]: a request body read from a client under the
//! `[limits]` body time-outs.

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
#[derive(Debug)]
pub struct ClientBody {
    body: Incoming,
    idle: Option<Duration>,
    timer: Option<Pin<Box<Sleep>>>,
    /// When the whole body must be in (`None`: no limit).
    until: Option<tokio::time::Instant>,
    total: Option<Pin<Box<Sleep>>>,
}

impl ClientBody {
    /// Wraps `body`, allowing pauses of at most `idle` and `total` in all
    /// from now (`None`: no such limit).
    pub fn new(body: Incoming, idle: Option<Duration>, total: Option<Duration>) -> Self {
        Self {
            body,
            idle,
            timer: None,
            until: total.map(|t| tokio::time::Instant::now() + t),
            total: None,
        }
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

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

//! A connection's deadlines: its first bytes and its idleness
//! (`header_read_timeout`, `idle_timeout`), and the activity that tells
//! an idle connection from a busy one.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::{Body, Frame, SizeHint};
use tokio::time::Sleep;

/// A client connection's read deadlines.
///
/// * Its first bytes: before hyper knows the protocol (HTTP/1 or the
///   HTTP/2 preface) no header time-out of its own runs, so a socket that
///   sends nothing would hold its place under `max_connections` for ever.
/// * Idleness ([`with_idle`](Self::with_idle)): a connection with no
///   request in flight for `idle_timeout` is closed. HTTP/1 keep-alive
///   connections are closed sooner by `header_read_timeout`; an HTTP/2
///   connection answering the gateway's pings, but sending nothing else,
///   would otherwise stay open for ever.
#[derive(Debug)]
pub struct Deadlines<S> {
    inner: S,
    /// Until the first bytes arrive.
    deadline: Option<Pin<Box<Sleep>>>,
    idle: Option<Idle>,
}

#[derive(Debug)]
struct Idle {
    activity: Arc<Activity>,
    after: Duration,
    timer: Pin<Box<Sleep>>,
    /// Whether the timer holds the connection task's waker: then it is
    /// polled again only once it has fired (polling it on every read
    /// would re-register the waker each time: measurable on
    /// pass-through).
    armed: bool,
}

/// What a connection is doing: requests in flight (until their answer's
/// body is done), and when the last one ended.
#[derive(Debug)]
pub struct Activity {
    in_flight: AtomicUsize,
    /// When the last request ended, in milliseconds since `opened`.
    last_end: AtomicU64,
    opened: tokio::time::Instant,
}

impl Activity {
    /// A connection with nothing in flight since now.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            in_flight: AtomicUsize::new(0),
            last_end: AtomicU64::new(0),
            opened: tokio::time::Instant::now(),
        })
    }

    /// A request starts; it is in flight until the guard is dropped (put
    /// it in the answer's body).
    pub fn start(self: &Arc<Self>) -> Busy {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        Busy(Arc::clone(self))
    }

    /// When the connection counts as idle from, or `None` while busy.
    fn idle_since(&self) -> Option<tokio::time::Instant> {
        let last = self.opened + Duration::from_millis(self.last_end.load(Ordering::Acquire));
        (self.in_flight.load(Ordering::Acquire) == 0).then_some(last)
    }
}

/// One request in flight on a connection (see [`Activity::start`]).
#[derive(Debug)]
pub struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        let since = self.0.opened.elapsed().as_millis();
        self.0
            .last_end
            .store(u64::try_from(since).unwrap_or(u64::MAX), Ordering::Release);
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An answer's body that keeps its request [`Busy`] until it is done.
#[derive(Debug)]
pub struct Tracked<B> {
    inner: B,
    _busy: Option<Busy>,
}

impl<B> Tracked<B> {
    /// `inner`, busy until dropped.
    pub fn new(inner: B, busy: Option<Busy>) -> Self {
        Self { inner, _busy: busy }
    }
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl<S> Deadlines<S> {
    /// `inner`, closed with a time-out error if nothing is read from it
    /// within `within` (`None`: no deadline).
    pub fn new(inner: S, within: Option<Duration>) -> Self {
        Self {
            inner,
            deadline: within.map(|d| Box::pin(tokio::time::sleep(d))),
            idle: None,
        }
    }

    /// A client connection's deadlines: its first bytes within
    /// `first_bytes`, and, with `idle`, closed once nothing has been in
    /// flight that long; with it, the [`Activity`] to mark its requests on.
    pub fn for_connection(
        inner: S,
        first_bytes: Option<Duration>,
        idle: Option<Duration>,
    ) -> (Self, Option<Arc<Activity>>) {
        let stream = Self::new(inner, first_bytes);
        match idle {
            Some(after) => {
                let activity = Activity::new();
                (
                    stream.with_idle(Arc::clone(&activity), after),
                    Some(activity),
                )
            }
            None => (stream, None),
        }
    }

    /// Also closed once `activity` has had nothing in flight for `after`.
    pub fn with_idle(mut self, activity: Arc<Activity>, after: Duration) -> Self {
        self.idle = Some(Idle {
            activity,
            after,
            timer: Box::pin(tokio::time::sleep(after)),
            armed: false,
        });
        self
    }
}

impl Idle {
    /// Whether the connection has been idle for long enough; otherwise
    /// arms the timer for when it could be, so that the task is woken.
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        if self.armed && !self.timer.is_elapsed() {
            return false;
        }
        // The connection stays in the task that first polled it, so the
        // waker registered then is the one to wake.
        self.armed = true;
        while self.timer.as_mut().poll(cx).is_ready() {
            let now = tokio::time::Instant::now();
            match self.activity.idle_since() {
                Some(since) if now >= since + self.after => return true,
                Some(since) => self.timer.as_mut().reset(since + self.after),
                None => self.timer.as_mut().reset(now + self.after),
            }
        }
        false
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Deadlines<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                this.deadline = None;
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                let expired = this
                    .deadline
                    .as_mut()
                    .is_some_and(|deadline| deadline.as_mut().poll(cx).is_ready());
                if expired {
                    return Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "the client sent nothing within header_read_timeout",
                    )));
                }
                if this.idle.as_mut().is_some_and(|idle| idle.expired(cx)) {
                    return Poll::Ready(Err(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        "no request on the connection within idle_timeout",
                    )));
                }
                Poll::Pending
            }
            other => other,
        }
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Deadlines<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

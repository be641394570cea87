//! A connection's deadlines: its first bytes and its idleness
//! (`header_read_timeout`, `idle_timeout`), and the activity that tells
//! an idle connection from a busy one.
//!
//! A connection is idle while it has no request in flight, and stalled
//! while one of its answers waits for the client to take it (a client
//! that never reads, an HTTP/2 client whose window stays shut for that
//! stream, a socket that takes no byte). Each answer has its own
//! deadline: what else the connection does meanwhile (another stream's
//! body arriving, other answers going out) does not extend it. Either
//! way the connection's place under `max_connections`, and the in-flight
//! slots its answers hold, come free once `idle_timeout` passes.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use idem::metrics::CONNECTIONS_STALLED_TOTAL;
use tokio::time::Sleep;

/// A client connection's read deadlines.
///
/// * Its first bytes: before hyper knows the protocol (HTTP/1 or the
///   HTTP/2 preface) no header time-out of its own runs, so a socket that
///   sends nothing would hold its place under `max_connections` for ever.
/// * Idleness ([`with_idle`](Self::with_idle)): a connection with no
///   request in flight for `idle_timeout`, or with an answer that has
///   waited that long for the client, is closed. HTTP/1 keep-alive
///   connections are closed sooner by `header_read_timeout`; an HTTP/2
///   connection answering the gateway's pings, but sending nothing else
///   (or taking nothing of its answers), would otherwise stay open for
///   ever.
/// * Writing: a write the socket takes no byte of for `idle_timeout` (the
///   client reads nothing, and both sides' buffers are full) closes the
///   connection, whatever hyper is waiting for meanwhile.
#[derive(Debug)]
pub struct Deadlines<S> {
    inner: S,
    /// Until the first bytes arrive.
    deadline: Option<Pin<Box<Sleep>>>,
    idle: Option<Idle>,
    write: Option<WriteStall>,
}

/// Since when the socket has taken no byte of what the connection writes.
#[derive(Debug)]
struct WriteStall {
    after: Duration,
    timer: Pin<Box<Sleep>>,
    /// Whether a write is waiting (then the timer runs from its start).
    waiting: bool,
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
/// body is done), since when each answer waiting for the client has
/// waited, and when a request last ended.
#[derive(Debug)]
pub struct Activity {
    in_flight: AtomicUsize,
    /// For each answer in flight handed to the connection (its head, or a
    /// frame of its body) that it has not asked for more of yet: since
    /// when, in milliseconds since `opened`. A multiset: an answer that
    /// resumes takes out one entry of its own value, which leaves the
    /// oldest the same whichever equal entry goes.
    waiting: Mutex<Vec<u64>>,
    /// When a request last ended, in milliseconds since `opened`.
    last_change: AtomicU64,
    opened: tokio::time::Instant,
}

impl Activity {
    /// A connection with nothing in flight since now.
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            in_flight: AtomicUsize::new(0),
            waiting: Mutex::new(Vec::new()),
            last_change: AtomicU64::new(0),
            opened: tokio::time::Instant::now(),
        })
    }

    /// A request starts; it is in flight until the guard is dropped (put
    /// it in the answer's body).
    pub fn start(self: &Arc<Self>) -> Busy {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        Busy {
            activity: Arc::clone(self),
            waiting: None,
        }
    }

    /// When the connection counts as idle from: when its last request
    /// ended if none is in flight, else since its oldest answer has waited
    /// for the client; `None` while no answer waits.
    fn idle_since(&self) -> Option<tokio::time::Instant> {
        let since = if self.in_flight.load(Ordering::Acquire) == 0 {
            self.last_change.load(Ordering::Acquire)
        } else {
            self.waiting().iter().min().copied()?
        };
        Some(self.opened + Duration::from_millis(since))
    }

    fn waiting(&self) -> std::sync::MutexGuard<'_, Vec<u64>> {
        // The list stays whole whatever panicked while it was held: every
        // change to it is one push or one swap_remove.
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether requests are in flight (then an idle connection is one
    /// stalled on its client).
    fn busy(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) > 0
    }

    /// Milliseconds since the connection opened.
    fn now(&self) -> u64 {
        u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

/// One request in flight on a connection (see [`Activity::start`]).
#[derive(Debug)]
pub struct Busy {
    activity: Arc<Activity>,
    /// Since when its answer waits for the client, while it does.
    waiting: Option<u64>,
}

impl Busy {
    /// The answer waits for the client: the connection holds its head or
    /// a frame of its body and has not asked for more.
    fn wait_for_client(&mut self) {
        if self.waiting.is_none() {
            let now = self.activity.now();
            self.waiting = Some(now);
            self.activity.waiting().push(now);
        }
    }

    /// The connection asks for more of the answer.
    fn resume(&mut self) {
        if let Some(since) = self.waiting.take() {
            let mut waiting = self.activity.waiting();
            if let Some(at) = waiting.iter().position(|&s| s == since) {
                waiting.swap_remove(at);
            }
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.resume();
        // Marked before the count falls: a connection seen with nothing
        // in flight sees when that began.
        let now = self.activity.now();
        self.activity.last_change.store(now, Ordering::Release);
        self.activity.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

/// An answer's body that keeps its request [`Busy`] until it is done, and
/// tells its connection whether it waits for the client: from the moment
/// the answer is handed over, and after each frame, until the connection
/// asks for the next one (which hyper does only once the client has room
/// for it).
///
/// While tracked, its data goes out in pieces of at most [`PIECE`] bytes:
/// hyper asks for the next piece once the client has taken the last (on
/// HTTP/2, once its window let the piece through), so a client taking at
/// least a piece per `idle_timeout` is never idle, however large the
/// chunks the upstream sends.
#[derive(Debug)]
pub struct Tracked<B> {
    inner: B,
    busy: Option<Busy>,
    /// What is left of a chunk given out piece by piece.
    rest: Bytes,
}

/// The most an answer gives out at once while tracked: one HTTP/2 DATA
/// frame at the default `SETTINGS_MAX_FRAME_SIZE`. With the default
/// `idle_timeout` of 30 s, a client is cut only below about 0.5 KiB/s.
pub const PIECE: usize = 16 << 10;

impl<B> Tracked<B> {
    /// `inner`, busy until dropped.
    pub fn new(inner: B, mut busy: Option<Busy>) -> Self {
        if let Some(busy) = &mut busy {
            busy.wait_for_client();
        }
        Self {
            inner,
            busy,
            rest: Bytes::new(),
        }
    }
}

impl<B: Body<Data = Bytes> + Unpin> Body for Tracked<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        let Some(busy) = &mut this.busy else {
            return Pin::new(&mut this.inner).poll_frame(cx);
        };
        busy.resume();
        if !this.rest.is_empty() {
            let piece = this.rest.split_to(this.rest.len().min(PIECE));
            busy.wait_for_client();
            return Poll::Ready(Some(Ok(Frame::data(piece))));
        }
        let frame = match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(mut data) if data.len() > PIECE => {
                    this.rest = data.split_off(PIECE);
                    Frame::data(data)
                }
                Ok(data) => Frame::data(data),
                Err(other) => other,
            },
            end => return Poll::Ready(end),
        };
        // The last frame too: an HTTP/2 connection keeps the answer until
        // the client's window has let it all through.
        busy.wait_for_client();
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let inner = self.inner.size_hint();
        let rest = self.rest.len() as u64;
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower().saturating_add(rest));
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(rest));
        }
        hint
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
            write: None,
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

    /// Also closed once `activity` has had nothing in flight for `after`,
    /// or an answer that has waited that long for the client, or once a
    /// write has waited that long for the socket to take a byte.
    pub fn with_idle(mut self, activity: Arc<Activity>, after: Duration) -> Self {
        self.idle = Some(Idle {
            activity,
            after,
            timer: Box::pin(tokio::time::sleep(after)),
            armed: false,
        });
        self.write = Some(WriteStall {
            after,
            timer: Box::pin(tokio::time::sleep(after)),
            waiting: false,
        });
        self
    }

    /// `written`, or the stall's error once a write has waited too long.
    fn written<T>(
        &mut self,
        cx: &mut Context<'_>,
        written: Poll<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        let Some(stall) = &mut self.write else {
            return written;
        };
        match written {
            Poll::Pending => {
                if !stall.waiting {
                    stall.waiting = true;
                    let until = tokio::time::Instant::now() + stall.after;
                    stall.timer.as_mut().reset(until);
                }
                if stall.timer.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Err(stalled(
                        "the client took no byte of its answer within idle_timeout",
                    )));
                }
                Poll::Pending
            }
            done => {
                stall.waiting = false;
                done
            }
        }
    }
}

/// A connection closed because its client takes nothing of its answers:
/// counted, logged, and the error that ends it.
fn stalled(why: &'static str) -> std::io::Error {
    metrics::counter!(CONNECTIONS_STALLED_TOTAL.name).increment(1);
    tracing::debug!(reason = "client_stalled", "connection closed: {why}");
    std::io::Error::new(std::io::ErrorKind::TimedOut, why)
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
                if let Some(idle) = this.idle.as_mut()
                    && idle.expired(cx)
                {
                    if idle.activity.busy() {
                        return Poll::Ready(Err(stalled(
                            "the client took nothing of the answers in flight within idle_timeout",
                        )));
                    }
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
        let written = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.written(cx, written)
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
        let written = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.written(cx, written)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::{BodyExt, Full};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test(start_paused = true)]
    async fn each_answer_waiting_for_the_client_has_its_own_deadline() {
        let activity = Activity::new();
        assert!(activity.idle_since().is_some(), "nothing in flight");
        let busy = activity.start();
        assert!(activity.idle_since().is_none(), "a request runs");
        // Handed over: it waits for the connection to ask for its body.
        let two_pieces = Full::new(Bytes::from(vec![0u8; PIECE + 1]));
        let mut answer = Tracked::new(two_pieces, Some(busy));
        let since = activity.idle_since().expect("its answer waits");
        // Another request running meanwhile does not move its deadline.
        tokio::time::advance(Duration::from_secs(5)).await;
        let other = activity.start();
        assert_eq!(activity.idle_since(), Some(since), "another request runs");
        let mut other = Tracked::new(Full::new(Bytes::from_static(b"y")), Some(other));
        assert_eq!(activity.idle_since(), Some(since), "the oldest counts");
        while other.frame().await.is_some() {}
        drop(other);
        assert_eq!(activity.idle_since(), Some(since));
        // A piece taken: it waits again, from now, until asked for more.
        tokio::time::advance(Duration::from_secs(1)).await;
        let piece = answer.frame().await.expect("a frame").expect("data");
        assert_eq!(piece.into_data().expect("data").len(), PIECE);
        let again = since + Duration::from_secs(6);
        assert_eq!(activity.idle_since(), Some(again));
        // The last piece waits too, until the connection asks for the end.
        tokio::time::advance(Duration::from_secs(1)).await;
        let last = answer.frame().await.expect("a frame").expect("data");
        assert_eq!(last.into_data().expect("data").len(), 1);
        let last_since = again + Duration::from_secs(1);
        assert_eq!(activity.idle_since(), Some(last_since));
        assert!(answer.frame().await.is_none(), "the end");
        assert!(activity.idle_since().is_none(), "in flight, not waiting");
        drop(answer);
        assert!(!activity.busy());
        assert_eq!(
            activity.idle_since(),
            Some(last_since),
            "idle since it ended"
        );
    }

    #[tokio::test]
    async fn a_tracked_answer_goes_out_in_pieces_untracked_as_it_came() {
        let big = Bytes::from(vec![7u8; 2 * PIECE + 10]);
        let activity = Activity::new();
        let mut tracked = Tracked::new(Full::new(big.clone()), Some(activity.start()));
        assert_eq!(tracked.size_hint().exact(), Some(big.len() as u64));
        let mut sizes = Vec::new();
        while let Some(frame) = tracked.frame().await {
            sizes.push(frame.expect("data").into_data().expect("data").len());
        }
        assert_eq!(sizes, [PIECE, PIECE, 10]);
        assert!(tracked.is_end_stream());
        let mut untracked = Tracked::new(Full::new(big.clone()), None);
        let whole = untracked.frame().await.expect("frame").expect("data");
        assert_eq!(whole.into_data().expect("data").len(), big.len());
    }

    #[tokio::test]
    async fn a_write_the_client_takes_nothing_of_times_out_a_slow_one_does_not() {
        let (near, _far) = tokio::io::duplex(64);
        let (mut conn, _) = Deadlines::for_connection(near, None, Some(Duration::from_millis(200)));
        let err = conn
            .write_all(&[0; 1024])
            .await
            .expect_err("the client reads nothing");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);

        let (near, mut far) = tokio::io::duplex(64);
        let (mut conn, _) = Deadlines::for_connection(near, None, Some(Duration::from_secs(5)));
        let reader = tokio::spawn(async move {
            let mut got = 0;
            let mut buf = [0; 16];
            while got < 1024 {
                tokio::time::sleep(Duration::from_millis(5)).await;
                got += far.read(&mut buf).await.expect("read");
            }
            got
        });
        conn.write_all(&[0; 1024]).await.expect("taken bit by bit");
        assert_eq!(reader.await.expect("reader"), 1024);
    }

    /// Reads from `conn` until it fails, or for an hour of the paused
    /// clock: `None` when it was still open then.
    async fn read_error<S: tokio::io::AsyncRead + Unpin>(
        conn: &mut Deadlines<S>,
    ) -> Option<std::io::Error> {
        let mut buf = [0; 16];
        match tokio::time::timeout(Duration::from_secs(3600), conn.read(&mut buf)).await {
            Ok(Err(err)) => Some(err),
            Ok(Ok(n)) => panic!("read {n} bytes from a client that sent none"),
            Err(_still_open) => None,
        }
    }

    /// `with_idle(activity, after)`: the connection is closed once the
    /// activity it is given has had nothing in flight for `after`, or an
    /// answer that has waited that long for the client; a request in
    /// flight whose answer is not waiting keeps it open. Without it, only
    /// the first-bytes deadline applies.
    #[tokio::test(start_paused = true)]
    async fn with_idle_closes_a_connection_idle_or_stalled_on_its_activity() {
        let after = Duration::from_secs(30);
        let (near, _far) = tokio::io::duplex(64);
        let mut idle = Deadlines::new(near, None).with_idle(Activity::new(), after);
        let err = read_error(&mut idle).await.expect("closed when idle");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(err.to_string().contains("no request"), "{err}");

        let activity = Activity::new();
        let (near, _far) = tokio::io::duplex(64);
        let mut busy = Deadlines::new(near, None).with_idle(Arc::clone(&activity), after);
        let running = activity.start();
        assert!(read_error(&mut busy).await.is_none(), "a request runs");
        let _answer = Tracked::new(Full::new(Bytes::from_static(b"answer")), Some(running));
        let err = read_error(&mut busy).await.expect("closed when stalled");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);
        assert!(err.to_string().contains("took nothing"), "{err}");

        let (near, _far) = tokio::io::duplex(64);
        let mut stalled = Deadlines::new(near, None).with_idle(Activity::new(), after);
        let err = stalled
            .write_all(&[0; 1024])
            .await
            .expect_err("the client takes nothing");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut);

        let (near, _far) = tokio::io::duplex(64);
        let mut plain = Deadlines::new(near, None);
        assert!(read_error(&mut plain).await.is_none(), "no idle deadline");
        let write = plain.write_all(&[0; 1024]);
        assert!(
            tokio::time::timeout(Duration::from_secs(3600), write)
                .await
                .is_err(),
            "no write deadline"
        );
    }
}

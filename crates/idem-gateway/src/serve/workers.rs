//! Client connections served by a fixed set of threads, each running an
//! event loop of its own.
//!
//! The accept loop hands every new connection to the worker with the
//! fewest open connections. The connection stays on that thread for its
//! life: its socket is registered with that thread's poller, its timers
//! sit in that thread's timer wheel, and the tasks its requests spawn run
//! there too. A request therefore wakes no other thread unless it waits on
//! something that lives elsewhere (a store's connection, the SQLite writer).
//!
//! On a shared multi-threaded runtime every readiness event could land a
//! task on either worker and wake the other one to steal it: there the
//! kernel's wake-up path takes 15 % of a serving thread's samples
//! (docs/BENCHMARKS.md#current-figures).

use std::future::Future;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpStream;
use tokio::sync::mpsc;

use super::limits::ConnectionPlace;

/// Serves one client connection on the calling worker's event loop; the
/// connection is watched by that worker's graceful shutdown.
pub type ServeConnection = Arc<
    dyn Fn(TcpStream, SocketAddr, &GracefulShutdown) -> Pin<Box<dyn Future<Output = ()> + Send>>
        + Send
        + Sync,
>;

/// An accepted connection on its way to a worker.
struct Accepted {
    stream: std::net::TcpStream,
    peer: SocketAddr,
    /// The connection's place under `max_connections`, held until it closes.
    open: ConnectionPlace,
}

struct Worker {
    queue: mpsc::UnboundedSender<Accepted>,
    /// Connections handed to this worker and not yet closed.
    load: Arc<AtomicUsize>,
    /// Ends with whether every connection closed within the grace period.
    thread: JoinHandle<bool>,
}

/// One connection counted in its worker's load until it is dropped.
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Shuts `graceful`'s connections down, giving them up to `grace`; true
/// when every one closed in time.
pub async fn close_within(graceful: GracefulShutdown, grace: Duration) -> bool {
    tokio::select! {
        () = graceful.shutdown() => true,
        () = tokio::time::sleep(grace) => false,
    }
}

/// The serving threads.
pub struct Workers {
    workers: Vec<Worker>,
    /// With no serving threads: connections run on the caller's runtime,
    /// watched here.
    shared: Option<Shared>,
}

/// Serving on the caller's runtime (`workers = 0`).
struct Shared {
    serve: ServeConnection,
    graceful: GracefulShutdown,
    grace: Duration,
}

impl std::fmt::Debug for Workers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workers")
            .field("threads", &self.workers.len())
            .finish()
    }
}

impl Workers {
    /// Starts `threads` workers. Zero starts none: connections are then
    /// served as tasks of the caller's runtime, beside whatever else runs
    /// there (a store's connection tasks, for one). Once told to stop,
    /// open connections get up to `grace` to finish.
    pub fn start(threads: usize, serve: ServeConnection, grace: Duration) -> std::io::Result<Self> {
        if threads == 0 {
            return Ok(Self {
                workers: Vec::new(),
                shared: Some(Shared {
                    serve,
                    graceful: GracefulShutdown::new(),
                    grace,
                }),
            });
        }
        let workers = (0..threads)
            .map(|i| Worker::start(i, Arc::clone(&serve), grace))
            .collect::<std::io::Result<_>>()?;
        Ok(Self {
            workers,
            shared: None,
        })
    }

    /// Hands an accepted connection to the least loaded worker (or, with
    /// none, to a task of the caller's runtime).
    pub fn dispatch(&self, stream: TcpStream, peer: SocketAddr, open: ConnectionPlace) {
        if let Some(shared) = &self.shared {
            let conn = (shared.serve)(stream, peer, &shared.graceful);
            tokio::spawn(async move {
                conn.await;
                drop(open);
            });
            return;
        }
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(err) => {
                tracing::warn!(%err, %peer, "could not hand the connection to a worker");
                return;
            }
        };
        let worker = self
            .workers
            .iter()
            .min_by_key(|w| w.load.load(Ordering::Relaxed))
            .expect("without a shared runtime there is at least one worker");
        worker.load.fetch_add(1, Ordering::Relaxed);
        if worker.queue.send(Accepted { stream, peer, open }).is_err() {
            // Only after a worker's thread died; the connection closes, and
            // the thread's load stays too high for it to be picked again.
            worker.load.store(usize::MAX / 2, Ordering::Relaxed);
            tracing::error!(%peer, "a serving thread is gone; connection closed");
        }
    }

    /// Stops handing out connections and waits until every worker has
    /// finished its connections or given up on them after the grace
    /// period. True when every connection closed in time.
    pub async fn stop(self) -> bool {
        if let Some(shared) = self.shared {
            return close_within(shared.graceful, shared.grace).await;
        }
        // Closing the queues tells the workers to stop; all stop at once.
        let threads: Vec<_> = self.workers.into_iter().map(|w| w.thread).collect();
        tokio::task::spawn_blocking(move || {
            // Every thread is joined, whatever the others answer.
            let mut all_closed = true;
            for thread in threads {
                all_closed &= thread.join().unwrap_or(false);
            }
            all_closed
        })
        .await
        .unwrap_or(false)
    }
}

impl Worker {
    fn start(index: usize, serve: ServeConnection, grace: Duration) -> std::io::Result<Self> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let (queue, accepted) = mpsc::unbounded_channel::<Accepted>();
        let load = Arc::new(AtomicUsize::new(0));
        let thread_load = Arc::clone(&load);
        let thread = std::thread::Builder::new()
            .name(format!("idem-serve-{index}"))
            // Dropping the runtime at the thread's end ends whatever
            // outlived the grace period.
            .spawn(move || {
                // This thread runs this one runtime: stores open
                // connections of its own here (idem::store::local).
                idem::store::local::dedicate_current_thread();
                runtime.block_on(serve_queue(accepted, serve, thread_load, grace))
            })?;
        Ok(Self {
            queue,
            load,
            thread,
        })
    }
}

/// A worker's event loop: serves the connections handed to it until the
/// queue closes, then gives them up to `grace` to finish.
async fn serve_queue(
    mut accepted: mpsc::UnboundedReceiver<Accepted>,
    serve: ServeConnection,
    load: Arc<AtomicUsize>,
    grace: Duration,
) -> bool {
    let graceful = GracefulShutdown::new();
    let armed = tokio::spawn(keep_a_timer_armed());
    while let Some(Accepted { stream, peer, open }) = accepted.recv().await {
        // Counted since dispatch; uncounted when this scope lets go of it.
        let counted = Counted(Arc::clone(&load));
        let stream = match TcpStream::from_std(stream) {
            Ok(stream) => stream,
            Err(err) => {
                tracing::warn!(%err, %peer, "could not serve the connection");
                continue;
            }
        };
        // A panic while setting a connection up costs that connection,
        // not the thread and its others.
        let Ok(conn) =
            std::panic::catch_unwind(AssertUnwindSafe(|| serve(stream, peer, &graceful)))
        else {
            tracing::error!(%peer, "setting up the connection panicked; it is closed");
            continue;
        };
        tokio::spawn(async move {
            conn.await;
            drop(open);
            drop(counted);
        });
    }
    armed.abort();
    close_within(graceful, grace).await
}

/// How often [`keep_a_timer_armed`]'s timer fires: shorter than any time-out
/// a request arms by default (header read 10 s, upstream 30 s, a 30 s
/// lease's renewal 10 s).
const ARMED_EVERY: Duration = Duration::from_secs(1);

/// Keeps one timer armed on this thread's timer wheel, so that arming a
/// request's own timers does not wake the thread's poller.
///
/// Tokio wakes a runtime's poller (an `eventfd` write) whenever a timer is
/// armed earlier than the one the runtime last went to sleep for, even from
/// the runtime's own thread, which is awake. A serving thread with nothing
/// armed slept for no timer at all, so on a lone keep-alive connection
/// every request's header-read timer cost that write: 7.0 system calls
/// per pass-through request instead of 6.0 (`strace -c`, one connection).
/// With this timer due within a second, a time-out of a second or more
/// never comes first. It fires once a second on an idle thread.
async fn keep_a_timer_armed() {
    let mut every = tokio::time::interval(ARMED_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::Full;
    use hyper::body::Bytes;
    use hyper::server::conn::http1;
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;
    use tokio::sync::{Notify, Semaphore};

    const REQUEST: &[u8] = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n";

    /// Answers every request with the name of the thread that served it,
    /// after `delay`.
    fn thread_names(delay: Duration) -> ServeConnection {
        noting_arrivals(delay, Arc::new(Notify::new()))
    }

    /// [`thread_names`], and `arrived` is notified as each request comes in.
    fn noting_arrivals(delay: Duration, arrived: Arc<Notify>) -> ServeConnection {
        Arc::new(move |stream, _peer, graceful| {
            let arrived = Arc::clone(&arrived);
            let svc = service_fn(move |_req| {
                arrived.notify_one();
                async move {
                    tokio::time::sleep(delay).await;
                    let name = std::thread::current().name().unwrap_or("?").to_owned();
                    Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(Bytes::from(
                        name,
                    ))))
                }
            });
            let conn = http1::Builder::new().serve_connection(TokioIo::new(stream), svc);
            let conn = graceful.watch(conn);
            Box::pin(async move {
                let _ = conn.await;
            })
        })
    }

    /// Accepts `n` connections and dispatches them; returns the clients.
    async fn connect(workers: &Workers, n: usize) -> Vec<TcpStream> {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let open = Arc::new(Semaphore::new(n));
        let mut clients = Vec::new();
        for _ in 0..n {
            let client = TcpStream::connect(addr).await.expect("connect");
            let (stream, peer) = listener.accept().await.expect("accept");
            let permit = Arc::clone(&open).acquire_owned().await.expect("permit");
            let place = ConnectionPlace::new(permit, crate::serve::limits::PeerPlace::uncapped());
            workers.dispatch(stream, peer, place);
            clients.push(client);
        }
        clients
    }

    /// Sends one request and returns the answer's body (the whole
    /// response, read until the body's known length).
    async fn ask(client: &mut TcpStream) -> String {
        client.write_all(REQUEST).await.expect("write");
        let mut buf = vec![0; 1024];
        let mut got = 0;
        loop {
            let n = client.read(&mut buf[got..]).await.expect("read");
            assert!(n > 0, "connection closed before the answer");
            got += n;
            let text = String::from_utf8_lossy(&buf[..got]).into_owned();
            if let Some(body) = text.split("\r\n\r\n").nth(1)
                && body.starts_with("idem-serve-")
                && body.len() == "idem-serve-0".len()
            {
                return body.to_owned();
            }
        }
    }

    #[tokio::test]
    async fn connections_go_to_the_least_loaded_worker_and_stay_there() {
        let workers =
            Workers::start(2, thread_names(Duration::ZERO), Duration::from_secs(5)).expect("start");
        let mut clients = connect(&workers, 4).await;
        let mut served = Vec::new();
        for client in &mut clients {
            served.push(ask(client).await);
        }
        assert_eq!(
            served,
            [
                "idem-serve-0",
                "idem-serve-1",
                "idem-serve-0",
                "idem-serve-1"
            ]
        );
        // A keep-alive connection is served by the same thread again.
        assert_eq!(ask(&mut clients[1]).await, "idem-serve-1");

        // Two connections on worker 0 close; the next one goes there.
        drop(clients.remove(2));
        drop(clients.remove(0));
        for _ in 0..100 {
            if workers.workers[0].load.load(Ordering::Relaxed) == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut late = connect(&workers, 1).await;
        assert_eq!(ask(&mut late[0]).await, "idem-serve-0");
        assert!(workers.stop().await, "idle connections close at once");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn with_no_workers_connections_run_on_the_callers_runtime() {
        let workers =
            Workers::start(0, thread_names(Duration::ZERO), Duration::from_secs(5)).expect("start");
        let mut clients = connect(&workers, 2).await;
        for client in &mut clients {
            client.write_all(REQUEST).await.expect("write");
            let mut buf = vec![0; 1024];
            let n = client.read(&mut buf).await.expect("read");
            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
            assert!(text.starts_with("HTTP/1.1 200"), "{text}");
            assert!(
                text.contains("tokio-rt"),
                "served by a runtime worker: {text}"
            );
        }
        assert!(workers.stop().await, "idle connections close at once");
    }

    #[tokio::test]
    async fn a_panic_while_setting_up_a_connection_costs_only_that_connection() {
        let calls = Arc::new(AtomicUsize::new(0));
        let inner = thread_names(Duration::ZERO);
        let counted = Arc::clone(&calls);
        let serve: ServeConnection = Arc::new(move |stream, peer, graceful| {
            assert!(
                counted.fetch_add(1, Ordering::SeqCst) != 0,
                "the first connection's set-up fails"
            );
            inner(stream, peer, graceful)
        });
        let workers = Workers::start(1, serve, Duration::from_secs(5)).expect("start");
        let mut clients = connect(&workers, 2).await;
        // The first connection is closed without an answer.
        let mut buf = [0; 64];
        let _ = clients[0].write_all(REQUEST).await;
        let n = clients[0].read(&mut buf).await.unwrap_or(0);
        assert_eq!(n, 0, "the failed connection was closed");
        // The same thread still serves the next one.
        assert_eq!(ask(&mut clients[1]).await, "idem-serve-0");
        assert_eq!(workers.workers[0].load.load(Ordering::Relaxed), 1);
        assert!(workers.stop().await);
    }

    /// One worker whose requests take `delay`, stopping within `grace`,
    /// with one request sent and in flight.
    async fn one_request_in_flight(delay: Duration, grace: Duration) -> (Workers, TcpStream) {
        let arrived = Arc::new(Notify::new());
        let workers =
            Workers::start(1, noting_arrivals(delay, Arc::clone(&arrived)), grace).expect("start");
        let mut client = connect(&workers, 1).await.remove(0);
        client.write_all(REQUEST).await.expect("write");
        // In flight once the service has it (a connection still reading
        // its request is idle to a graceful stop, and closed at once).
        tokio::time::timeout(Duration::from_secs(30), arrived.notified())
            .await
            .expect("the request reached the service");
        (workers, client)
    }

    #[tokio::test]
    async fn stop_waits_for_requests_in_flight_up_to_the_grace_period() {
        // A request that outlives the grace period: stop gives up on it
        // (had it waited, the request would have finished).
        let (workers, _client) =
            one_request_in_flight(Duration::from_secs(30), Duration::from_millis(200)).await;
        assert!(!workers.stop().await, "the slow request was not finished");

        // A request shorter than the grace period is answered in full.
        let (workers, mut client) =
            one_request_in_flight(Duration::from_millis(300), Duration::from_secs(10)).await;
        let answer = tokio::spawn(async move {
            let mut buf = Vec::new();
            let _ = client.read_to_end(&mut buf).await;
            String::from_utf8_lossy(&buf).into_owned()
        });
        assert!(
            workers.stop().await,
            "the request finished within the grace period"
        );
        let answer = answer.await.expect("reader");
        assert!(answer.ends_with("idem-serve-0"), "{answer}");
    }
}

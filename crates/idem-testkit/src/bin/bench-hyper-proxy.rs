//! The floor of an HTTP/1.1 reverse proxy built on hyper, for benchmarks:
//! what forwarding a request costs with hyper's server and client and
//! nothing else. `bench/run` measures it beside nginx and `idem`'s
//! pass-through, so the gateway's own cost over hyper can be told from
//! hyper's cost over nginx.
//!
//! It does the least a keep-alive proxy can: no routing, no limits, no
//! time-outs, no header rewriting beyond the request target, no HTTP/2
//! detection, and the upstream's (small) answer read whole before it is
//! sent on. The thread model is the gateway's: one event loop per core,
//! each with its own listener (`SO_REUSEPORT`) and its own idle upstream
//! connections, each driven by the request that uses it (no connection
//! task, no hand-off between tasks). Nothing here is fit to run in front
//! of real clients.
//!
//! Usage: `bench-hyper-proxy LISTEN UPSTREAM` (both `host:port`); threads:
//! `BENCH_PROXY_THREADS` (default: the machine's cores). Prints
//! `listening on ADDR` once ready.

use std::cell::RefCell;
use std::convert::Infallible;
use std::future::{Future, poll_fn};
use std::net::SocketAddr;
use std::pin::pin;
use std::rc::Rc;
use std::task::Poll;

use bytes::Bytes;
use http::{Request, Response, StatusCode, Uri, uri::PathAndQuery};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1 as client;
use hyper::server::conn::http1 as server;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpSocket, TcpStream};

/// The same allocator as the gateway's binary, so that it is not what
/// differs.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

type Failure = Box<dyn std::error::Error + Send + Sync>;

/// One upstream connection: the request sender and the connection that
/// the request's own task drives.
struct Upstream {
    sender: client::SendRequest<Incoming>,
    conn: client::Connection<TokioIo<TcpStream>, Incoming>,
}

/// A thread's idle upstream connections.
struct Pool {
    upstream: SocketAddr,
    idle: RefCell<Vec<Upstream>>,
}

impl Pool {
    async fn take(&self) -> Result<Upstream, Failure> {
        if let Some(up) = self.idle.borrow_mut().pop() {
            return Ok(up);
        }
        let stream = TcpStream::connect(self.upstream).await?;
        stream.set_nodelay(true)?;
        let (sender, conn) = client::handshake(TokioIo::new(stream)).await?;
        Ok(Upstream { sender, conn })
    }
}

/// Polls `work` to its end while driving `conn`; a connection that ends
/// first fails the work.
async fn driving<T, E>(
    conn: &mut client::Connection<TokioIo<TcpStream>, Incoming>,
    work: impl Future<Output = Result<T, E>>,
) -> Result<T, Failure>
where
    E: Into<Failure>,
{
    let mut work = pin!(work);
    poll_fn(|cx| {
        if let Poll::Ready(done) = work.as_mut().poll(cx) {
            return Poll::Ready(done.map_err(Into::into));
        }
        match conn.poll_without_shutdown(cx) {
            Poll::Ready(Ok(())) => Poll::Ready(Err("upstream connection closed".into())),
            Poll::Ready(Err(err)) => Poll::Ready(Err(err.into())),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

async fn forward(pool: &Pool, req: Request<Incoming>) -> Result<Response<Full<Bytes>>, Failure> {
    let (mut parts, body) = req.into_parts();
    let target = parts
        .uri
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    parts.uri = Uri::from(target);
    let mut up = pool.take().await?;
    let sent = up.sender.send_request(Request::from_parts(parts, body));
    let resp = driving(&mut up.conn, sent).await?;
    let (parts, body) = resp.into_parts();
    let bytes = driving(&mut up.conn, body.collect()).await?.to_bytes();
    pool.idle.borrow_mut().push(up);
    Ok(Response::from_parts(parts, Full::new(bytes)))
}

async fn answer(
    pool: Rc<Pool>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    Ok(forward(&pool, req).await.unwrap_or_else(|_| {
        let mut resp = Response::new(Full::new(Bytes::new()));
        *resp.status_mut() = StatusCode::BAD_GATEWAY;
        resp
    }))
}

/// This thread's listener on `listen`, beside the other threads' ones.
fn bind(listen: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseport(true)?;
    socket.set_reuseaddr(true)?;
    socket.bind(listen)?;
    socket.listen(1024)
}

/// Binds, tells `ready` how that went, then serves.
async fn serve(
    listen: SocketAddr,
    upstream: SocketAddr,
    ready: std::sync::mpsc::Sender<Result<(), String>>,
) -> std::io::Result<()> {
    let bound = bind(listen);
    let _ = ready.send(bound.as_ref().map(|_| ()).map_err(ToString::to_string));
    let listener = bound?;
    let pool = Rc::new(Pool {
        upstream,
        idle: RefCell::new(Vec::new()),
    });
    loop {
        let (stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let pool = Rc::clone(&pool);
        tokio::task::spawn_local(async move {
            let svc = service_fn(move |req| answer(Rc::clone(&pool), req));
            let _ = server::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn main() -> Result<(), Failure> {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(upstream)) = (args.next(), args.next()) else {
        return Err("usage: bench-hyper-proxy LISTEN UPSTREAM".into());
    };
    let listen: SocketAddr = listen.parse()?;
    let upstream: SocketAddr = upstream.parse()?;
    let threads = match std::env::var("BENCH_PROXY_THREADS") {
        Ok(n) => n.parse()?,
        Err(_) => std::thread::available_parallelism()?.get(),
    };
    let (ready, bound) = std::sync::mpsc::channel();
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let ready = ready.clone();
            std::thread::spawn(move || -> std::io::Result<()> {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                tokio::task::LocalSet::new().block_on(&runtime, serve(listen, upstream, ready))
            })
        })
        .collect();
    drop(ready);
    for result in bound.iter().take(threads) {
        result.map_err(|err| format!("cannot listen on {listen}: {err}"))?;
    }
    println!("listening on {listen}");
    for worker in workers {
        worker.join().map_err(|_| "a serving thread panicked")??;
    }
    Ok(())
}

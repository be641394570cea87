//! A fault-injecting TCP proxy: put it between a client and a real server
//! (the gateway and PostgreSQL, the gateway and its upstream, a relay and
//! its broker) and make the line misbehave on demand, without touching a
//! server other tests share:
//!
//! * [`cut`](FaultProxy::cut): close every connection, refuse new ones (the
//!   server went away);
//! * [`blackhole`](FaultProxy::blackhole): keep connections open but let
//!   nothing through in either direction, and accept new ones the same way
//!   (a partition, a half-open connection whose peer vanished);
//! * [`reset_all`](FaultProxy::reset_all) and
//!   [`reset_responses_after`](FaultProxy::reset_responses_after): abort
//!   connections with a TCP reset, at once or after so many bytes of answer;
//! * [`set_latency`](FaultProxy::set_latency) and
//!   [`set_bandwidth`](FaultProxy::set_bandwidth): delay every chunk, with
//!   jitter, and cap the rate.
//!
//! [`restore`](FaultProxy::restore) clears every fault. Connections that
//! were black-holed are reset then: bytes were lost on them, so their
//! protocol state is garbage, as after a real partition heals.
//!
//! [`quiet_for`](FaultProxy::quiet_for) waits until nothing has crossed the
//! line for a while, so that a fault set next meets no exchange already
//! under way (a connection pool's check on a connection it took back, say).
//! [`chunks_to_server`](FaultProxy::chunks_to_server) counts what clients
//! sent, in the pieces they sent it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// The faults in force; read by every link for every chunk.
#[derive(Debug, Clone, Copy, Default)]
struct LinkFaults {
    cut: bool,
    blackhole: bool,
    latency: Duration,
    jitter: Duration,
    bytes_per_sec: Option<u64>,
    reset_after: Option<u64>,
}

/// How open links are ended on demand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Keep going.
    Live,
    /// Close (FIN), as a server that shut down.
    Close,
    /// Abort (RST).
    Reset,
}

#[derive(Debug)]
struct State {
    faults: Mutex<LinkFaults>,
    /// Bumped (with how) to end every link open at that moment.
    end: watch::Sender<(u64, End)>,
    seed: AtomicU64,
    /// When the proxy started: the origin of `last_traffic`.
    started: Instant,
    /// Nanoseconds from `started` to the last chunk read or written.
    last_traffic: AtomicU64,
    /// Chunks read and not yet written on (or dropped).
    held: AtomicU64,
    /// Chunks read from clients, toward the server.
    to_server: AtomicU64,
}

impl State {
    fn faults(&self) -> LinkFaults {
        *self.faults.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn update(&self, f: impl FnOnce(&mut LinkFaults)) -> LinkFaults {
        let mut faults = self.faults.lock().unwrap_or_else(|p| p.into_inner());
        let before = *faults;
        f(&mut faults);
        before
    }

    fn traffic(&self) {
        let nanos = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.last_traffic.fetch_max(nanos, Ordering::Relaxed);
    }

    /// Counts a chunk as on the line until the returned guard drops.
    fn hold(&self) -> Held<'_> {
        self.traffic();
        self.held.fetch_add(1, Ordering::Relaxed);
        Held(self)
    }

    fn end_links(&self, how: End) {
        self.end.send_modify(|(generation, end)| {
            *generation += 1;
            *end = how;
        });
    }

    /// A pseudo-random duration in `0..=max` (xorshift; tests need spread,
    /// not quality).
    fn jitter(&self, max: Duration) -> Duration {
        if max.is_zero() {
            return Duration::ZERO;
        }
        let mut x = self.seed.load(Ordering::Relaxed);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.seed.store(x, Ordering::Relaxed);
        let nanos = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
        Duration::from_nanos(x % nanos.saturating_add(1))
    }
}

/// A chunk read from one side and not yet passed to the other.
struct Held<'a>(&'a State);

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.0.held.fetch_sub(1, Ordering::Relaxed);
        self.0.traffic();
    }
}

/// A running fault proxy; it stops with the test's runtime.
#[derive(Debug, Clone)]
pub struct FaultProxy {
    addr: SocketAddr,
    state: Arc<State>,
}

impl FaultProxy {
    /// Starts on `127.0.0.1:0`, forwarding every connection to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("local addr");
        let (end, _) = watch::channel((0, End::Live));
        let state = Arc::new(State {
            faults: Mutex::new(LinkFaults::default()),
            end,
            seed: AtomicU64::new(0x9E37_79B9_7F4A_7C15 ^ u64::from(addr.port())),
            started: Instant::now(),
            last_traffic: AtomicU64::new(0),
            held: AtomicU64::new(0),
            to_server: AtomicU64::new(0),
        });
        let shared = Arc::clone(&state);
        tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                if shared.faults().cut {
                    drop(client);
                    continue;
                }
                tokio::spawn(link(client, target, Arc::clone(&shared)));
            }
        });
        Self { addr, state }
    }

    /// Where clients connect instead of the server.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every open connection and refuses new ones.
    pub fn cut(&self) {
        self.state.update(|f| f.cut = true);
        self.state.end_links(End::Close);
    }

    /// Lets nothing through on open connections, and accepts new ones that
    /// go nowhere: peers see silence, not an error, until their own
    /// time-outs fire.
    pub fn blackhole(&self) {
        self.state.update(|f| f.blackhole = true);
    }

    /// Aborts every open connection with a TCP reset (new ones are fine).
    pub fn reset_all(&self) {
        self.state.end_links(End::Reset);
    }

    /// From now on, a connection is reset once `bytes` bytes of answer
    /// (server to client) have passed on it: a response that breaks off
    /// part-way. `None` turns it off.
    pub fn reset_responses_after(&self, bytes: Option<u64>) {
        self.state.update(|f| f.reset_after = bytes);
    }

    /// Delays every chunk, in both directions, by `latency` plus up to
    /// `jitter` more.
    pub fn set_latency(&self, latency: Duration, jitter: Duration) {
        self.state.update(|f| {
            f.latency = latency;
            f.jitter = jitter;
        });
    }

    /// Caps each direction of each connection at `bytes_per_sec` (`None`:
    /// no cap).
    pub fn set_bandwidth(&self, bytes_per_sec: Option<u64>) {
        self.state.update(|f| f.bytes_per_sec = bytes_per_sec);
    }

    /// Returns once no byte has crossed the proxy, either way, for `quiet`,
    /// and none is held back by a delay.
    ///
    /// An exchange the client started before a fault is set can still be
    /// under way when the fault takes effect, and then takes the fault's
    /// time: sqlx, for one, checks every connection it takes back into its
    /// pool with a round trip that outlives the request that used it.
    pub async fn quiet_for(&self, quiet: Duration) {
        loop {
            let last = Duration::from_nanos(self.state.last_traffic.load(Ordering::Relaxed));
            let idle = self.state.started.elapsed().saturating_sub(last);
            if self.state.held.load(Ordering::Relaxed) > 0 {
                tokio::time::sleep(quiet).await;
                continue;
            }
            if idle >= quiet {
                return;
            }
            tokio::time::sleep(quiet - idle).await;
        }
    }

    /// How many chunks clients have sent toward the server so far, each
    /// read as it arrived. A client that writes each request whole and
    /// waits for its answer before the next (a database driver) sends one
    /// chunk a request: this counts its round trips.
    pub fn chunks_to_server(&self) -> u64 {
        self.state.to_server.load(Ordering::Relaxed)
    }

    /// Clears every fault. Connections black-holed until now are reset.
    pub fn restore(&self) {
        let before = self.state.update(|f| *f = LinkFaults::default());
        if before.blackhole {
            self.state.end_links(End::Reset);
        }
    }
}

/// Which way a chunk goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    ToServer,
    ToClient,
}

/// A pump decided to reset the connection.
struct ResetNow;

async fn link(mut client: TcpStream, target: SocketAddr, state: Arc<State>) {
    let mut end = state.end.subscribe();
    end.mark_unchanged();
    let mut server = if state.faults().blackhole {
        // Nothing behind it: hold the client until the hole closes.
        None
    } else {
        match TcpStream::connect(target).await {
            Ok(s) => Some(s),
            Err(_) => return,
        }
    };
    let _ = client.set_nodelay(true);
    let how = {
        let (cr, cw) = client.split();
        let pumps = async {
            match server.as_mut() {
                Some(server) => {
                    let _ = server.set_nodelay(true);
                    let (sr, sw) = server.split();
                    match tokio::try_join!(
                        pump(cr, sw, Dir::ToServer, &state),
                        pump(sr, cw, Dir::ToClient, &state)
                    ) {
                        Ok(_) => End::Close,
                        Err(ResetNow) => End::Reset,
                    }
                }
                None => {
                    let mut cr = cr;
                    let mut sink = [0u8; 4096];
                    while matches!(cr.read(&mut sink).await, Ok(n) if n > 0) {}
                    End::Close
                }
            }
        };
        tokio::select! {
            how = pumps => how,
            how = async {
                loop {
                    if end.changed().await.is_err() {
                        return std::future::pending().await;
                    }
                    let how = end.borrow_and_update().1;
                    if how != End::Live {
                        return how;
                    }
                }
            } => how,
        }
    };
    if how == End::Reset {
        // A zero linger turns the close below into a reset.
        let _ = client.set_zero_linger();
        if let Some(server) = &server {
            let _ = server.set_zero_linger();
        }
    }
}

/// Copies one direction with the faults in force; at end of stream passes
/// the half-close on.
async fn pump(
    mut from: ReadHalf<'_>,
    mut to: WriteHalf<'_>,
    dir: Dir,
    state: &State,
) -> Result<(), ResetNow> {
    let mut buf = vec![0u8; 16 << 10];
    let mut passed: u64 = 0;
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => {
                let _ = to.shutdown().await;
                return Ok(());
            }
            Ok(n) => n,
        };
        let _held = state.hold();
        if dir == Dir::ToServer {
            state.to_server.fetch_add(1, Ordering::Relaxed);
        }
        let faults = state.faults();
        if faults.blackhole {
            continue;
        }
        let delay = faults.latency + state.jitter(faults.jitter);
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let mut chunk = &buf[..n];
        let mut reset = false;
        if dir == Dir::ToClient
            && let Some(limit) = faults.reset_after
        {
            let room = limit.saturating_sub(passed);
            if (n as u64) >= room {
                chunk = &chunk[..usize::try_from(room).unwrap_or(n)];
                reset = true;
            }
        }
        // A chunk arrives once the capped line has carried all of it.
        if let Some(rate) = faults.bytes_per_sec.filter(|r| *r > 0) {
            tokio::time::sleep(Duration::from_secs_f64(chunk.len() as f64 / rate as f64)).await;
        }
        if to.write_all(chunk).await.is_err() {
            return Ok(());
        }
        passed += chunk.len() as u64;
        if reset {
            return Err(ResetNow);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    /// An echo server on loopback.
    async fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = conn.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn round_trip(conn: &mut TcpStream, msg: &[u8]) -> std::io::Result<Vec<u8>> {
        conn.write_all(msg).await?;
        let mut out = vec![0u8; msg.len()];
        conn.read_exact(&mut out).await?;
        Ok(out)
    }

    #[tokio::test]
    async fn passes_bytes_through_then_cuts_and_restores() {
        let proxy = FaultProxy::start(echo().await).await;
        let mut conn = TcpStream::connect(proxy.addr()).await.expect("connect");
        assert_eq!(
            round_trip(&mut conn, b"hello").await.expect("echo"),
            b"hello"
        );
        proxy.cut();
        let mut rest = Vec::new();
        let n = conn.read_to_end(&mut rest).await.unwrap_or(0);
        assert_eq!(n, 0, "closed by the cut");
        proxy.restore();
        let mut conn = TcpStream::connect(proxy.addr()).await.expect("connect");
        assert_eq!(
            round_trip(&mut conn, b"again").await.expect("echo"),
            b"again"
        );
    }

    #[tokio::test]
    async fn latency_delays_each_chunk_and_bandwidth_caps_the_rate() {
        let proxy = FaultProxy::start(echo().await).await;
        let mut conn = TcpStream::connect(proxy.addr()).await.expect("connect");
        proxy.set_latency(Duration::from_millis(100), Duration::from_millis(50));
        let started = Instant::now();
        round_trip(&mut conn, b"x").await.expect("echo");
        // Once each way.
        assert!(started.elapsed() >= Duration::from_millis(200));
        proxy.restore();
        proxy.set_bandwidth(Some(64 << 10));
        let started = Instant::now();
        round_trip(&mut conn, &vec![7u8; 32 << 10])
            .await
            .expect("echo");
        // 32 KiB at 64 KiB/s, each way.
        assert!(started.elapsed() >= Duration::from_millis(500));
    }

    #[tokio::test]
    async fn quiet_for_waits_out_a_chunk_still_on_the_line() {
        let proxy = FaultProxy::start(echo().await).await;
        let mut conn = TcpStream::connect(proxy.addr()).await.expect("connect");
        proxy.set_latency(Duration::from_millis(300), Duration::ZERO);
        conn.write_all(b"late").await.expect("write");
        // Read at once, held 300 ms, then echoed and held 300 ms more: the
        // line is not quiet until the echo has been written back.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let started = Instant::now();
        proxy.quiet_for(Duration::from_millis(100)).await;
        assert!(started.elapsed() >= Duration::from_millis(500));
        let mut buf = [0u8; 4];
        conn.read_exact(&mut buf).await.expect("echo arrived");
        assert_eq!(&buf, b"late");
    }

    #[tokio::test]
    async fn a_reset_is_a_connection_reset_not_an_end_of_stream() {
        let proxy = FaultProxy::start(echo().await).await;
        let mut conn = TcpStream::connect(proxy.addr()).await.expect("connect");
        round_trip(&mut conn, b"ok").await.expect("echo");
        proxy.reset_all();
        let mut buf = [0u8; 8];
        let err = conn.read(&mut buf).await.expect_err("reset");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset);
    }

    #[tokio::test]
    async fn an_answer_breaks_off_after_the_set_bytes() {
        let proxy = FaultProxy::start(echo().await).await;
        proxy.reset_responses_after(Some(10));
        let mut conn = TcpStream::connect(proxy.addr()).await.expect("connect");
        conn.write_all(&[1u8; 64]).await.expect("write");
        let mut got = Vec::new();
        let mut buf = [0u8; 64];
        let err = loop {
            match conn.read(&mut buf).await {
                Ok(0) => panic!("clean end of stream after {} bytes", got.len()),
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(e) => break e,
            }
        };
        assert_eq!(got.len(), 10);
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset);
    }

    #[tokio::test]
    async fn a_black_hole_is_silence_and_its_end_resets_the_held_connections() {
        let proxy = FaultProxy::start(echo().await).await;
        let mut old = TcpStream::connect(proxy.addr()).await.expect("connect");
        round_trip(&mut old, b"ok").await.expect("echo");
        proxy.blackhole();
        let silent =
            tokio::time::timeout(Duration::from_millis(300), round_trip(&mut old, b"lost"));
        assert!(silent.await.is_err(), "no answer through the hole");
        // New connections are taken, and go nowhere either.
        let mut new = TcpStream::connect(proxy.addr()).await.expect("accepted");
        let silent =
            tokio::time::timeout(Duration::from_millis(300), round_trip(&mut new, b"lost"));
        assert!(silent.await.is_err(), "no answer for a new connection");
        proxy.restore();
        let mut buf = [0u8; 8];
        let err = old.read(&mut buf).await.expect_err("reset at restore");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionReset);
        let mut fresh = TcpStream::connect(proxy.addr()).await.expect("connect");
        assert_eq!(
            round_trip(&mut fresh, b"back").await.expect("echo"),
            b"back"
        );
    }
}

//! Private servers a test may crash and restart: a `redis-server`, a
//! Redis Cluster, a PostgreSQL cluster, a Kafka-protocol broker (Tansu)
//! and a NATS server of the test's own, on free loopback ports, from the machine's binaries.
//! The shared loopback services stay untouched for the tests running
//! beside it.
//!
//! Without the binaries a test skips loudly (or fails under
//! `IDEM_REQUIRE_SERVICES=1`), as with the shared services.

use std::fs::OpenOptions;
use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::services;

mod kafka;
mod nats;
mod postgres;
mod redis;

pub use kafka::PrivateKafka;
pub use nats::PrivateNats;
pub use postgres::PrivatePostgres;
pub use redis::{PrivateRedis, PrivateRedisCluster};

/// A free loopback port (bound, then released for the server to take;
/// another process may take it before the server binds it).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// SIGKILLs `child`, if any, and reaps it.
fn sigkill(child: Option<Child>) {
    if let Some(mut child) = child {
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// Waits until something accepts connections on `port`.
fn wait_for_port(port: u16, within: Duration, what: &str) {
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let started = Instant::now();
    while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
        assert!(
            started.elapsed() < within,
            "{what} did not listen on {addr} within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

//! Private store servers a test may crash and restart: a `redis-server`
//! and a PostgreSQL cluster of the test's own, on free loopback ports,
//! from the machine's binaries. The shared loopback services stay
//! untouched for the tests running beside it.
//!
//! Without the binaries a test skips loudly (or fails under
//! `IDEM_REQUIRE_SERVICES=1`), as with the shared services.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::services;

/// A free loopback port (bound, then released for the server to take).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
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

/// A `redis-server` of the test's own, keeping nothing on disk: a kill and
/// a restart lose every key, as a crash of a cache without persistence.
#[derive(Debug)]
pub struct PrivateRedis {
    binary: PathBuf,
    port: u16,
    child: Option<Child>,
}

impl PrivateRedis {
    /// Starts one on a free port; `None` (a loud skip) without
    /// `redis-server`.
    pub fn start() -> Option<Self> {
        let binary = services::program("redis-server", "IDEM_TEST_REDIS_SERVER", "redis-server")?;
        let mut redis = Self {
            binary,
            port: free_port(),
            child: None,
        };
        redis.launch();
        Some(redis)
    }

    fn launch(&mut self) {
        let child = Command::new(&self.binary)
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string()])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        self.child = Some(child);
        wait_for_port(self.port, Duration::from_secs(10), "redis-server");
    }

    /// `redis://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// SIGKILL: every key is gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A PostgreSQL cluster of the test's own (`initdb` into a temporary
/// directory, trust authentication, loopback only), which the test may
/// crash (`pg_ctl stop -m immediate`: no shutdown checkpoint, crash
/// recovery at the next start) and start again.
#[derive(Debug)]
pub struct PrivatePostgres {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
}

impl PrivatePostgres {
    /// Creates and starts a cluster on a free port; `None` (a loud skip)
    /// without PostgreSQL's server binaries.
    pub fn start() -> Option<Self> {
        let bin = match postgres_bin() {
            Some(bin) => bin,
            None => {
                return services::program(
                    "PostgreSQL server binaries (initdb, pg_ctl)",
                    "IDEM_TEST_PG_BIN",
                    "/usr/lib/postgresql/*/bin/pg_ctl",
                )
                .and(None);
            }
        };
        let dir = tempfile::Builder::new()
            .prefix("idem-pg-")
            .tempdir()
            .expect("temp dir");
        let pg = Self {
            bin,
            dir,
            port: free_port(),
        };
        // The server refuses to run as root: hand the directory to the
        // postgres account when the tests run as root.
        if as_root() {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(pg.dir.path())
                .status()
                .expect("chown");
            assert!(status.success(), "chown the cluster directory");
        }
        pg.run(
            "initdb",
            &[
                "-D",
                &pg.data().display().to_string(),
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
        );
        pg.start_server();
        Some(pg)
    }

    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// One of the cluster's programs, run as `postgres` when the tests run
    /// as root (the server refuses root).
    fn command(&self, program: &str) -> Command {
        let path = self.bin.join(program);
        if as_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        }
    }

    /// Runs one of the cluster's programs; panics with its output if it
    /// fails.
    fn run(&self, program: &str, args: &[&str]) {
        let out = self
            .command(program)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap_or_else(|e| panic!("run {program}: {e}"));
        assert!(
            out.status.success(),
            "{program} {args:?}: {}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn start_server(&self) {
        let opts = format!(
            "-p {} -c listen_addresses=127.0.0.1 -c unix_socket_directories={} -c max_connections=50",
            self.port,
            self.dir.path().display()
        );
        let log = self.dir.path().join("server.log").display().to_string();
        let data = self.data().display().to_string();
        self.run(
            "pg_ctl",
            &["-D", &data, "-l", &log, "-o", &opts, "-w", "start"],
        );
        wait_for_port(self.port, Duration::from_secs(30), "postgres");
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops it as a crash would (immediate mode: no checkpoint; the next
    /// start runs crash recovery from the write-ahead log).
    pub fn crash(&self) {
        let data = self.data().display().to_string();
        self.run("pg_ctl", &["-D", &data, "-m", "immediate", "-w", "stop"]);
    }

    /// Starts it again after [`crash`](Self::crash).
    pub fn start_again(&self) {
        self.start_server();
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let data = self.data().display().to_string();
        let _ = self
            .command("pg_ctl")
            .args(["-D", &data, "-m", "immediate", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// The directory of PostgreSQL's server binaries (`IDEM_TEST_PG_BIN`, or
/// the newest `/usr/lib/postgresql/*/bin` holding `initdb`).
fn postgres_bin() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("IDEM_TEST_PG_BIN") {
        return Some(PathBuf::from(dir)).filter(|d| d.join("initdb").is_file());
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("bin"))
        .filter(|bin| bin.join("initdb").is_file() && bin.join("pg_ctl").is_file())
        .collect();
    found.sort();
    found.pop()
}

/// Whether the tests run as root (asked once).
fn as_root() -> bool {
    static ROOT: OnceLock<bool> = OnceLock::new();
    *ROOT.get_or_init(|| {
        Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| o.stdout.trim_ascii() == b"0")
    })
}

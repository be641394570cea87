//! Private servers a test may crash and restart: a `redis-server`, a
//! Redis Cluster, a PostgreSQL cluster and a Kafka-protocol broker (Tansu)
//! of the test's own, on free loopback ports, from the machine's binaries.
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
        sigkill(self.child.take());
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

/// A Redis Cluster of the test's own: `primaries` nodes owning the slots
/// and `replicas` replicas of each, on free loopback ports (each with its
/// cluster bus port, + 10000, free too), keeping nothing on disk but each
/// node's cluster file. A failover is quick: `cluster-node-timeout` is
/// 1 s. Every node is killed on drop.
#[derive(Debug)]
pub struct PrivateRedisCluster {
    cli: PathBuf,
    nodes: Vec<(u16, Option<Child>)>,
    primaries: usize,
    _dir: tempfile::TempDir,
}

impl PrivateRedisCluster {
    /// Starts and joins the nodes, and waits until every node sees the
    /// cluster as `ok`; `None` (a loud skip) without `redis-server` and
    /// `redis-cli`.
    pub fn start(primaries: usize, replicas: usize) -> Option<Self> {
        let server = services::program("redis-server", "IDEM_TEST_REDIS_SERVER", "redis-server")?;
        let cli = services::program("redis-cli", "IDEM_TEST_REDIS_CLI", "redis-cli")?;
        let dir = tempfile::tempdir().expect("temp dir");
        let mut nodes = Vec::new();
        for port in cluster_ports(primaries * (1 + replicas)) {
            let child = Command::new(&server)
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--cluster-enabled", "yes", "--cluster-node-timeout", "1000"])
                .args(["--cluster-config-file", &format!("nodes-{port}.conf")])
                .arg("--dir")
                .arg(dir.path())
                .args(["--save", "", "--appendonly", "no"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn redis-server");
            nodes.push((port, Some(child)));
        }
        let cluster = Self {
            cli,
            nodes,
            primaries,
            _dir: dir,
        };
        for port in cluster.ports() {
            wait_for_port(port, Duration::from_secs(10), "a Redis Cluster node");
        }
        let mut create = vec!["--cluster".to_owned(), "create".to_owned()];
        create.extend(cluster.ports().iter().map(|p| format!("127.0.0.1:{p}")));
        create.extend(["--cluster-replicas".to_owned(), replicas.to_string()]);
        create.push("--cluster-yes".to_owned());
        let args: Vec<&str> = create.iter().map(String::as_str).collect();
        cluster.cli(cluster.ports()[0], &args);
        cluster.wait_healthy(Duration::from_secs(30));
        // Each replica has its primary's data set and follows it (a
        // `WAIT` before that is answered 0).
        let started = Instant::now();
        for port in &cluster.ports()[..primaries] {
            let online = format!("connected_slaves:{replicas}");
            while !(cluster
                .cli(*port, &["INFO", "replication"])
                .contains(&online)
                && cluster
                    .cli(*port, &["INFO", "replication"])
                    .matches("state=online")
                    .count()
                    == replicas)
            {
                assert!(
                    started.elapsed() < Duration::from_secs(30),
                    "the replicas of {port} did not come online"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Some(cluster)
    }

    /// Every node's port, primaries first (as created).
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(|(port, _)| *port).collect()
    }

    /// `redis+cluster://` naming the primaries as created.
    pub fn url(&self) -> String {
        let hosts: Vec<String> = self.nodes[..self.primaries]
            .iter()
            .map(|(p, _)| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }

    /// `redis-cli -p PORT ARGS…`'s output.
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        let out = Command::new(&self.cli)
            .args(["-p", &port.to_string()])
            .args(args)
            .output()
            .expect("run redis-cli");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// The ports of the nodes that are primaries now, as a live node sees
    /// them.
    pub fn primary_ports(&self) -> Vec<u16> {
        let Some(live) = self.live().next() else {
            return Vec::new();
        };
        self.cli(live, &["CLUSTER", "NODES"])
            .lines()
            .filter(|l| l.contains("master") && !l.contains("fail"))
            .filter_map(|l| {
                let addr = l.split_whitespace().nth(1)?;
                addr.split(['@', ','])
                    .next()?
                    .rsplit_once(':')?
                    .1
                    .parse()
                    .ok()
            })
            .collect()
    }

    /// SIGKILL of the node on `port`: what it had not replicated is lost.
    pub fn kill(&mut self, port: u16) {
        if let Some((_, child)) = self.nodes.iter_mut().find(|(p, _)| *p == port)
            && let Some(mut child) = child.take()
        {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Waits until every live node reports `cluster_state:ok` (all slots
    /// served; after a kill, once a replica has been promoted).
    pub fn wait_healthy(&self, within: Duration) {
        let started = Instant::now();
        while !self.live().all(|port| {
            self.cli(port, &["CLUSTER", "INFO"])
                .contains("cluster_state:ok")
        }) {
            assert!(
                started.elapsed() < within,
                "the Redis Cluster was not ok within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits until `killed` has been replaced: the live nodes see as
    /// many primaries as at the start, none of them `killed`, and the
    /// cluster `ok`.
    pub fn wait_failover(&self, killed: u16, within: Duration) {
        let started = Instant::now();
        loop {
            let primaries = self.primary_ports();
            if primaries.len() == self.primaries && !primaries.contains(&killed) {
                break;
            }
            assert!(
                started.elapsed() < within,
                "no replica of {killed} was promoted within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        self.wait_healthy(within.saturating_sub(started.elapsed()));
    }

    fn live(&self) -> impl Iterator<Item = u16> + '_ {
        self.nodes
            .iter()
            .filter(|(_, child)| child.is_some())
            .map(|(port, _)| *port)
    }
}

impl Drop for PrivateRedisCluster {
    fn drop(&mut self) {
        let ports = self.ports();
        for port in ports {
            self.kill(port);
        }
    }
}

/// `n` loopback ports whose cluster bus ports (+ 10000) are free too.
///
/// Both lie below Linux's ephemeral range (32768 and up by default), so no
/// outgoing connection (the nodes' own bus links, a client, another test)
/// can take one between this check and `redis-server` binding it; and
/// clusters started at once by one test process draw from one cursor, so
/// two never get the same port. The cursor starts at a random point so that
/// test processes running side by side rarely meet.
fn cluster_ports(n: usize) -> Vec<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    const FIRST: u32 = 10_001;
    const SPAN: u32 = 32_767 - 10_000 - FIRST + 1;
    static CURSOR: AtomicU32 = AtomicU32::new(u32::MAX);
    let _ = CURSOR.compare_exchange(
        u32::MAX,
        u32::from(free_port()) % SPAN,
        Ordering::Relaxed,
        Ordering::Relaxed,
    );
    let free = |port: u16| {
        TcpListener::bind(("127.0.0.1", port)).is_ok()
            && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok()
    };
    let mut ports = Vec::new();
    for _ in 0..SPAN {
        if ports.len() == n {
            break;
        }
        let offset = CURSOR.fetch_add(1, Ordering::Relaxed) % SPAN;
        let port = u16::try_from(FIRST + offset).expect("below 32768");
        if free(port) {
            ports.push(port);
        }
    }
    assert_eq!(
        ports.len(),
        n,
        "no {n} free loopback port pairs below 32768"
    );
    ports
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

/// A Kafka-protocol broker of the test's own: Tansu (found by
/// [`services::tansu`]) on a free loopback port, with its `memory://`
/// storage engine. A [`kill`](Self::kill) is a crash that loses
/// everything: [`restart`](Self::restart) brings it back on the same port
/// **empty** — no topics, no messages, no committed offsets, no consumer
/// groups — as a broker whose disk was wiped. Its output (stdout and
/// stderr, every start's) is kept in a log file in a temporary directory
/// for diagnosing a failure ([`log`](Self::log)). Killed on drop.
///
/// Tansu's consumer-group joins take about half of `session.timeout.ms`:
/// clients in tests should set that near 6000 ms.
#[derive(Debug)]
pub struct PrivateKafka {
    binary: PathBuf,
    port: u16,
    /// The address given to clients in metadata, when not its own (a
    /// fault proxy's in front of it).
    advertised: Option<SocketAddr>,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl PrivateKafka {
    /// Starts one on a free port and waits until it is ready; `None` (a
    /// loud skip) without the `tansu` binary.
    pub fn start() -> Option<Self> {
        let binary = services::tansu()?;
        let dir = tempfile::Builder::new()
            .prefix("idem-kafka-")
            .tempdir()
            .expect("temp dir");
        let mut kafka = Self {
            binary,
            port: 0,
            advertised: None,
            child: None,
            dir,
        };
        // Another process may take the free port between its release and
        // Tansu's bind (Tansu then exits): a new port for each try.
        for _ in 0..5 {
            kafka.port = free_port();
            if kafka.launch().is_ok() {
                return Some(kafka);
            }
        }
        panic!(
            "tansu did not start on a free port in 5 tries; its log:\n{}",
            kafka.log()
        );
    }

    /// Starts one on `port` that tells clients to reach it at `advertised`
    /// (a [`FaultProxy`](crate::fault::FaultProxy) forwarding to `port`):
    /// Kafka clients connect to the address in the broker's metadata, not
    /// to the one they bootstrapped from, so a proxy in front of a broker
    /// sees their traffic only if the broker advertises it. `None` (a loud
    /// skip) without the `tansu` binary; panics if `port` is taken.
    pub fn start_behind(port: u16, advertised: SocketAddr) -> Option<Self> {
        let binary = services::tansu()?;
        let dir = tempfile::Builder::new()
            .prefix("idem-kafka-")
            .tempdir()
            .expect("temp dir");
        let mut kafka = Self {
            binary,
            port,
            advertised: Some(advertised),
            child: None,
            dir,
        };
        if let Err(err) = kafka.launch() {
            panic!("tansu on port {port}: {err}; its log:\n{}", kafka.log());
        }
        Some(kafka)
    }

    /// Spawns the broker on `self.port` and waits until it is ready; an
    /// error when it exits first (its port was taken).
    fn launch(&mut self) -> Result<(), String> {
        let mut log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("open the broker's log");
        let _ = writeln!(
            log,
            "--- idem-testkit: starting tansu on 127.0.0.1:{}",
            self.port
        );
        let from = log
            .metadata()
            .map_or(0, |m| usize::try_from(m.len()).unwrap_or(usize::MAX));
        let listener = format!("tcp://127.0.0.1:{}", self.port);
        let advertised = self
            .advertised
            .map_or_else(|| listener.clone(), |a| format!("tcp://{a}"));
        let mut child = Command::new(&self.binary)
            .arg("broker")
            .args(["--cluster-id", "idem-test"])
            .args(["--listener-url", &listener])
            .args(["--advertised-listener-url", &advertised])
            .args(["--storage-engine", "memory://tansu/"])
            // Tansu reads these from the environment: no OTLP export and no
            // schema validation because the test's environment names one.
            .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
            .env_remove("SCHEMA_REGISTRY")
            // Plain text in the log file, not terminal colours.
            .env("NO_COLOR", "1")
            .current_dir(self.dir.path())
            .stdin(Stdio::null())
            .stdout(
                log.try_clone()
                    .expect("a second handle on the broker's log"),
            )
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.binary.display()));
        // Ready once the port answers *and* Tansu said so (`ready in …`):
        // the port alone might be another process's, in which case Tansu
        // exits (with status 0).
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let started = Instant::now();
        let mut answering_since = None;
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("tansu exited ({status})"));
            }
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                let since = *answering_since.get_or_insert_with(Instant::now);
                let said_ready = std::fs::read(self.log_path()).is_ok_and(|text| {
                    text.get(from..)
                        .is_some_and(|new| String::from_utf8_lossy(new).contains("ready in"))
                });
                // A later Tansu may print no such line: alive and answering
                // for half a second will do.
                if said_ready || since.elapsed() > Duration::from_millis(500) {
                    self.child = Some(child);
                    return Ok(());
                }
            }
            if started.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "tansu did not listen on {addr} within 10 s; its log:\n{}",
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// `kafka://127.0.0.1:PORT`, the form of `IDEM_TEST_KAFKA_URL`.
    pub fn url(&self) -> String {
        format!("kafka://{}", self.addr())
    }

    /// `127.0.0.1:PORT`: what a Kafka client's `bootstrap.servers` wants
    /// (the broker advertises the same address).
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// The broker's log file: the output of every start, each after a
    /// `--- idem-testkit: starting tansu` line. It lives as long as `self`.
    pub fn log_path(&self) -> PathBuf {
        self.dir.path().join("tansu.log")
    }

    /// The broker's log so far (empty if it cannot be read), for a failing
    /// test to print.
    pub fn log(&self) -> String {
        std::fs::read(self.log_path())
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_default()
    }

    /// SIGKILL: every topic, message and offset is gone.
    pub fn kill(&mut self) {
        sigkill(self.child.take());
    }

    /// Starts it again on the same port (killing it first if it runs),
    /// **empty**: the memory engine kept nothing. Panics with the log if
    /// it cannot start (the port was taken meanwhile).
    pub fn restart(&mut self) {
        self.kill();
        if let Err(e) = self.launch() {
            panic!(
                "tansu did not restart on {}: {e}; its log:\n{}",
                self.addr(),
                self.log()
            );
        }
    }
}

/// A NATS server with JetStream of the test's own: `nats-server`
/// (`IDEM_TEST_NATS_SERVER`, else on `PATH`) on a free loopback port, its
/// store in a temporary directory that outlives its restarts, for tests
/// that stop their broker (the machine's shared one is never touched).
/// Killed on drop.
#[derive(Debug)]
pub struct PrivateNats {
    binary: PathBuf,
    port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
}

impl PrivateNats {
    /// Starts one and waits until it listens; `None` (a loud skip)
    /// without `nats-server`.
    pub fn start() -> Option<Self> {
        let binary = services::program("the NATS server", "IDEM_TEST_NATS_SERVER", "nats-server")?;
        let dir = tempfile::Builder::new()
            .prefix("idem-nats-")
            .tempdir()
            .expect("temp dir");
        let mut nats = Self {
            binary,
            port: 0,
            child: None,
            dir,
        };
        // Another process may take the free port before the server binds
        // it (the server then exits): a new port for each try.
        for _ in 0..5 {
            nats.port = free_port();
            if nats.launch().is_ok() {
                return Some(nats);
            }
        }
        panic!("nats-server did not start on a free port in 5 tries");
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Spawns the server on `self.port` and waits until it listens; an
    /// error when it exits first (its port was taken).
    fn launch(&mut self) -> Result<(), String> {
        let mut child = Command::new(&self.binary)
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", self.binary.display()));
        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(status)) = child.try_wait() {
                return Err(format!("nats-server exited ({status})"));
            }
            if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
                self.child = Some(child);
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        sigkill(Some(child));
        panic!("nats-server did not listen on {addr} within 10 s");
    }

    /// Stops it as an operator would (SIGTERM: the server writes out what
    /// JetStream holds) and starts it again on the same port with the same
    /// store: what it acknowledged is still there.
    pub fn restart(&mut self) {
        if let Some(mut child) = self.child.take() {
            let pid = child.id().to_string();
            let signalled = Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .is_ok_and(|s| s.success());
            let started = Instant::now();
            let mut stopped = false;
            while signalled && started.elapsed() < Duration::from_secs(10) {
                if matches!(child.try_wait(), Ok(Some(_))) {
                    stopped = true;
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            if !stopped {
                sigkill(Some(child));
                panic!("nats-server {pid} did not stop on SIGTERM within 10 s");
            }
        }
        // Down for a moment, as in a real restart.
        std::thread::sleep(Duration::from_millis(500));
        self.launch().expect("nats-server starts again");
    }
}

impl Drop for PrivateNats {
    fn drop(&mut self) {
        sigkill(self.child.take());
    }
}

impl Drop for PrivateKafka {
    fn drop(&mut self) {
        self.kill();
    }
}

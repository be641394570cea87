//! A Kafka-protocol broker (Tansu) of a test's own.

use super::*;

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

impl Drop for PrivateKafka {
    fn drop(&mut self) {
        self.kill();
    }
}

//! A NATS server with JetStream of a test's own.

use super::*;

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

//! A real `idem serve` process for end-to-end tests: started with a config
//! file, found by its "listening" line, stopped by signal.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use http::Method;
use tokio::io::AsyncBufReadExt;
use tokio::process::{Child, Command};

use crate::client::{Answer, send};

/// The embedded store's URL for a database `idem.db` in `dir`.
pub fn sqlite_store(dir: &Path) -> String {
    format!("sqlite://{}", dir.join("idem.db").display())
}

/// The keys `binary records list --state STATE --json` lists on `store`
/// (up to 10,000), in listing order.
pub fn listed_keys(binary: &str, store: &str, state: &str) -> Vec<String> {
    let out = std::process::Command::new(binary)
        .args([
            "records", "list", "--state", state, "--json", "--limit", "10000",
        ])
        .args(["--store", store])
        .output()
        .expect("run idem records list");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    page["records"]
        .as_array()
        .expect("records")
        .iter()
        .map(|r| r["key"].as_str().expect("key").to_owned())
        .collect()
}

/// The environment variable `idem serve` reads its hash secret from.
pub const HASH_SECRET_ENV: &str = "IDEM_HASH_SECRET";

/// The hash secret the test gateways on a shared store share.
pub const TEST_HASH_SECRET: &str =
    "7465737420736563726574206f6620746865206964656d2074657374206b6974";

/// The `Authorization` a test caller sends when it names none.
pub const TEST_CREDENTIAL: &str = "Bearer sk_test_caller";

/// A running `idem serve` (killed when dropped).
#[derive(Debug)]
pub struct GatewayProcess {
    /// The process.
    pub child: Child,
    /// Where clients connect.
    pub addr: SocketAddr,
    /// The admin listener.
    pub admin: SocketAddr,
}

impl GatewayProcess {
    /// Writes `config` to `dir/idem.toml` and starts `binary serve` on
    /// ephemeral ports with it, the `upstream` and `store`, plus `extra`
    /// arguments; waits for the "listening" line. Logs (at `log` level) go
    /// to the test's stderr, or to `dir/idem.log` when `log_to_file`.
    pub async fn start(
        binary: &str,
        dir: &Path,
        config: &str,
        upstream: &str,
        store: &str,
        log: &str,
        extra: &[&str],
    ) -> Self {
        Self::launch(binary, dir, config, upstream, store, log, extra, &[], false).await
    }

    /// Like [`start`](Self::start), with extra environment variables for
    /// the process (an `LD_PRELOAD`ed clock, say).
    pub async fn start_with_env(
        binary: &str,
        dir: &Path,
        config: &str,
        upstream: &str,
        store: &str,
        log: &str,
        env: &[(&str, &str)],
    ) -> Self {
        Self::launch(binary, dir, config, upstream, store, log, &[], env, false).await
    }

    /// Like [`start`](Self::start), logging to `dir/idem.log`.
    pub async fn start_logging_to_file(
        binary: &str,
        dir: &Path,
        config: &str,
        upstream: &str,
        store: &str,
        log: &str,
        extra: &[&str],
    ) -> Self {
        Self::launch(binary, dir, config, upstream, store, log, extra, &[], true).await
    }

    #[allow(clippy::too_many_arguments)]
    async fn launch(
        binary: &str,
        dir: &Path,
        config: &str,
        upstream: &str,
        store: &str,
        log: &str,
        extra: &[&str],
        env: &[(&str, &str)],
        log_to_file: bool,
    ) -> Self {
        let path = dir.join("idem.toml");
        std::fs::write(&path, config).expect("write config");
        // A shared store needs the secret its gateways share (the
        // embedded one keeps its own beside the database).
        let shared = !(store.starts_with("sqlite:") || store.starts_with("memory:"));
        let mut command = Command::new(binary);
        if shared && !env.iter().any(|(k, _)| *k == HASH_SECRET_ENV) {
            command.env(HASH_SECRET_ENV, TEST_HASH_SECRET);
        }
        let mut child = command
            .args(["--log", log, "serve", "--listen", "127.0.0.1:0"])
            .args(["--admin-listen", "127.0.0.1:0"])
            .arg("--config")
            .arg(&path)
            .args(["--upstream", upstream, "--store", store])
            .args(extra)
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(if log_to_file {
                Stdio::from(std::fs::File::create(dir.join("idem.log")).expect("log file"))
            } else {
                Stdio::inherit()
            })
            .kill_on_drop(true)
            .spawn()
            .expect("spawn idem");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = tokio::io::BufReader::new(stdout).lines();
        let line = tokio::time::timeout(Duration::from_secs(30), lines.next_line())
            .await
            .expect("idem starts within 30 s")
            .expect("read stdout")
            .expect("a listening line");
        // "idem: listening on ADDR (admin ADDR), upstream URL"
        let rest = line
            .strip_prefix("idem: listening on ")
            .unwrap_or_else(|| panic!("unexpected line {line:?}"));
        let (addr, rest) = rest.split_once(" (admin ").expect("admin part");
        let admin = rest.split_once(')').expect("closing paren").0;
        Self {
            child,
            addr: addr.parse().expect("addr"),
            admin: admin.parse().expect("admin addr"),
        }
    }

    /// `POST path` to the gateway, as a caller with a credential: with
    /// [`TEST_CREDENTIAL`] as its `Authorization` unless `headers` name
    /// one (the tenant comes from it).
    pub async fn post(&self, path: &str, headers: &[(&str, &str)], body: &str) -> Answer {
        let mut all = headers.to_vec();
        if !headers
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case("authorization"))
        {
            all.push(("authorization", TEST_CREDENTIAL));
        }
        send(self.addr, Method::POST, path, &all, body.to_owned()).await
    }

    /// A request to the admin listener.
    pub async fn admin(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Answer {
        send(self.admin, method, path, headers, body.to_owned()).await
    }

    /// Sends `signal` (`TERM`, `KILL`, `INT`) to the process.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.id().expect("running").to_string();
        let status = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .expect("kill");
        assert!(status.success(), "kill -{signal} {pid}");
    }

    /// SIGTERM, then waits for the exit.
    pub async fn terminate(mut self) -> std::process::ExitStatus {
        self.signal("TERM");
        tokio::time::timeout(Duration::from_secs(20), self.child.wait())
            .await
            .expect("exits after SIGTERM")
            .expect("wait")
    }
}

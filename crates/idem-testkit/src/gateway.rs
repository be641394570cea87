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

/// The records `binary records list --json` lists on `store` (up to
/// 10,000) with `filters` (`["--state", "held"]`, `["--tenant", T]`), in
/// listing order, as the admin API's record format.
pub fn listed_records(binary: &str, store: &str, filters: &[&str]) -> Vec<serde_json::Value> {
    let out = std::process::Command::new(binary)
        .args(["records", "list", "--json", "--limit", "10000"])
        .args(filters)
        .args(["--store", store])
        .output()
        .expect("run idem records list");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let page: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    page["records"].as_array().expect("records").clone()
}

/// The keys `binary records list --state STATE --json` lists on `store`
/// (up to 10,000), in listing order.
pub fn listed_keys(binary: &str, store: &str, state: &str) -> Vec<String> {
    listed_records(binary, store, &["--state", state])
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

/// How to start an `idem serve` for a test; see [`GatewayProcess::builder`].
#[derive(Debug, Clone)]
#[must_use = "a builder does nothing until `start`"]
pub struct GatewayBuilder {
    binary: String,
    dir: std::path::PathBuf,
    config: String,
    upstream: Option<String>,
    store: Option<String>,
    log: String,
    args: Vec<String>,
    env: Vec<(String, String)>,
    log_to_file: bool,
    listen: String,
}

impl GatewayBuilder {
    /// The config file's text, written to `dir/idem.toml` (default: empty).
    pub fn config(mut self, config: &str) -> Self {
        self.config = config.to_owned();
        self
    }

    /// `--upstream` (required).
    pub fn upstream(mut self, upstream: &str) -> Self {
        self.upstream = Some(upstream.to_owned());
        self
    }

    /// `--store` (default: [`sqlite_store`] in `dir`).
    pub fn store(mut self, store: &str) -> Self {
        self.store = Some(store.to_owned());
        self
    }

    /// `--listen` (default: `127.0.0.1:0`); `[::]:0` is a dual-stack
    /// listener, where IPv4 clients arrive as `::ffff:a.b.c.d`.
    pub fn listen(mut self, listen: &str) -> Self {
        self.listen = listen.to_owned();
        self
    }

    /// `--log` (default: `warn`).
    pub fn log(mut self, log: &str) -> Self {
        self.log = log.to_owned();
        self
    }

    /// More `idem serve` arguments, after the others.
    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(|a| (*a).to_owned()));
        self
    }

    /// Environment variables for the process (an `LD_PRELOAD`ed clock, the
    /// sealing keys, say).
    pub fn envs(mut self, env: &[(&str, &str)]) -> Self {
        self.env
            .extend(env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())));
        self
    }

    /// Logs go to `dir/idem.log` instead of the test's stderr.
    pub fn log_to_file(mut self) -> Self {
        self.log_to_file = true;
        self
    }

    /// Writes the config, starts `binary serve` on ephemeral ports and
    /// waits for its "listening" line.
    pub async fn start(self) -> GatewayProcess {
        let dir = self.dir.as_path();
        let path = dir.join("idem.toml");
        std::fs::write(&path, &self.config).expect("write config");
        let store = self.store.clone().unwrap_or_else(|| sqlite_store(dir));
        let upstream = self
            .upstream
            .as_deref()
            .expect("an upstream: .upstream(url)");
        // A shared store needs the secret its gateways share (the
        // embedded one keeps its own beside the database).
        let shared = !(store.starts_with("sqlite:") || store.starts_with("memory:"));
        let mut command = Command::new(&self.binary);
        if shared && !self.env.iter().any(|(k, _)| k == HASH_SECRET_ENV) {
            command.env(HASH_SECRET_ENV, TEST_HASH_SECRET);
        }
        let mut child = command
            .args(["--log", &self.log, "serve", "--listen", &self.listen])
            .args(["--admin-listen", "127.0.0.1:0"])
            .arg("--config")
            .arg(&path)
            .args(["--upstream", upstream, "--store", &store])
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(if self.log_to_file {
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
        GatewayProcess {
            child,
            addr: addr.parse().expect("addr"),
            admin: admin.parse().expect("admin addr"),
        }
    }
}

impl GatewayProcess {
    /// A builder for `binary serve` with its files in `dir`:
    ///
    /// ```no_run
    /// # async fn f(dir: &std::path::Path) {
    /// use idem_testkit::gateway::GatewayProcess;
    /// let gw = GatewayProcess::builder("target/debug/idem", dir)
    ///     .config("[[route]]\nmethod = \"POST\"\npath = \"/v1/payments\"\n")
    ///     .upstream("http://127.0.0.1:3000")
    ///     .start()
    ///     .await;
    /// # }
    /// ```
    pub fn builder(binary: &str, dir: &Path) -> GatewayBuilder {
        GatewayBuilder {
            binary: binary.to_owned(),
            dir: dir.to_path_buf(),
            config: String::new(),
            upstream: None,
            store: None,
            log: "warn".to_owned(),
            args: Vec::new(),
            env: Vec::new(),
            log_to_file: false,
            listen: "127.0.0.1:0".to_owned(),
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

    /// SIGKILL, then waits for the exit: once this returns the process is
    /// gone and its files closed, so a gateway started next on the same
    /// embedded store finds the file free (a merely dropped one dies in
    /// the background, and the next may still find it served).
    pub async fn kill(self) -> std::process::ExitStatus {
        self.stop_with("KILL").await
    }

    /// SIGTERM, then waits for the exit.
    pub async fn terminate(self) -> std::process::ExitStatus {
        self.stop_with("TERM").await
    }

    /// Sends `signal`, then waits (20 s at most) for the exit.
    async fn stop_with(mut self, signal: &str) -> std::process::ExitStatus {
        self.signal(signal);
        tokio::time::timeout(Duration::from_secs(20), self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("exits after SIG{signal}"))
            .expect("wait")
    }
}

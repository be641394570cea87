//! A PostgreSQL cluster of a test's own, from the machine's binaries.

use super::*;

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

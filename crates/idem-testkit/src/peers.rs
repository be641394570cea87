//! The gateway tests' peers written in Python, from the registries'
//! own SDKs: a service as the upstream, and a client whose run ends in a
//! JSON report of what it sent and what it got.

use std::net::SocketAddr;
use std::path::Path;

/// A service written in Python (`python script PORT LEDGER`) as the
/// upstream: on a free loopback port, its ledger (one line per side
/// effect) at `dir/ledger` and its standard error in `dir/<log>`. Returns
/// once it listens; the process dies with the handle.
pub async fn python_service(
    python: &Path,
    script: &str,
    dir: &Path,
    log: &str,
) -> (tokio::process::Child, SocketAddr) {
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let child = tokio::process::Command::new(python)
        .arg(script)
        .arg(addr.port().to_string())
        .arg(dir.join("ledger"))
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(dir.join(log)).expect("log"))
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("start {script}: {e}"));
    crate::wait::eventually(&format!("{script} listens"), async || {
        tokio::net::TcpStream::connect(addr).await.is_ok()
    })
    .await;
    (child, addr)
}

/// Runs a Python client (`python script ARGS…`) to its end and returns
/// the JSON report it prints; a client that fails fails the test with
/// its standard error.
pub async fn python_report(python: &Path, script: &str, args: &[&str]) -> serde_json::Value {
    let out = tokio::process::Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .await
        .unwrap_or_else(|e| panic!("run {script}: {e}"));
    assert!(
        out.status.success(),
        "{script} {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{script}'s report: {e}: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

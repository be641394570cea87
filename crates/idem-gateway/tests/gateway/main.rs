//! The gateway's integration tests, in one binary: each module drives the
//! real `idem` binary (`CARGO_BIN_EXE_idem`) against real clients, stores,
//! brokers and upstreams on loopback, and says in its first line what it
//! shows. One binary links the workspace once, not once per file.

mod admin;
mod agents;
mod check;
mod clock;
mod crash;
mod dashboard;
mod e2e;
mod faults;
mod first_hour;
mod graphql;
mod grpc;
mod hostile_upstream;
mod limits;
mod profiles;
mod redis_failover;
// The relay tests run `idem relay` against every broker.
#[cfg(all(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
mod relay;
mod restarts;
mod retrying_clients;
mod sealed;
mod shared_stores;
mod telemetry;
mod trust;
mod upstream_tls;
mod webhooks;

/// A Python service behind `idem serve`: the Python it runs under, the
/// directory of its files, its process and the gateway's.
type Behind = (
    std::path::PathBuf,
    tempfile::TempDir,
    tokio::process::Child,
    idem_testkit::gateway::GatewayProcess,
);

/// A service written in Python (`script PORT LEDGER`, with the
/// `modules` it imports) behind `idem serve` with `config`; `None` (a
/// loud skip) without its modules.
async fn python_service_behind_idem(
    modules: &[&str],
    script: &str,
    config: &str,
) -> Option<Behind> {
    let python = idem_testkit::services::python_with(modules)?;
    let dir = tempfile::tempdir().expect("temp dir");
    let (service, addr) =
        idem_testkit::peers::python_service(&python, script, dir.path(), "service.log").await;
    let gw = idem_testkit::gateway::GatewayProcess::builder(env!("CARGO_BIN_EXE_idem"), dir.path())
        .config(config)
        .upstream(&format!("http://{addr}"))
        .start()
        .await;
    Some((python, dir, service, gw))
}

/// The lines of the ledger a Python service keeps in `dir`: one per side
/// effect.
fn ledger(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("ledger"))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

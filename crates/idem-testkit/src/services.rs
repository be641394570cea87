//! Finding the loopback services integration tests need.
//!
//! One rule for every test that talks to a real server: the server's URL
//! comes from the environment at run time (`IDEM_TEST_PG_URL`,
//! `IDEM_TEST_MYSQL_URL`, `IDEM_TEST_REDIS_URL`, `IDEM_TEST_REDIS_CLUSTER_URL`,
//! `IDEM_TEST_NATS_URL`, `IDEM_TEST_AMQP_URL`, `IDEM_TEST_KAFKA_URL`,
//! `IDEM_TEST_DYNAMODB_URL`),
//! defaulting to the machine's loopback services. If the server does not
//! answer, the test **skips with a loud notice** — unless
//! `IDEM_REQUIRE_SERVICES=1` (CI sets it), in which case it **fails**.
//! Programs a test runs itself are found the same way (`IDEM_TANSU_BIN`
//! for the Kafka-protocol broker [`tansu`], `IDEM_TEST_REDIS_SERVER`, …).
//!
//! ```no_run
//! # async fn t() {
//! let Some(url) = idem_testkit::services::postgres() else { return };
//! # let _ = url;
//! # }
//! ```

use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::PathBuf;
use std::time::Duration;

/// The environment variable that turns a skip into a failure.
pub const REQUIRE_ENV: &str = "IDEM_REQUIRE_SERVICES";

/// PostgreSQL (`IDEM_TEST_PG_URL`, default `postgres://postgres@127.0.0.1:5432/test`).
pub fn postgres() -> Option<String> {
    require(
        "PostgreSQL",
        "IDEM_TEST_PG_URL",
        "postgres://postgres@127.0.0.1:5432/test",
    )
}

/// MySQL or MariaDB (`IDEM_TEST_MYSQL_URL`, default
/// `mysql://root@127.0.0.1:3306/test`).
pub fn mysql() -> Option<String> {
    require(
        "MySQL",
        "IDEM_TEST_MYSQL_URL",
        "mysql://root@127.0.0.1:3306/test",
    )
}

/// A DynamoDB-compatible server (`IDEM_TEST_DYNAMODB_URL`, default
/// `dynamodb://idem-test?region=us-east-1&endpoint=http://127.0.0.1:8000`,
/// the moto server `scripts/services.sh` starts). The URL's `endpoint`
/// is what must answer; its table is the shared one tests use with
/// tenants of their own.
pub fn dynamodb() -> Option<String> {
    require(
        "DynamoDB-compatible server",
        "IDEM_TEST_DYNAMODB_URL",
        "dynamodb://idem-test?region=us-east-1&endpoint=http://127.0.0.1:8000",
    )
}

/// Redis (`IDEM_TEST_REDIS_URL`, default `redis://127.0.0.1:6379`).
pub fn redis() -> Option<String> {
    require("Redis", "IDEM_TEST_REDIS_URL", "redis://127.0.0.1:6379")
}

/// A Redis Cluster (`IDEM_TEST_REDIS_CLUSTER_URL`, default the
/// three primaries `scripts/services.sh` starts:
/// `redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002`).
pub fn redis_cluster() -> Option<String> {
    require(
        "Redis Cluster",
        "IDEM_TEST_REDIS_CLUSTER_URL",
        "redis+cluster://127.0.0.1:7000,127.0.0.1:7001,127.0.0.1:7002",
    )
}

/// NATS with JetStream (`IDEM_TEST_NATS_URL`, default `nats://127.0.0.1:4222`).
pub fn nats() -> Option<String> {
    require("NATS", "IDEM_TEST_NATS_URL", "nats://127.0.0.1:4222")
}

/// RabbitMQ (`IDEM_TEST_AMQP_URL`, default `amqp://guest:guest@127.0.0.1:5672/%2f`).
pub fn rabbitmq() -> Option<String> {
    require(
        "RabbitMQ",
        "IDEM_TEST_AMQP_URL",
        "amqp://guest:guest@127.0.0.1:5672/%2f",
    )
}

/// A Kafka-protocol broker (`IDEM_TEST_KAFKA_URL`, default
/// `kafka://127.0.0.1:9092`, the Tansu broker `scripts/services.sh`
/// starts). Its `host:port` is what a Kafka client's `bootstrap.servers`
/// wants. Tansu keeps its topics in memory, and its consumer-group joins
/// take about half of `session.timeout.ms`: clients in tests should set
/// that near 6000 ms.
pub fn kafka() -> Option<String> {
    require(
        "Kafka-protocol broker",
        "IDEM_TEST_KAFKA_URL",
        "kafka://127.0.0.1:9092",
    )
}

/// The Tansu broker binary (Kafka protocol, Apache-2.0) for tests that run
/// a broker of their own (see
/// [`PrivateKafka`](crate::servers::PrivateKafka)): `IDEM_TANSU_BIN`, else
/// where `scripts/services.sh` installs it
/// (`${XDG_CACHE_HOME:-$HOME/.cache}/idem/tansu-0.6.0/tansu`), else `tansu`
/// on `PATH`; a loud skip (or a panic under `IDEM_REQUIRE_SERVICES=1`)
/// when none is there.
pub fn tansu() -> Option<PathBuf> {
    let installed = tansu_install_path();
    let default = if installed.is_file() {
        installed.display().to_string()
    } else {
        "tansu".to_owned()
    };
    program(
        "Tansu (a Kafka-protocol broker)",
        "IDEM_TANSU_BIN",
        &default,
    )
}

/// Where `scripts/services.sh` installs Tansu when `IDEM_TANSU_BIN` is
/// unset: the same expansion as the script's
/// `${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/idem/tansu-0.6.0/tansu`.
fn tansu_install_path() -> PathBuf {
    let set = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    set("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            set("HOME")
                .map_or_else(|| PathBuf::from("/tmp"), PathBuf::from)
                .join(".cache")
        })
        .join("idem/tansu-0.6.0/tansu")
}

/// Whether absent services fail tests instead of skipping them.
pub fn required() -> bool {
    std::env::var(REQUIRE_ENV).is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

/// The URL of a service if it answers on TCP; otherwise a loud skip (or a
/// panic under `IDEM_REQUIRE_SERVICES=1`).
pub fn require(name: &str, env: &str, default: &str) -> Option<String> {
    let url = std::env::var(env).unwrap_or_else(|_| default.to_owned());
    let reachable = host_port(&url).is_some_and(|addr| {
        addr.to_socket_addrs()
            .ok()
            .into_iter()
            .flatten()
            .any(|a| TcpStream::connect_timeout(&a, Duration::from_secs(2)).is_ok())
    });
    if reachable {
        return Some(url);
    }
    absent(&format!(
        "{name} is not reachable at {url} (set {env} to point elsewhere; scripts/services.sh starts the loopback services)"
    ))
}

/// An installed program (`IDEM_TEST_<…>` or `default`, looked up on
/// `PATH`), e.g. `chromedriver` for the dashboard test; a loud skip (or a
/// panic under `IDEM_REQUIRE_SERVICES=1`) when it is missing.
pub fn program(name: &str, env: &str, default: &str) -> Option<PathBuf> {
    let wanted = std::env::var(env).unwrap_or_else(|_| default.to_owned());
    let found = if wanted.contains('/') {
        Some(PathBuf::from(&wanted)).filter(|p| p.is_file())
    } else {
        std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join(&wanted))
                .find(|p| p.is_file())
        })
    };
    found.or_else(|| {
        absent(&format!(
            "{name} ({wanted}) is not installed (set {env}; scripts/services.sh installs it)"
        ))
    })
}

/// A Python 3 (`IDEM_TEST_PYTHON` or `python3`) that imports every one of
/// `modules`, e.g. `requests` for the retrying-client tests; a loud skip
/// (or a panic under `IDEM_REQUIRE_SERVICES=1`) otherwise.
pub fn python_with(modules: &[&str]) -> Option<PathBuf> {
    let python = program("Python 3", "IDEM_TEST_PYTHON", "python3")?;
    let imports = format!("import {}", modules.join(", "));
    let ok = std::process::Command::new(&python)
        .args(["-c", &imports])
        .output()
        .is_ok_and(|out| out.status.success());
    if ok {
        return Some(python);
    }
    absent(&format!(
        "{} cannot `{imports}` (scripts/services.sh installs the Python test clients)",
        python.display()
    ))
}

/// The directory whose `node_modules` holds the npm `package` (the
/// webhook tests' signers), `IDEM_TEST_NODE_DIR` or `~/.cache/idem/node`
/// where `scripts/services.sh` installs them, with `node` on `PATH`; a
/// loud skip (or a panic under `IDEM_REQUIRE_SERVICES=1`) otherwise.
pub fn node_package(package: &str) -> Option<PathBuf> {
    program("Node.js", "IDEM_TEST_NODE", "node")?;
    let dir = std::env::var_os("IDEM_TEST_NODE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/idem/node")))?;
    if dir.join("node_modules").join(package).is_dir() {
        return Some(dir);
    }
    absent(&format!(
        "the npm package {package} is not installed in {} (set IDEM_TEST_NODE_DIR; scripts/services.sh installs it)",
        dir.display()
    ))
}

/// Skips loudly, or fails when services are required.
fn absent<T>(msg: &str) -> Option<T> {
    if required() {
        panic!("{msg}; {REQUIRE_ENV}=1, so this test fails instead of skipping");
    }
    eprintln!("\n!!!!!!!! SKIPPED: {msg}\n");
    None
}

/// The socket address a service URL points at (the scheme's default port
/// when none is given): what a [`FaultProxy`](crate::fault::FaultProxy)
/// forwards to.
pub fn socket_addr(url: &str) -> SocketAddr {
    let hp = host_port(url).unwrap_or_else(|| panic!("no host:port in {url}"));
    hp.to_socket_addrs()
        .ok()
        .and_then(|mut addrs| addrs.next())
        .unwrap_or_else(|| panic!("cannot resolve {hp}"))
}

/// `url` pointed at `addr` instead (a fault proxy in front of the
/// service), keeping its scheme, credentials, path and query, with the
/// query parameters `extra` (`a=1&b=2`, or empty) appended.
pub fn via(url: &str, addr: SocketAddr, extra: &str) -> String {
    let (scheme, rest) = url.split_once("://").expect("scheme://");
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let creds = authority
        .rsplit_once('@')
        .map_or(String::new(), |(c, _)| format!("{c}@"));
    let sep = if extra.is_empty() {
        ""
    } else if tail.contains('?') {
        "&"
    } else {
        "?"
    };
    format!("{scheme}://{creds}{addr}{tail}{sep}{extra}")
}

/// `host:port` of a URL like `scheme://user:pass@host:port/path?query`;
/// for a `dynamodb://table?endpoint=URL`, the endpoint's.
fn host_port(url: &str) -> Option<String> {
    if url.starts_with("dynamodb://") {
        let query = url.split_once('?')?.1;
        let endpoint = query
            .split('&')
            .find_map(|pair| pair.strip_prefix("endpoint="))?;
        return host_port(endpoint);
    }
    let rest = url.split_once("://")?.1;
    let authority = rest.split(['/', '?']).next()?;
    let host_port = authority.rsplit_once('@').map_or(authority, |(_, hp)| hp);
    // A cluster URL names several nodes: the first stands for them.
    let host_port = host_port.split(',').next()?;
    let default_port = match url.split_once("://")?.0 {
        "postgres" | "postgresql" => 5432,
        "mysql" | "mariadb" => 3306,
        "redis" | "rediss" | "redis+cluster" | "rediss+cluster" => 6379,
        "nats" => 4222,
        "amqp" | "amqps" => 5672,
        "kafka" => 9092,
        "http" => 80,
        "https" => 443,
        _ => return None,
    };
    Some(
        if host_port
            .rsplit_once(':')
            .is_some_and(|(_, p)| p.parse::<u16>().is_ok())
        {
            host_port.to_owned()
        } else {
            format!("{host_port}:{default_port}")
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_pointed_at_a_proxy_with_everything_else_kept() {
        let proxy: SocketAddr = "127.0.0.1:4000".parse().expect("addr");
        assert_eq!(
            via("postgres://u:p@127.0.0.1:5432/test", proxy, "a=1"),
            "postgres://u:p@127.0.0.1:4000/test?a=1"
        );
        assert_eq!(
            via("postgres://h/test?x=1", proxy, "a=1"),
            "postgres://127.0.0.1:4000/test?x=1&a=1"
        );
        assert_eq!(
            via("redis://127.0.0.1", proxy, ""),
            "redis://127.0.0.1:4000"
        );
        assert_eq!(
            via("amqp://guest:guest@127.0.0.1:5672/%2f", proxy, ""),
            "amqp://guest:guest@127.0.0.1:4000/%2f"
        );
        assert_eq!(
            socket_addr("nats://127.0.0.1:4222"),
            "127.0.0.1:4222".parse::<SocketAddr>().expect("addr")
        );
    }

    #[test]
    fn host_port_of_urls() {
        assert_eq!(
            host_port("postgres://u:p@127.0.0.1:5433/db").as_deref(),
            Some("127.0.0.1:5433")
        );
        assert_eq!(
            host_port("postgres://localhost/db").as_deref(),
            Some("localhost:5432")
        );
        assert_eq!(
            host_port("mysql://root@127.0.0.1/test").as_deref(),
            Some("127.0.0.1:3306")
        );
        assert_eq!(
            host_port("redis://127.0.0.1").as_deref(),
            Some("127.0.0.1:6379")
        );
        assert_eq!(
            host_port("amqp://guest:guest@127.0.0.1:5672/%2f").as_deref(),
            Some("127.0.0.1:5672")
        );
        assert_eq!(
            host_port("kafka://127.0.0.1").as_deref(),
            Some("127.0.0.1:9092")
        );
        assert_eq!(
            host_port("dynamodb://t?region=us-east-1&endpoint=http://127.0.0.1:8000").as_deref(),
            Some("127.0.0.1:8000")
        );
        assert_eq!(host_port("dynamodb://t?region=us-east-1"), None);
        assert_eq!(host_port("nonsense"), None);
    }

    #[test]
    fn an_unreachable_service_is_skipped_or_fails_by_policy() {
        // Port 1 on loopback is never one of ours.
        let result = std::panic::catch_unwind(|| {
            require("Nothing", "IDEM_TEST_NOTHING_URL", "redis://127.0.0.1:1")
        });
        match result {
            Ok(url) => {
                assert!(!required());
                assert_eq!(url, None);
            }
            Err(_) => assert!(required(), "panics only when services are required"),
        }
    }
}

//! The store on a real Redis Cluster (feature `cluster`): three primaries
//! started by the test on free loopback ports, then the whole conformance
//! suite, listing across nodes, and names with braces.
//!
//! Run: `cargo test -p idem-redis --features cluster --test cluster`.
//! Needs `redis-server` and `redis-cli` on the PATH; without them the test
//! skips loudly (or fails under `IDEM_REQUIRE_SERVICES=1`).

#![cfg(feature = "cluster")]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use idem::{ListFilter, ListRecords, OwnerToken, Reservation, Scope, Store};
use idem_redis::{RedisConnection, RedisStore, redis};
use idem_testkit::conformance as suite;

/// Three cluster primaries, killed on drop.
struct LocalCluster {
    nodes: Vec<Child>,
    ports: Vec<u16>,
    _dir: tempfile::TempDir,
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            let _ = node.kill();
            let _ = node.wait();
        }
    }
}

fn port_pair_free(port: u16) -> bool {
    TcpListener::bind(("127.0.0.1", port)).is_ok()
        && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok()
}

fn free_ports(n: usize) -> Vec<u16> {
    let mut ports = Vec::new();
    let seed = u16::try_from(OwnerToken::random().as_u128() % 20_000).expect("small");
    let mut candidate = 21_000 + seed;
    while ports.len() < n {
        if port_pair_free(candidate) {
            ports.push(candidate);
        }
        candidate = 21_000 + (candidate - 21_000 + 7) % 30_000;
    }
    ports
}

fn have(tool: &str) -> bool {
    Command::new(tool)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .output()
        .expect("run redis-cli");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl LocalCluster {
    fn start() -> Option<Self> {
        if !(have("redis-server") && have("redis-cli")) {
            let msg = "redis-server / redis-cli not found: cannot start a local Redis Cluster";
            assert!(
                !idem_testkit::services::required(),
                "{msg}; IDEM_REQUIRE_SERVICES=1, so this test fails instead of skipping"
            );
            eprintln!("\n!!!!!!!! SKIPPED: {msg}\n");
            return None;
        }
        let dir = tempfile::tempdir().expect("temp dir");
        let ports = free_ports(3);
        let nodes = ports
            .iter()
            .map(|port| {
                Command::new("redis-server")
                    .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                    .args(["--cluster-enabled", "yes"])
                    .arg("--cluster-config-file")
                    .arg(dir.path().join(format!("nodes-{port}.conf")))
                    .arg("--dir")
                    .arg(dir.path())
                    .args(["--save", "", "--appendonly", "no"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .expect("start redis-server")
            })
            .collect();
        let cluster = Self {
            nodes,
            ports,
            _dir: dir,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        for port in &cluster.ports {
            while !cli(*port, &["PING"]).contains("PONG") {
                assert!(Instant::now() < deadline, "node {port} did not start");
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        let addresses: Vec<String> = cluster
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        let mut create = vec!["--cluster", "create"];
        create.extend(addresses.iter().map(String::as_str));
        create.extend(["--cluster-replicas", "0", "--cluster-yes"]);
        cli(cluster.ports[0], &create);
        for port in &cluster.ports {
            while !cli(*port, &["CLUSTER", "INFO"]).contains("cluster_state:ok") {
                assert!(Instant::now() < deadline, "the cluster did not form");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Some(cluster)
    }

    fn url(&self) -> String {
        let hosts: Vec<String> = self
            .ports
            .iter()
            .map(|p| format!("127.0.0.1:{p}"))
            .collect();
        format!("redis+cluster://{}", hosts.join(","))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_store_on_a_redis_cluster() {
    let Some(cluster) = LocalCluster::start() else {
        return;
    };
    let store = Arc::new(RedisStore::connect(&cluster.url()).await.expect("connect"));
    assert!(matches!(store.connection(), RedisConnection::Cluster(_)));

    suite::reserve_complete_replay(Arc::clone(&store)).await;
    suite::failed_is_replayed(Arc::clone(&store)).await;
    suite::reservation_race(Arc::clone(&store)).await;
    suite::mismatch_in_every_state(Arc::clone(&store)).await;
    suite::lease_takeover_and_hold(Arc::clone(&store)).await;
    suite::fencing_of_stale_owner(Arc::clone(&store)).await;
    suite::release_frees_the_key(Arc::clone(&store)).await;
    suite::renew_extends_the_lease(Arc::clone(&store)).await;
    suite::outcome_unknown_is_kept(Arc::clone(&store)).await;
    suite::expiry_and_batched_purge(Arc::clone(&store)).await;
    suite::expired_record_is_replaced(Arc::clone(&store)).await;
    suite::list_filters_and_pages(Arc::clone(&store)).await;
    suite::engine_runs_work_once(Arc::clone(&store)).await;
    suite::engine_heartbeat_protects_slow_work(Arc::clone(&store)).await;
    suite::engine_dropped_guard_keeps_record(Arc::clone(&store)).await;

    // Records of one tenant spread over the nodes; listing finds them all.
    let scope = Scope::new("t{x}:y", "POST /v1/things").expect("scope");
    for i in 0..60 {
        let k: idem::IdempotencyKey = format!("{{k}}:{i}").parse().expect("key");
        let r = store
            .reserve(suite::request(
                &scope,
                &k,
                suite::fp("a"),
                Duration::from_secs(60),
                idem::LeaseExpiry::Retry,
            ))
            .await
            .expect("reserve");
        assert!(matches!(r, Reservation::Acquired(_)));
    }
    let mut per_node = Vec::new();
    for port in &cluster.ports {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).expect("client");
        let mut conn = client
            .get_multiplexed_async_connection()
            .await
            .expect("node connection");
        let names: Vec<String> = redis::cmd("KEYS")
            .arg("idem:{t%7Bx%7D%3Ay:*")
            .query_async(&mut conn)
            .await
            .expect("KEYS");
        per_node.push(names.len());
    }
    assert_eq!(per_node.iter().sum::<usize>(), 60);
    assert!(
        per_node.iter().filter(|n| **n > 0).count() >= 2,
        "keys spread over nodes: {per_node:?}"
    );
    let page = store
        .list(&ListFilter {
            tenant: Some(scope.tenant().to_owned()),
            limit: 100,
            ..ListFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(page.records.len(), 60);
    drop(store);
    drop(cluster);
}

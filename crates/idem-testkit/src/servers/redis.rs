//! A `redis-server` and a Redis Cluster of a test's own.

use super::*;

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

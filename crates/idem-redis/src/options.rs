//! [`RedisOptions`]: which server (or cluster) to reach, under which key
//! prefix and with which time limits, from a `redis://` URL.

use std::fmt;
use std::time::Duration;

use idem::store::backend::QueryOptions;

use crate::error::RedisError;
use crate::keys;

/// Options for [`RedisStore::connect_with`](crate::RedisStore::connect_with).
/// Defaults: key prefix `idem`, 2 s to connect, 2 s for an answer, 6
/// reconnection attempts with exponential back-off. Its `Debug` output
/// redacts passwords.
///
/// ```
/// use std::time::Duration;
/// use idem_redis::RedisOptions;
///
/// # fn main() -> Result<(), idem_redis::RedisError> {
/// let opts = RedisOptions::from_url("redis://:s3cret@127.0.0.1:6379/2?prefix=shop")?
///     .with_response_timeout(Duration::from_millis(500));
/// assert_eq!(opts.prefix(), "shop");
/// assert_eq!(opts.url(), "redis://:s3cret@127.0.0.1:6379/2");
/// assert!(!format!("{opts:?}").contains("s3cret"));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct RedisOptions {
    url: String,
    prefix: String,
    connect_timeout: Duration,
    response_timeout: Duration,
    reconnect_retries: usize,
    cluster_nodes: Vec<String>,
    min_replicas: u32,
    replica_wait: Duration,
}

impl fmt::Debug for RedisOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nodes: Vec<String> = self
            .cluster_nodes
            .iter()
            .map(|n| idem::store::redact_url(n))
            .collect();
        f.debug_struct("RedisOptions")
            .field("url", &idem::store::redact_url(&self.url))
            .field("prefix", &self.prefix)
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("reconnect_retries", &self.reconnect_retries)
            .field("cluster_nodes", &nodes)
            .field("min_replicas", &self.min_replicas)
            .field("replica_wait", &self.replica_wait)
            .finish()
    }
}

impl RedisOptions {
    /// Default options for a server URL the driver accepts and a key
    /// prefix checked by whoever calls this.
    fn with_defaults(url: String, prefix: String, cluster_nodes: Vec<String>) -> Self {
        Self {
            url,
            prefix,
            connect_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(2),
            reconnect_retries: 6,
            cluster_nodes,
            min_replicas: 0,
            replica_wait: Duration::from_secs(1),
        }
    }

    /// Parses `redis://[user:password@]host[:port][/db][?prefix=NAME]`
    /// (and `rediss://…` with the `tls` feature). With the `cluster`
    /// feature, `redis+cluster://[user:password@]host1:port1,host2:port2[?prefix=NAME]`
    /// (or `rediss+cluster://…`) names a Redis Cluster by some of its nodes.
    /// `min_replicas=N` sets [`min_replicas`](Self::min_replicas). Options
    /// other than `prefix` and `min_replicas` go to the driver (a cluster
    /// URL takes none).
    ///
    /// Fails with [`RedisError::Url`] (password redacted) on another
    /// scheme, a scheme this build's features do not cover, a bad prefix,
    /// or a URL the driver refuses.
    pub fn from_url(url: &str) -> Result<Self, RedisError> {
        let bad = |reason: String| RedisError::Url {
            url: idem::store::redact_url(url),
            reason,
        };
        if let Some((scheme, rest)) = url.split_once("+cluster://") {
            return Self::from_cluster_url(scheme, rest).map_err(bad);
        }
        let tls = url.starts_with("rediss://");
        if !(url.starts_with("redis://") || tls) {
            return Err(bad(
                "must start with redis://, rediss:// or redis+cluster://".to_owned(),
            ));
        }
        if tls && !cfg!(feature = "tls") {
            return Err(bad(
                "rediss:// needs idem-redis built with its `tls` feature".to_owned(),
            ));
        }
        let (base, query) = QueryOptions::split(url);
        let mut driver_query = Vec::new();
        let mut prefix = "idem".to_owned();
        let mut min_replicas = 0;
        for option in query {
            match (option.name(), option.value()) {
                ("prefix", Ok(value)) => value.clone_into(&mut prefix),
                ("min_replicas", value) => min_replicas = replicas(value.ok()).map_err(bad)?,
                _ => driver_query.push(option.pair()),
            }
        }
        if !keys::valid_prefix(&prefix) {
            return Err(bad(invalid_prefix(&prefix)));
        }
        let driver_url = if driver_query.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", driver_query.join("&"))
        };
        redis::Client::open(driver_url.as_str()).map_err(|e| bad(e.to_string()))?;
        Ok(Self::with_defaults(driver_url, prefix, Vec::new()).with_min_replicas(min_replicas))
    }

    fn from_cluster_url(scheme: &str, rest: &str) -> Result<Self, String> {
        if !cfg!(feature = "cluster") {
            return Err(
                "redis+cluster:// needs idem-redis built with its `cluster` feature".to_owned(),
            );
        }
        let node_scheme = match scheme {
            "redis" => "redis",
            "rediss" if cfg!(feature = "tls") => "rediss",
            "rediss" => {
                return Err(
                    "rediss+cluster:// needs idem-redis built with its `tls` feature".to_owned(),
                );
            }
            _ => return Err("must start with redis+cluster:// or rediss+cluster://".to_owned()),
        };
        let (authority, query) = QueryOptions::split(rest);
        let authority = authority.trim_end_matches('/');
        if authority.contains('/') {
            return Err("a cluster has only database 0: no /db after the nodes".to_owned());
        }
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let mut prefix = "idem".to_owned();
        let mut min_replicas = 0;
        for option in query {
            match (option.name(), option.value()) {
                ("prefix", Ok(value)) => value.clone_into(&mut prefix),
                ("min_replicas", value) => min_replicas = replicas(value.ok())?,
                _ => return Err(format!("unknown cluster option {:?}", option.pair())),
            }
        }
        if !keys::valid_prefix(&prefix) {
            return Err(invalid_prefix(&prefix));
        }
        let nodes: Vec<String> = hosts
            .split(',')
            .filter(|h| !h.is_empty())
            .map(|host| match userinfo {
                Some(u) => format!("{node_scheme}://{u}@{host}"),
                None => format!("{node_scheme}://{host}"),
            })
            .collect();
        let Some(first) = nodes.first() else {
            return Err("no cluster node after redis+cluster://".to_owned());
        };
        for node in &nodes {
            redis::Client::open(node.as_str()).map_err(|e| e.to_string())?;
        }
        Ok(Self::with_defaults(first.clone(), prefix, nodes).with_min_replicas(min_replicas))
    }

    /// The server's URL, as given to the driver (`redis://…`, idem's own
    /// options removed); for a cluster, its first node's. It holds the
    /// password: print [`redact_url`](idem::store::redact_url)`(url)`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The first part of every key (default `idem`); letters, digits, `-`,
    /// `_`, `.`.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// Uses `prefix` for every key (to share one Redis database between
    /// applications); checked at connect.
    pub fn with_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How many replicas must hold a copy of each write before the store
    /// acknowledges it (`?min_replicas=N`; default 0: Redis's own
    /// asynchronous replication). Each write is followed by `WAIT N`, on
    /// the node holding the record: a failover to a replica that had the
    /// copy loses nothing acknowledged. A write that fewer replicas
    /// confirm within [`replica_wait`](Self::replica_wait) fails as the
    /// store being unavailable.
    pub fn min_replicas(&self) -> u32 {
        self.min_replicas
    }

    /// Sets [`min_replicas`](Self::min_replicas).
    pub fn with_min_replicas(mut self, replicas: u32) -> Self {
        self.min_replicas = replicas;
        self
    }

    /// How long a write waits for its replicas' copies (default 1 s).
    pub fn replica_wait(&self) -> Duration {
        self.replica_wait
    }

    /// Sets [`replica_wait`](Self::replica_wait).
    pub fn with_replica_wait(mut self, wait: Duration) -> Self {
        self.replica_wait = wait;
        self
    }

    /// How long connecting (and each reconnection) may take (default 2 s).
    pub fn connect_timeout(&self) -> Duration {
        self.connect_timeout
    }

    /// Sets how long connecting may take.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long a command may wait for its answer before it fails with
    /// [`StoreError::Unavailable`](idem::StoreError::Unavailable) (default
    /// 2 s).
    pub fn response_timeout(&self) -> Duration {
        self.response_timeout
    }

    /// Sets how long a command may wait for its answer.
    pub fn with_response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// How many times a lost connection is retried before a command fails
    /// (default 6).
    pub fn reconnect_retries(&self) -> usize {
        self.reconnect_retries
    }

    /// Sets how many times a lost connection is retried before a command
    /// fails.
    pub fn with_reconnect_retries(mut self, retries: usize) -> Self {
        self.reconnect_retries = retries;
        self
    }

    /// The seed nodes of a Redis Cluster (`redis://host:port` each); empty
    /// for a single server at [`url`](Self::url). Needs the `cluster`
    /// feature.
    pub fn cluster_nodes(&self) -> &[String] {
        &self.cluster_nodes
    }
}

/// Why `prefix` is refused (at parsing and at connect alike).
pub(crate) fn invalid_prefix(prefix: &str) -> String {
    format!("prefix {prefix:?} must be 1 to 64 letters, digits, '-', '_' or '.'")
}

/// The value of `min_replicas`: a whole number of replicas, at most 16.
fn replicas(value: Option<&str>) -> Result<u32, String> {
    value
        .and_then(|v| v.parse::<u32>().ok())
        .filter(|n| *n <= 16)
        .ok_or_else(|| "min_replicas must be a whole number of replicas from 0 to 16".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_parsing() {
        let o =
            RedisOptions::from_url("redis://:pw@127.0.0.1:6380/3?prefix=app.idem").expect("valid");
        assert_eq!(o.prefix(), "app.idem");
        assert_eq!(o.url(), "redis://:pw@127.0.0.1:6380/3");
        assert!(!format!("{o:?}").contains(":pw@"), "Debug redacts");
        let o = RedisOptions::from_url("redis://127.0.0.1").expect("valid");
        assert_eq!(o.prefix(), "idem");
        assert_eq!(o.min_replicas(), 0, "Redis's own replication by default");
        let o = RedisOptions::from_url("redis://h/2?min_replicas=2&prefix=x").expect("valid");
        assert_eq!(
            (o.min_replicas(), o.prefix(), o.url()),
            (2, "x", "redis://h/2")
        );
    }

    #[test]
    fn bad_urls_say_what_is_wrong() {
        for (url, needle) in [
            ("postgres://u:s3cret@h/db", "must start with redis://"),
            ("redis://h?prefix=a{b}", "prefix"),
            ("redis://h?prefix=", "prefix"),
            ("redis://:s3cret@h:port/0", "invalid Redis store URL"),
            ("redis://:s3cret@h:6379/x", "invalid Redis store URL"),
            (
                "redis://h?min_replicas=one",
                "min_replicas must be a whole number",
            ),
            (
                "redis://h?min_replicas=17",
                "min_replicas must be a whole number",
            ),
        ] {
            let err = RedisOptions::from_url(url).expect_err(url).to_string();
            assert!(err.contains(needle), "{url}: {err}");
            assert!(!err.contains("s3cret"), "{err}");
        }
        #[cfg(not(feature = "tls"))]
        {
            let err = RedisOptions::from_url("rediss://h")
                .expect_err("no tls")
                .to_string();
            assert!(err.contains("tls"), "{err}");
        }
    }

    #[test]
    fn cluster_urls() {
        let parsed =
            RedisOptions::from_url("redis+cluster://u:pw@10.0.0.1:7000,10.0.0.2:7001?prefix=p");
        if cfg!(feature = "cluster") {
            let o = parsed.expect("valid");
            assert_eq!(
                o.cluster_nodes(),
                ["redis://u:pw@10.0.0.1:7000", "redis://u:pw@10.0.0.2:7001"]
            );
            assert_eq!(o.prefix(), "p");
            let o =
                RedisOptions::from_url("redis+cluster://h:1,h:2?min_replicas=1").expect("valid");
            assert_eq!(o.min_replicas(), 1);
            for (url, needle) in [
                ("redis+cluster://", "no cluster node"),
                ("redis+cluster://h:1/3", "database 0"),
                ("redis+cluster://h:1?db=2", "unknown cluster option"),
                ("mongo+cluster://h:1", "must start with"),
            ] {
                let err = RedisOptions::from_url(url).expect_err(url).to_string();
                assert!(err.contains(needle), "{url}: {err}");
            }
        } else {
            let err = parsed.expect_err("no cluster feature").to_string();
            assert!(err.contains("`cluster` feature"), "{err}");
            assert!(!err.contains(":pw@"), "{err}");
        }
    }
}

//! The store's connection: one reconnecting connection to a server, or
//! (feature `cluster`) a connection to a Redis Cluster.

use std::fmt;
use std::sync::Arc;

use idem::store::local::PerThread;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{Cmd, Pipeline, RedisFuture, Value};

/// A connection the store runs its scripts on; cheap to clone (clones share
/// the underlying connections). Use it for commands of your own with
/// `query_async(&mut conn)`.
#[derive(Clone)]
#[non_exhaustive]
pub enum RedisConnection {
    /// One server, reconnected automatically.
    Single(ConnectionManager),
    /// A Redis Cluster: commands go to the node owning their key's slot.
    #[cfg(feature = "cluster")]
    Cluster(redis::cluster_async::ClusterConnection),
}

impl fmt::Debug for RedisConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Single(_) => f.write_str("RedisConnection::Single"),
            #[cfg(feature = "cluster")]
            Self::Cluster(_) => f.write_str("RedisConnection::Cluster"),
        }
    }
}

impl ConnectionLike for RedisConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Single(c) => c.req_packed_command(cmd),
            #[cfg(feature = "cluster")]
            Self::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Single(c) => c.req_packed_commands(cmd, offset, count),
            #[cfg(feature = "cluster")]
            Self::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Single(c) => c.get_db(),
            #[cfg(feature = "cluster")]
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// The primaries of a cluster, as `(host, port)`, from `CLUSTER NODES`.
#[cfg(feature = "cluster")]
pub(crate) fn primaries(cluster_nodes: &str) -> Vec<(String, u16)> {
    cluster_nodes
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let _id = fields.next()?;
            let address = fields.next()?;
            let flags = fields.next()?;
            let flags: Vec<&str> = flags.split(',').collect();
            if !flags.contains(&"master") || flags.iter().any(|f| f.starts_with("fail")) {
                return None;
            }
            // ip:port@cport[,hostname]
            let host_port = address.split('@').next()?;
            let (host, port) = host_port.rsplit_once(':')?;
            Some((host.to_owned(), port.parse().ok()?))
        })
        .collect()
}

#[cfg(all(test, feature = "cluster"))]
mod tests {
    use super::*;

    #[test]
    fn primaries_from_cluster_nodes() {
        let text = "\
07c3 127.0.0.1:30004@40004 slave e7d1 0 1 1 connected
e7d1 127.0.0.1:30001@40001 myself,master - 0 0 1 connected 0-5460
67ed 127.0.0.1:30002@40002,node-2 master - 0 1 2 connected 5461-10922
292f 127.0.0.1:30003@40003 master,fail - 0 1 3 disconnected
";
        assert_eq!(
            primaries(text),
            vec![
                ("127.0.0.1".to_owned(), 30001),
                ("127.0.0.1".to_owned(), 30002)
            ]
        );
    }
}

/// A store's connections of the serving threads' own, one per thread
/// [dedicated](idem::store::local::dedicate_current_thread) to a
/// single-threaded runtime (single server only; see
/// [`idem::store::local`]).
///
/// The shared connection's task lives on whichever runtime connected the
/// store, so a call from a serving thread wakes that runtime to write the
/// command and is woken back by it with the answer. A connection opened
/// on the serving thread itself keeps the whole round trip there. The
/// first call of a store on a thread uses the shared connection and opens
/// this thread's in the background; calls after it use the new one.
pub(crate) struct PerThreadConnections {
    client: redis::Client,
    config: ConnectionManagerConfig,
    own: Arc<PerThread<ConnectionManager>>,
}

impl PerThreadConnections {
    pub(crate) fn new(client: redis::Client, config: ConnectionManagerConfig) -> Self {
        Self {
            client,
            config,
            own: Arc::default(),
        }
    }

    /// This thread's connection, if it has one ready; otherwise `None`
    /// (use the shared one), having started to open one on a dedicated
    /// thread. Commands from many tasks share it, as they share the
    /// shared one.
    pub(crate) fn get(&self) -> Option<ConnectionManager> {
        let (client, config) = (self.client.clone(), self.config.clone());
        let own = self
            .own
            .take(|| ConnectionManager::new_with_config(client, config))?;
        let conn = ConnectionManager::clone(&own);
        own.keep();
        Some(conn)
    }
}

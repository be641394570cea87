//! The store's connection: one reconnecting connection to a server, or
//! (feature `cluster`) a connection to a Redis Cluster.

use std::fmt;

use redis::aio::{ConnectionLike, ConnectionManager};
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

/// Connections of the calling thread's own, one per store, for stores used
/// from single-threaded runtimes (the gateway's serving threads).
///
/// A connection's task runs on the runtime that opened it. The shared
/// connection's task lives on whichever runtime connected the store, so a
/// call from a serving thread wakes that runtime to write the command and
/// is woken back by it with the answer: two hand-offs between threads per
/// round trip. A connection opened on the serving thread itself keeps the
/// whole round trip there.
///
/// * Only on threads dedicated to one single-threaded runtime
///   ([`dedicate_current_thread`](crate::dedicate_current_thread)).
/// * The first call of a store on such a thread uses the shared connection and
///   opens this thread's in the background, on this thread's runtime; the
///   calls after it use the new one. An open that fails is tried again
///   after [`RETRY_OPEN`], the shared connection serving meanwhile.
/// * A connection lives as long as its store (any clone of it), its
///   thread, and the runtime that drives it: a thread that runs one
///   runtime after another opens a new one on each.
/// * Elsewhere calls use the shared connection: multi-threaded runtimes
///   move tasks between threads, and a thread that drives two live
///   runtimes in turn could pick the one not running now.
pub(crate) mod local {
    use std::cell::RefCell;
    use std::sync::{Arc, Weak};
    use std::time::{Duration, Instant};

    use redis::aio::{ConnectionManager, ConnectionManagerConfig};
    use tokio::runtime::{Handle, RuntimeFlavor};

    /// How long after a failed open a thread opens again.
    const RETRY_OPEN: Duration = Duration::from_secs(1);

    /// What a store needs to open connections of its own: one per store
    /// and its clones, compared by address.
    pub(crate) struct Opener {
        pub(crate) client: redis::Client,
        pub(crate) config: ConnectionManagerConfig,
    }

    enum State {
        Ready(ConnectionManager),
        Opening,
        Failed(Instant),
    }

    struct Entry {
        opener: Weak<Opener>,
        /// Alive as long as the runtime the connection's task runs on.
        runtime: Weak<()>,
        state: State,
    }

    thread_local! {
        /// Whether this thread runs one single-threaded runtime for good.
        static DEDICATED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
        static ENTRIES: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
        /// The token of the runtime this thread runs now (see `runtime`).
        static RUNTIME: RefCell<Weak<()>> = const { RefCell::new(Weak::new()) };
    }

    /// See [`dedicate_current_thread`](crate::dedicate_current_thread).
    pub(crate) fn dedicate() {
        DEDICATED.set(true);
    }

    /// This thread's connection for `opener`'s store, if it has one ready;
    /// otherwise `None` (use the shared one), having started to open one
    /// when this thread is dedicated to a single-threaded runtime.
    pub(crate) fn get(opener: &Arc<Opener>) -> Option<ConnectionManager> {
        if !DEDICATED.get() {
            return None;
        }
        let found = ENTRIES.with_borrow(|entries| {
            entries
                .iter()
                .find(|e| ptr_eq(&e.opener, opener))
                .filter(|e| e.runtime.strong_count() > 0)
                .map(|e| match &e.state {
                    State::Ready(conn) => Ok(conn.clone()),
                    State::Opening => Err(false),
                    State::Failed(at) => Err(at.elapsed() >= RETRY_OPEN),
                })
        });
        match found {
            Some(Ok(conn)) => Some(conn),
            Some(Err(false)) => None,
            // None found (or one of a runtime that is gone), or a failed
            // open long enough ago.
            Some(Err(true)) | None => {
                open(opener);
                None
            }
        }
    }

    /// Starts opening this thread's connection for `opener`, when it runs
    /// on a single-threaded runtime.
    fn open(opener: &Arc<Opener>) {
        let Ok(handle) = Handle::try_current() else {
            return;
        };
        if handle.runtime_flavor() != RuntimeFlavor::CurrentThread {
            return;
        }
        let runtime = runtime(&handle);
        ENTRIES.with_borrow_mut(|entries| {
            // Forget what belongs to stores or runtimes that are gone.
            entries.retain(|e| {
                e.opener.strong_count() > 0
                    && e.runtime.strong_count() > 0
                    && !ptr_eq(&e.opener, opener)
            });
            entries.push(Entry {
                opener: Arc::downgrade(opener),
                runtime: runtime.clone(),
                state: State::Opening,
            });
        });
        let weak = Arc::downgrade(opener);
        let (client, config) = (opener.client.clone(), opener.config.clone());
        // A current-thread runtime runs its tasks on the thread that
        // drives it: this one, so the task below sees this thread's
        // entries.
        handle.spawn(async move {
            let opened = ConnectionManager::new_with_config(client, config).await;
            ENTRIES.with_borrow_mut(|entries| {
                let Some(entry) = entries
                    .iter_mut()
                    .find(|e| e.opener.ptr_eq(&weak) && e.runtime.ptr_eq(&runtime))
                else {
                    return;
                };
                entry.state = match opened {
                    Ok(conn) => State::Ready(conn),
                    Err(err) => {
                        tracing::debug!(%err, "opening this thread's Redis connection failed; the shared one serves");
                        State::Failed(Instant::now())
                    }
                };
            });
        });
    }

    /// The token of the runtime `handle` drives, made on first use: a task
    /// on that runtime holds it, so it is dropped when the runtime is.
    fn runtime(handle: &Handle) -> Weak<()> {
        RUNTIME.with_borrow_mut(|current| {
            if current.strong_count() == 0 {
                let token = Arc::new(());
                *current = Arc::downgrade(&token);
                handle.spawn(async move {
                    let _held = token;
                    std::future::pending::<()>().await;
                });
            }
            current.clone()
        })
    }

    fn ptr_eq(weak: &Weak<Opener>, opener: &Arc<Opener>) -> bool {
        std::ptr::eq(weak.as_ptr(), Arc::as_ptr(opener))
    }
}

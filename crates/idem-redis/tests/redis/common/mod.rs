//! Shared test helpers: the servers from the environment, and Redis stores
//! under a key prefix of their own that is deleted when the test ends.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use idem::{ListRecords, OwnerToken, Purge, Store};
use idem_redis::{RedisOptions, RedisStore};
use idem_testkit::conformance::Fixture;

/// Options for the test Redis with a fresh key prefix, or `None` (skip).
pub fn options() -> Option<RedisOptions> {
    let url = idem_testkit::services::redis()?;
    options_for(&url)
}

/// Options for `url` with a fresh key prefix.
pub fn options_for(url: &str) -> Option<RedisOptions> {
    let prefix = format!("idemtest-{}", &OwnerToken::random().to_string()[..16]);
    Some(
        RedisOptions::from_url(url)
            .expect("valid Redis URL")
            .with_prefix(prefix),
    )
}

/// The test Redis URL with its database index replaced by `db`.
pub fn redis_url_with_db(db: u8) -> Option<String> {
    let url = idem_testkit::services::redis()?;
    let opts = RedisOptions::from_url(&url).expect("valid URL");
    let (scheme, rest) = opts.url().split_once("://").expect("scheme");
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    Some(format!("{scheme}://{authority}/{db}"))
}

/// A store (possibly composed over a Redis store) plus the Redis key
/// prefix to delete when the test is over.
pub struct Prefixed<S> {
    pub store: Arc<S>,
    pub redis: RedisStore,
    pub url: String,
}

impl Prefixed<RedisStore> {
    /// A Redis store under a fresh prefix, or `None` (skip).
    pub async fn new() -> Option<Self> {
        Self::connect(idem_testkit::services::redis()?).await
    }

    /// A store on the test Redis Cluster under a fresh prefix, or `None`
    /// (skip).
    pub async fn cluster() -> Option<Self> {
        Self::connect(idem_testkit::services::redis_cluster()?).await
    }

    /// A store on `url` (kept whole, to clean every node it names).
    async fn connect(url: String) -> Option<Self> {
        let opts = options_for(&url)?;
        let redis = RedisStore::connect_with(opts).await.expect("connect");
        Some(Self {
            store: Arc::new(redis.clone()),
            redis,
            url,
        })
    }
}

impl<S: Store + ListRecords + Purge> Fixture for Prefixed<S> {
    type Store = S;
    fn store(&self) -> Arc<S> {
        Arc::clone(&self.store)
    }
}

impl<S> Drop for Prefixed<S> {
    /// Deletes every key under the prefix (processing records have no TTL
    /// and would otherwise stay in the shared Redis).
    fn drop(&mut self) {
        let pattern = format!("{}:*", self.redis.prefix());
        let cleanup = |node: &str| -> redis::RedisResult<()> {
            let client = idem_redis::redis::Client::open(node)?;
            let mut conn = client.get_connection()?;
            let names: Vec<Vec<u8>> = idem_redis::redis::cmd("KEYS")
                .arg(&pattern)
                .query(&mut conn)?;
            for chunk in names.chunks(500) {
                idem_redis::redis::cmd("DEL")
                    .arg(chunk)
                    .query::<()>(&mut conn)?;
            }
            Ok(())
        };
        for node in nodes(&self.url) {
            if let Err(err) = cleanup(&node) {
                eprintln!("cleaning up Redis keys {pattern} on {node}: {err}");
            }
        }
    }
}

use idem_redis::redis;

/// The servers a URL names, each as a `redis://` URL: the one server, or
/// each node of a `redis+cluster://` URL (the primaries, as the tests'
/// clusters are named), where the keys of its own slots live.
pub fn nodes(url: &str) -> Vec<String> {
    match url.strip_prefix("redis+cluster://") {
        Some(hosts) => hosts
            .split(['/', '?'])
            .next()
            .unwrap_or(hosts)
            .split(',')
            .map(|h| format!("redis://{h}"))
            .collect(),
        None => vec![url.to_owned()],
    }
}

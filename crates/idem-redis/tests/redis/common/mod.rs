//! Shared test helpers: the servers from the environment, and Redis stores
//! under a key prefix of their own (`idem_testkit::isolated::RedisPrefix`)
//! whose keys go when the test ends.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use idem::{ListRecords, Purge, Store};
use idem_redis::{RedisOptions, RedisStore};
use idem_testkit::conformance::Fixture;
use idem_testkit::isolated::RedisPrefix;

/// Options for the test Redis under a fresh key prefix, and the prefix,
/// whose keys go when it is dropped; `None` skips.
pub fn options() -> Option<(RedisOptions, RedisPrefix)> {
    Some(options_for(&idem_testkit::services::redis()?))
}

/// Options for `url` under a fresh key prefix, and the prefix, whose keys
/// go when it is dropped.
pub fn options_for(url: &str) -> (RedisOptions, RedisPrefix) {
    let prefix = RedisPrefix::on(url, "store");
    let opts = RedisOptions::from_url(url)
        .expect("valid Redis URL")
        .with_prefix(prefix.name());
    (opts, prefix)
}

/// The test Redis URL with its database index replaced by `db`.
pub fn redis_url_with_db(db: u8) -> Option<String> {
    let url = idem_testkit::services::redis()?;
    let opts = RedisOptions::from_url(&url).expect("valid URL");
    let (scheme, rest) = opts.url().split_once("://").expect("scheme");
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    Some(format!("{scheme}://{authority}/{db}"))
}

/// A store (possibly composed over a Redis store) and the Redis key
/// prefix it keeps to, whose keys go when the test is over.
pub struct Prefixed<S> {
    pub store: Arc<S>,
    pub redis: RedisStore,
    /// The server's URL (or the cluster's nodes), without the prefix.
    pub url: String,
    pub prefix: RedisPrefix,
}

impl Prefixed<RedisStore> {
    /// A Redis store under a fresh prefix, or `None` (skip).
    pub async fn new() -> Option<Self> {
        Some(Self::connect(&idem_testkit::services::redis()?).await)
    }

    /// A store on the test Redis Cluster under a fresh prefix, or `None`
    /// (skip).
    pub async fn cluster() -> Option<Self> {
        Some(Self::connect(&idem_testkit::services::redis_cluster()?).await)
    }

    /// A store on `url` (kept whole, to clean every node it names).
    async fn connect(url: &str) -> Self {
        let (opts, prefix) = options_for(url);
        let redis = RedisStore::connect_with(opts).await.expect("connect");
        Self {
            store: Arc::new(redis.clone()),
            redis,
            url: url.to_owned(),
            prefix,
        }
    }
}

impl<S: Store + ListRecords + Purge> Fixture for Prefixed<S> {
    type Store = S;
    fn store(&self) -> Arc<S> {
        Arc::clone(&self.store)
    }
}

//! Shared test helpers: the servers from the environment.

#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use idem_redis::{RedisOptions, RedisStore};

/// A store on the test Redis (checks use unique tenants), or `None` (skip).
pub async fn redis_store() -> Option<Arc<RedisStore>> {
    let url = idem_testkit::services::redis()?;
    Some(Arc::new(RedisStore::connect(&url).await.expect("connect")))
}

/// The test Redis URL with its database index replaced by `db`.
pub fn redis_url_with_db(db: u8) -> Option<String> {
    let url = idem_testkit::services::redis()?;
    let opts = RedisOptions::from_url(&url).expect("valid URL");
    let base = opts.url.split('?').next().unwrap_or(&opts.url);
    let (scheme, rest) = base.split_once("://").expect("scheme");
    let authority = rest.split('/').next().unwrap_or(rest);
    Some(format!("{scheme}://{authority}/{db}"))
}

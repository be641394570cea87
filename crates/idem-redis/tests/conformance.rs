//! The shared store conformance suite on Redis. The checks share one Redis
//! database; each works in a tenant (and so a key range) of its own.

mod common;

mod redis {
    idem_testkit::store_conformance!(async { super::common::redis_store().await });
}

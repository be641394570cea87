//! The shared store conformance suite on Redis. Each check runs under a
//! key prefix of its own (deleted afterwards) and in a tenant of its own.

mod common;

mod redis {
    idem_testkit::store_conformance!(async { super::common::Prefixed::new().await });
}

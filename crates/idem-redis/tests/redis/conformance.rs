//! The shared store conformance suite on Redis, and (feature `cluster`)
//! on the test Redis Cluster. Each check runs under a key prefix of its
//! own (deleted afterwards) and in a tenant of its own.

use crate::common;

mod redis {
    idem_testkit::store_conformance!(async { super::common::Prefixed::new().await });
}

#[cfg(feature = "cluster")]
mod cluster {
    idem_testkit::store_conformance!(async { super::common::Prefixed::cluster().await });
}

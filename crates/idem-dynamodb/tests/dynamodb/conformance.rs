//! The shared store conformance suite on DynamoDB, alone and as the
//! durable tier under a memory cache. The checks share the test table;
//! each works in a tenant of its own.

use crate::common;

use std::sync::Arc;

use idem::{MemoryStore, Tiered};

mod dynamodb {
    use super::*;
    idem_testkit::store_conformance!(async { common::shared_store().await });
}

mod tiered_memory_dynamodb {
    use super::*;
    idem_testkit::store_conformance!(async {
        common::shared_store()
            .await
            .map(|store| Arc::new(Tiered::new(MemoryStore::new(), store)))
    });
}

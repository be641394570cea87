//! The shared store conformance suite on DynamoDB, alone and as the
//! durable tier under a memory cache, each check on a table of its own.

use crate::common;

use idem::{MemoryStore, Tiered};

mod dynamodb {
    use super::*;
    idem_testkit::store_conformance!(async {
        common::own_table("conformance", |store| store).await
    });
}

mod tiered_memory_dynamodb {
    use super::*;
    idem_testkit::store_conformance!(async {
        common::own_table("conformance_tiered", |store| {
            Tiered::new(MemoryStore::new(), store)
        })
        .await
    });
}

//! The shared store conformance suite on PostgreSQL, alone and as the
//! durable tier under a memory cache. The checks share the test database;
//! each works in a tenant of its own.

use crate::common;

use std::sync::Arc;

use idem::{MemoryStore, Tiered};

mod postgres {
    use super::*;
    idem_testkit::store_conformance!(async { common::shared_store().await });
}

mod tiered_memory_postgres {
    use super::*;
    idem_testkit::store_conformance!(async {
        common::shared_store()
            .await
            .map(|store| Arc::new(Tiered::new(MemoryStore::new(), store)))
    });
}

mod postgres_without_group_commit {
    use super::*;
    idem_testkit::store_conformance!(async {
        let opts = common::options()?.with_group_commit(false);
        Some(Arc::new(
            idem_postgres::PgStore::connect_with(opts)
                .await
                .expect("connect"),
        ))
    });
}

//! The shared store conformance suite on MySQL, with and without group
//! commit, and as the durable tier under a memory cache. The checks share the test database; each
//! works in a tenant of its own.

use crate::common;

use std::sync::Arc;

use idem::{MemoryStore, Tiered};

mod mysql {
    use super::*;
    idem_testkit::store_conformance!(async { common::shared_store().await });
}

mod tiered_memory_mysql {
    use super::*;
    idem_testkit::store_conformance!(async {
        common::shared_store()
            .await
            .map(|store| Arc::new(Tiered::new(MemoryStore::new(), store)))
    });
}

mod mysql_without_group_commit {
    use super::*;
    idem_testkit::store_conformance!(async {
        let opts = common::options()?.with_group_commit(false);
        Some(Arc::new(
            idem_mysql::MySqlStore::connect_with(opts)
                .await
                .expect("connect"),
        ))
    });
}

//! The shared store conformance suite on MySQL, with and without group
//! commit, at READ COMMITTED, and as the durable tier under a memory
//! cache. The checks share the test database; each
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

mod mysql_read_committed {
    use super::*;
    idem_testkit::store_conformance!(async {
        let opts = common::options()?;
        // Every session of the pool at READ COMMITTED, the level many
        // MySQL deployments choose instead of the default REPEATABLE READ.
        let pool = idem_mysql::sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(8)
            .after_connect(|conn, _meta| {
                Box::pin(async move {
                    sqlx::query("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
                        .execute(conn)
                        .await?;
                    Ok(())
                })
            })
            .connect_lazy_with(opts.connect_options().clone());
        let store = idem_mysql::MySqlStore::from_pool(pool);
        store.migrate().await.expect("migrate");
        Some(Arc::new(store))
    });
}

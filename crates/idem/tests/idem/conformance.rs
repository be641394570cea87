//! The shared store conformance suite on the in-process stores.

mod memory {
    idem_testkit::store_conformance!(async { std::sync::Arc::new(idem::MemoryStore::new()) });
}

mod tiered_memory_memory {
    idem_testkit::store_conformance!(async {
        std::sync::Arc::new(idem::Tiered::new(
            idem::MemoryStore::new(),
            idem::MemoryStore::new(),
        ))
    });
}

mod dyn_memory {
    idem_testkit::store_conformance!(async {
        std::sync::Arc::new(idem::DynStore::new(idem::MemoryStore::new()))
    });
}

/// A fast tier that forgets constantly (a few records' budget, copies stale
/// after 20 ms): every answer it cannot give must come, unchanged, from the
/// durable tier.
mod tiered_bounded_cache {
    idem_testkit::store_conformance!(async {
        std::sync::Arc::new(idem::Tiered::new(
            idem::MemoryStore::cache(16 * 1024, std::time::Duration::from_millis(20)),
            idem::MemoryStore::new(),
        ))
    });
}

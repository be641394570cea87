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

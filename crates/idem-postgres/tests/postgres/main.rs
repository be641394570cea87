//! The PostgreSQL store's integration tests, in one binary, against the
//! server from the environment: each module says in its first line what it
//! shows, and each test keeps to its own scope or schema, so they run side
//! by side. One binary links the workspace once, not once per file.

mod common;
mod conformance;
mod connect_errors;
mod durability;
mod group_commit;
mod list_plans;
mod messaging;
mod pool;
mod relay_queries;
mod transaction;

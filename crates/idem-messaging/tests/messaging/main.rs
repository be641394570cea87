//! The messaging crate's integration tests, in one binary, against real
//! PostgreSQL and brokers from the environment: each module says in its
//! first line what it shows. One binary links the workspace once, not once
//! per file.

mod common;
mod consumer;
mod relay;
mod trace;

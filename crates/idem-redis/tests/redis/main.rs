//! The Redis store's integration tests, in one binary, against the servers
//! from the environment: each module says in its first line what it shows.
//! One binary links the workspace once, not once per file.

mod behaviour;
mod cluster;
mod common;
mod conformance;
mod options;
mod tiered;

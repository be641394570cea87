//! The core crate's integration tests, in one binary: each module says in
//! its first line what it shows. One binary links the workspace once, not
//! once per file.

mod conformance;
mod engine;
mod properties;

//! The `idem` gateway as a library: configuration, the proxy, the server
//! and the demo, so tests and embedders can run them in-process. The
//! binary `idem` is a thin command line over these.

pub mod admin;
pub mod check;
pub mod cli;
pub mod config;
pub mod demo;
pub mod jobs;
pub mod limits;
pub mod metrics;
pub mod proxy;
pub mod relay;
pub mod server;
pub mod store;
pub mod upstream;
pub mod workers;

//! The reference services' integration tests, in one binary, against real
//! PostgreSQL and brokers from the environment: each module says in its
//! first line what it shows. One binary links the workspace once, not once
//! per file.

mod api;
mod chaos;
mod check;
mod common;
mod flow;
mod trace;

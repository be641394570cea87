//! The DynamoDB store's integration tests, in one binary, against the
//! server from the environment (`IDEM_TEST_DYNAMODB_URL`, an emulator
//! such as moto): each module says in its first line what it shows, and
//! each test keeps to its own tenant or table, so they run side by side.
//! One binary links the workspace once, not once per file.

mod clock;
mod common;
mod conformance;
mod connect_errors;
mod corrupt;
mod expiry;
mod limits;
mod migrations;
mod races;
mod retries;

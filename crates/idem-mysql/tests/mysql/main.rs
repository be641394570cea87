//! The MySQL store's integration tests, in one binary, against the server
//! from the environment (`IDEM_TEST_MYSQL_URL`, MySQL or MariaDB): each
//! module says in its first line what it shows, and each test keeps to
//! its own tenant or database, so they run side by side. One binary links
//! the workspace once, not once per file.

mod clock;
mod common;
mod conformance;
mod connect_errors;
mod corrupt;
mod group_commit;
mod guard;
mod inbox;
mod keys;
mod limits;
mod migrations;
mod pool;
mod races;
mod transaction;

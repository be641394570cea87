//! The gateway's integration tests, in one binary: each module drives the
//! real `idem` binary (`CARGO_BIN_EXE_idem`) against real clients, stores,
//! brokers and upstreams on loopback, and says in its first line what it
//! shows. One binary links the workspace once, not once per file.

mod admin;
mod agents;
mod check;
mod clock;
mod crash;
mod dashboard;
mod e2e;
mod faults;
mod first_hour;
mod graphql;
mod hostile_upstream;
mod limits;
mod profiles;
mod redis_failover;
// The relay tests run `idem relay` against every broker.
#[cfg(all(feature = "nats", feature = "rabbitmq", feature = "kafka"))]
mod relay;
mod restarts;
mod retrying_clients;
mod sealed;
mod shared_stores;
mod telemetry;
mod trust;
mod upstream_tls;
mod webhooks;

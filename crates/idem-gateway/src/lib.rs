//! The `idem` gateway: Stripe-style `Idempotency-Key` handling in front of
//! any HTTP API, and the operator's commands around it. The binary `idem`
//! is [`cli::main`]; this library exists so that tests, fuzzers and
//! embedders can run its parts in-process.
//!
//! # The map
//!
//! The request path, in the order a request meets it:
//!
//! | module | what it is |
//! |---|---|
//! | [`serve`] | the listeners, serving threads, admission, deadlines, graceful shutdown |
//! | [`proxy`] | the upstream side: forwarding, pooled connections, the body types |
//! | [`store`] | the store behind the layer, chosen by URL, connected in the background |
//!
//! (The idempotency decisions themselves are `idem_http`'s layer, wrapped
//! around [`proxy::Proxy`] by [`serve::bind`].)
//!
//! The operator's side:
//!
//! | module | what it is |
//! |---|---|
//! | [`admin`] | the admin listener: health, readiness, metrics, records API, dashboard |
//! | [`jobs`] | background cleanup, the stuck-record census, the clock check |
//! | [`cli`] | the commands: serve, demo, migrate, records, cleanup, relay, outbox, check |
//!
//! Shared by both:
//!
//! | module | what it is |
//! |---|---|
//! | [`error`] | [`GatewayError`](error::GatewayError), the one error type of the commands |
//! | [`shutdown`] | SIGTERM / SIGINT |
//! | [`metrics`] | every `idem_*` metric name and description, and the recorder |
//! | [`records`] | records as operators see them (JSON views, cursors, hand-made answers) |
//! | [`config`] | flags, environment and file, validated into [`Settings`](config::Settings) |
//! | [`telemetry`] | traces over OpenTelemetry: the spans, `traceparent`, the exporter |
//!
//! # The layering rule
//!
//! Modules are in layers; a module uses its own layer or lower ones, never
//! a higher one, and there are no cycles (`scripts/module-graph` checks
//! both in CI):
//!
//! 1. `error`, `shutdown`, `metrics`, `records`, `config`, `telemetry`;
//! 2. `store`, `proxy`, and the parts of `serve` (`serve::*`);
//! 3. `admin`, `jobs`;
//! 4. `serve` itself (binding and running the listeners);
//! 5. `cli`.
//!
//! Inside a directory module, `mod.rs` composes its children and the
//! children use each other (never the `mod.rs` above them).

pub mod config;
pub mod error;
pub mod metrics;
pub mod records;
pub mod shutdown;
pub mod telemetry;

pub mod proxy;
pub mod store;

pub mod admin;
pub mod jobs;
pub mod serve;

pub mod cli;

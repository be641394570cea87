//! The validated configuration: [`Settings`] and its sections, and the
//! [`Overrides`] given on the command line or in the environment.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use http::Uri;
use idem::HashSecret;
use idem::seal::SealKeys;
use idem_http::{Routes, TenantSource};

/// Values given on the command line or in the environment (they win over
/// the file).
#[derive(Debug, Default, Clone)]
pub struct Overrides {
    /// `--upstream` / `IDEM_UPSTREAM`.
    pub upstream: Option<String>,
    /// `--store` / `IDEM_STORE`.
    pub store: Option<String>,
    /// `--listen` / `IDEM_LISTEN`.
    pub listen: Option<String>,
    /// `--admin-listen` / `IDEM_ADMIN_LISTEN`.
    pub admin_listen: Option<String>,
    /// `--admin-token` / `IDEM_ADMIN_TOKEN`.
    pub admin_token: Option<String>,
    /// `IDEM_ENCRYPTION_KEYS` (environment only: keys never go on a
    /// command line).
    pub encryption_keys: Option<String>,
    /// `IDEM_HASH_SECRET` (environment only, like the keys).
    pub hash_secret: Option<String>,
}

/// Everything `serve` needs, validated.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where clients connect.
    pub listen: SocketAddr,
    /// The upstream origin (`http://host:port` or `https://host:port`).
    pub upstream: Uri,
    /// The TLS client of an `https://` upstream: trusted roots, the
    /// client certificate for mTLS, the ALPN protocols offered (`None`
    /// for `http://`).
    pub upstream_tls: Option<Arc<rustls::ClientConfig>>,
    /// Every request to an `http://` upstream goes in HTTP/2 by prior
    /// knowledge (`upstream_http2 = "prior_knowledge"`); otherwise only
    /// gRPC calls do.
    pub upstream_prior_knowledge: bool,
    /// The store URL.
    pub store: String,
    /// How long a store operation on the request path may take before the
    /// store counts as unavailable (default 5 s).
    pub store_timeout: Duration,
    /// The admin listener.
    pub admin_listen: SocketAddr,
    /// Bearer token for admin routes other than `/healthz`.
    pub admin_token: Option<String>,
    /// Protected routes and their policies.
    pub routes: Routes,
    /// Where the serving listener answers `GET` with the routes' contract
    /// as an OpenAPI document, unauthenticated (`None`: nowhere).
    pub contract_path: Option<String>,
    /// Where tenants come from.
    pub tenant: TenantSource,
    /// How long to wait for the upstream's response headers.
    pub upstream_timeout: Duration,
    /// How long in-flight requests may take to finish at shutdown.
    pub shutdown_grace: Duration,
    /// Threads serving client connections, each with an event loop of its
    /// own (default: one per CPU).
    pub workers: usize,
    /// Background cleanup of expired records (`None`: disabled).
    pub cleanup: Option<CleanupSettings>,
    /// The stuck-record monitor.
    pub monitor: MonitorSettings,
    /// The in-process record cache (`None`: off).
    pub cache: Option<CacheSettings>,
    /// Connection, concurrency and slow-client limits.
    pub limits: LimitsSettings,
    /// Sealing of stored answers at rest (`None`: bodies stored in clear).
    pub seal: Option<SealSettings>,
    /// The secret keying tenants and fingerprints, from `IDEM_HASH_SECRET`
    /// or `hash_secret_file` (`None`: the embedded store keeps one beside
    /// its database, `memory://` makes one per process, and a shared store
    /// refuses to start).
    pub hash_secret: Option<Arc<HashSecret>>,
    /// Until when records written before keyed hashing are looked for
    /// (`accept_v1_until`, or the secret file's own line).
    pub accept_v1_until: Option<SystemTime>,
    /// Traces over OTLP (`None`: off, the default).
    pub telemetry: Option<TelemetrySettings>,
}

/// `[telemetry]`, validated: where traces go, and what they hold.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetrySettings {
    /// The OTLP/HTTP traces endpoint (`http://collector:4318/v1/traces`;
    /// `/v1/traces` is added to a URL without a path).
    pub endpoint: String,
    /// The share of new traces kept, from 0 to 1 (default 1); a request
    /// that arrives with a `traceparent` follows its caller's choice.
    pub sample_ratio: f64,
    /// Whether spans carry the idempotency key (`trace_keys`, default
    /// off: keys can be personal data).
    pub trace_keys: bool,
    /// The `service.name` resource (default `idem`).
    pub service_name: String,
}

/// Sealing, validated: the keys, and whether unsealed records are refused.
#[derive(Debug, Clone)]
pub struct SealSettings {
    /// The key ring (`IDEM_ENCRYPTION_KEYS` or `encryption_keys_file`).
    pub keys: Arc<SealKeys>,
    /// `require_sealed`: a final record whose body is not sealed is
    /// refused as corrupt (never replayed, never run again).
    pub require_sealed: bool,
}

/// `[cache]`, validated: a bounded in-process copy of recent records in
/// front of the store (the fast tier of [`idem::Tiered`]), which answers
/// replays and key reuse of final records without a store round trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheSettings {
    /// Approximate bytes of records held (default 8 MiB: some 10,000 typical
    /// records, while the gateway stays within 64 MiB of memory under load).
    pub size: usize,
    /// How long a copy may be used before the store is asked again
    /// (default 60 s): bounds how long a change made elsewhere (another
    /// gateway, `idem records purge` on the same file) goes unseen.
    pub max_age: Duration,
}

/// `[cleanup]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CleanupSettings {
    /// Pause between cleanup runs.
    pub interval: Duration,
    /// Records deleted per batch: one statement on PostgreSQL; on SQLite
    /// writer jobs of `idem_sqlite::PURGE_CHUNK` rows, each committed with
    /// the serving writes queued beside it.
    pub batch: usize,
}

/// `[monitor]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MonitorSettings {
    /// Whether the monitor runs; `None` (the default): yes, unless the
    /// store cannot list its records cheaply (plain Redis, where listing
    /// scans every key; see `StoreUrl::lists_cheaply`).
    pub enabled: Option<bool>,
    /// Pause between censuses of processing records.
    pub interval: Duration,
    /// A processing record without a live lease older than this is stuck
    /// (`stuck_after_leases` × the longest route lease).
    pub stuck_after: Duration,
}

/// `[limits]`, validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LimitsSettings {
    /// Client connections open at once.
    pub max_connections: usize,
    /// Requests handled at once.
    pub max_in_flight: usize,
    /// Connections one peer address may hold (0: no cap of its own).
    pub max_connections_per_peer: usize,
    /// Requests one peer address may have in flight (0: no cap of its own).
    pub max_in_flight_per_peer: usize,
    /// Request bodies the gateway reads ahead at once, before their
    /// requests take an in-flight slot: with the largest
    /// `max_request_body`, the bound on the memory they hold. Twice
    /// `max_in_flight` by default.
    pub max_bodies: usize,
    /// Request bodies one peer address may have arriving at once, before
    /// their requests take an in-flight slot (0: no cap of its own). By
    /// default its share of in-flight slots: a client sends no more bodies
    /// at once than it has requests in flight, and one that dribbles them
    /// holds only this share of places, never a slot.
    pub max_bodies_per_peer: usize,
    /// How long a request over `max_in_flight` waits for a slot before it
    /// is shed (zero: shed at once).
    pub queue_wait: Duration,
    /// Time allowed for a request head (also the idle keep-alive limit);
    /// zero: no limit (behind a proxy that enforces its own). Turning it
    /// off saves no measurable CPU (docs/BENCHMARKS.md#current-figures).
    pub header_read_timeout: Duration,
    /// Longest pause allowed between chunks of a request body; zero: no
    /// limit.
    pub body_read_timeout: Duration,
    /// Longest time a request body may take in all, from its head on, so
    /// that a client dribbling a byte now and then cannot hold an
    /// in-flight slot for ever; zero: no limit.
    pub body_total_timeout: Duration,
    /// How long a connection may stay open with no request in flight, or
    /// with every answer in flight waiting for the client to take it (a
    /// client that never reads, an HTTP/2 window kept shut, a socket that
    /// takes no byte of a write); zero: no limit. HTTP/2 pings do not
    /// count: a silent connection answering them is idle.
    pub idle_timeout: Duration,
    /// Header fields allowed in a request head.
    pub max_headers: usize,
    /// Bytes allowed in a request head (start line and headers).
    pub max_header_bytes: usize,
}

//! Every default of the configuration, written once: the constants and the
//! `Default` of each section. The file's and the flags' absence means these.

use std::time::Duration;

use super::settings::{CacheSettings, CleanupSettings, LimitsSettings, MonitorSettings};

/// Where client traffic is served: loopback, until a config says otherwise.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// The embedded store in the working directory.
pub const DEFAULT_STORE: &str = "sqlite://idem.db";

/// The admin listener.
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9090";

/// Serving threads when `workers` is not set: one per CPU.
///
/// For every store: with `workers = 0` (connections on the shared
/// runtime), replays in front of Redis run 0.69× as fast
/// (docs/BENCHMARKS.md#current-figures).
pub fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// How long in-flight requests may take to finish at shutdown.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);

/// How long a store operation on the request path may take before the
/// store counts as unavailable.
pub const STORE_TIMEOUT: Duration = Duration::from_secs(5);

/// How long to wait for the upstream's response headers.
pub const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(30);

/// A processing record without a live lease is stuck after this many of
/// the longest route lease.
pub const STUCK_AFTER_LEASES: u32 = 3;

/// Records deleted per cleanup batch (how each store splits it:
/// [`CleanupSettings::batch`]), by the gateway's background cleanup and by
/// `idem cleanup`.
pub const CLEANUP_BATCH: u32 = 1000;

impl Default for CleanupSettings {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(60),
            batch: CLEANUP_BATCH as usize,
        }
    }
}

impl Default for CacheSettings {
    fn default() -> Self {
        Self {
            size: 8 << 20,
            max_age: Duration::from_secs(60),
        }
    }
}

impl Default for MonitorSettings {
    fn default() -> Self {
        Self {
            enabled: None,
            interval: Duration::from_secs(30),
            stuck_after: idem::Policy::default()
                .lease
                .saturating_mul(STUCK_AFTER_LEASES),
        }
    }
}

impl Default for LimitsSettings {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            max_in_flight: 1024,
            max_connections_per_peer: 2048,
            max_in_flight_per_peer: 512,
            max_bodies: 2048,
            max_bodies_per_peer: 512,
            queue_wait: Duration::from_millis(100),
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(10),
            body_total_timeout: Duration::from_secs(60),
            // A client that takes not one byte of its answer for 30 s is
            // gone or hostile; a slow one takes some all the time (every
            // byte its socket accepts counts), and one cut off retries
            // into the recorded answer.
            idle_timeout: Duration::from_secs(30),
            max_headers: 100,
            max_header_bytes: 64 << 10,
        }
    }
}

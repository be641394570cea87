//! `[limits]`: what one client, and all of them, may hold.

use super::error::ConfigError;
use super::file::{LimitsConfig, Source};
use super::settings::LimitsSettings;
use super::values::{duration, parse_size, whole};

/// `[limits]`, each value checked against a sane range.
pub(super) fn limits(
    src: &Source<'_>,
    cfg: Option<&LimitsConfig>,
) -> Result<LimitsSettings, ConfigError> {
    let mut out = LimitsSettings::default();
    let Some(cfg) = cfg else {
        return Ok(out);
    };
    if let Some(v) = &cfg.max_connections {
        out.max_connections = whole(src, "limits.max_connections", v, 1_000_000)?;
    }
    if let Some(v) = &cfg.max_in_flight {
        out.max_in_flight = whole(src, "limits.max_in_flight", v, 1_000_000)?;
    }
    // Per peer: half of the whole unless said (0: no cap of its own).
    out.max_connections_per_peer = match &cfg.max_connections_per_peer {
        Some(v) if *v.get_ref() == 0 => 0,
        Some(v) => whole(
            src,
            "limits.max_connections_per_peer",
            v,
            out.max_connections,
        )?,
        None => (out.max_connections / 2).max(1),
    };
    out.max_in_flight_per_peer = match &cfg.max_in_flight_per_peer {
        Some(v) if *v.get_ref() == 0 => 0,
        Some(v) => whole(src, "limits.max_in_flight_per_peer", v, out.max_in_flight)?,
        None => (out.max_in_flight / 2).max(1),
    };
    // Twice the slots: dribblers from two addresses, each within its
    // share, never fill it, and the bytes read ahead stay bounded by
    // max_bodies × the largest max_request_body.
    out.max_bodies = match &cfg.max_bodies {
        Some(v) => whole(src, "limits.max_bodies", v, 1_000_000)?,
        None => out.max_in_flight.saturating_mul(2),
    };
    out.max_bodies_per_peer = match &cfg.max_bodies_per_peer {
        Some(v) if *v.get_ref() == 0 => 0,
        Some(v) => whole(src, "limits.max_bodies_per_peer", v, 1_000_000)?,
        None => out.max_in_flight_per_peer,
    };
    if let Some(v) = &cfg.max_headers {
        out.max_headers = whole(src, "limits.max_headers", v, 10_000)?;
    }
    if let Some(v) = &cfg.queue_wait {
        out.queue_wait = duration(src, "limits.queue_wait", v)?;
    }
    // "0s" turns a read time-out off (behind a proxy that enforces its own).
    if let Some(v) = &cfg.header_read_timeout {
        out.header_read_timeout = duration(src, "limits.header_read_timeout", v)?;
    }
    if let Some(v) = &cfg.body_read_timeout {
        out.body_read_timeout = duration(src, "limits.body_read_timeout", v)?;
    }
    if let Some(v) = &cfg.body_total_timeout {
        out.body_total_timeout = duration(src, "limits.body_total_timeout", v)?;
    }
    if let Some(v) = &cfg.idle_timeout {
        out.idle_timeout = duration(src, "limits.idle_timeout", v)?;
    }
    if let Some(v) = &cfg.max_header_bytes {
        let n =
            parse_size(v.get_ref()).map_err(|why| src.error("limits.max_header_bytes", v, why))?;
        if !(8 << 10..=16 << 20).contains(&n) {
            return Err(src.error("limits.max_header_bytes", v, "must be from 8KiB to 16MiB"));
        }
        out.max_header_bytes = n;
    }
    Ok(out)
}

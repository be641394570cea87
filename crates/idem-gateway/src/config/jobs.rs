//! `[cleanup]` and `[monitor]`: the background jobs' pace.

use std::time::Duration;

use toml::Spanned;

use super::defaults;
use super::error::ConfigError;
use super::file::{CleanupConfig, MonitorConfig, Source};
use super::settings::{CleanupSettings, MonitorSettings};
use super::values::{duration, positive, whole};

/// `[cleanup]` (on unless `enabled = false`) and `[monitor]`; a record is
/// stuck after `stuck_after_leases` of the longest lease of any route.
pub(super) fn jobs(
    src: &Source<'_>,
    cleanup: &Option<CleanupConfig>,
    monitor: &Option<MonitorConfig>,
    longest_lease: Duration,
) -> Result<(Option<CleanupSettings>, MonitorSettings), ConfigError> {
    let count =
        |key: &str, v: &Option<Spanned<i64>>, default: usize| -> Result<usize, ConfigError> {
            v.as_ref()
                .map_or(Ok(default), |n| whole(src, key, n, 1_000_000))
        };
    let every = |key: &str,
                 v: &Option<Spanned<String>>,
                 default: Duration|
     -> Result<Duration, ConfigError> {
        match v {
            None => Ok(default),
            Some(v) => positive(src, key, v, duration(src, key, v)?),
        }
    };
    let (cleanup_default, monitor_default) =
        (CleanupSettings::default(), MonitorSettings::default());
    let c = cleanup.as_ref();
    let cleanup = if c.and_then(|c| c.enabled).unwrap_or(true) {
        Some(CleanupSettings {
            interval: every(
                "cleanup.interval",
                &c.and_then(|c| c.interval.clone()),
                cleanup_default.interval,
            )?,
            batch: count(
                "cleanup.batch",
                &c.and_then(|c| c.batch.clone()),
                cleanup_default.batch,
            )?,
        })
    } else {
        None
    };
    let m = monitor.as_ref();
    let leases = count(
        "monitor.stuck_after_leases",
        &m.and_then(|m| m.stuck_after_leases.clone()),
        defaults::STUCK_AFTER_LEASES as usize,
    )?;
    let monitor = MonitorSettings {
        enabled: m.and_then(|m| m.enabled),
        interval: every(
            "monitor.interval",
            &m.and_then(|m| m.interval.clone()),
            monitor_default.interval,
        )?,
        stuck_after: longest_lease.saturating_mul(u32::try_from(leases).unwrap_or(u32::MAX)),
    };
    Ok((cleanup, monitor))
}

//! `[cache]`: the in-process record cache's size and age.

use super::error::ConfigError;
use super::file::{CacheConfig, Source};
use super::settings::CacheSettings;
use super::values::{duration, parse_size, positive};

/// `[cache]`: on by default; `size = "0"` turns it off.
pub(super) fn cache(
    src: &Source<'_>,
    cfg: Option<&CacheConfig>,
) -> Result<Option<CacheSettings>, ConfigError> {
    let mut out = CacheSettings::default();
    let Some(cfg) = cfg else {
        return Ok(Some(out));
    };
    if let Some(v) = &cfg.size {
        match parse_size(v.get_ref()) {
            Ok(0) => return Ok(None),
            Ok(n) => out.size = n,
            Err(why) => return Err(src.error("cache.size", v, why)),
        }
    }
    if let Some(v) = &cfg.max_age {
        out.max_age = positive(src, "cache.max_age", v, duration(src, "cache.max_age", v)?)?;
    }
    Ok(Some(out))
}

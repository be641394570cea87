//! `[telemetry]`: where traces go, and how many.

use super::error::ConfigError;
use super::file::{Source, TelemetryConfig};
use super::settings::TelemetrySettings;

/// The OTLP/HTTP traces URL for `endpoint`: an `http(s)://` URL, with
/// `/v1/traces` added when it has no path. The error says what is wrong
/// (the one rule for `[telemetry] otlp_endpoint` and `idem relay
/// --otlp-endpoint`).
pub fn traces_url(endpoint: &str) -> Result<String, String> {
    let uri: http::Uri = endpoint.parse().map_err(|e| format!("not a URL ({e})"))?;
    let (Some(scheme @ ("http" | "https")), Some(authority)) = (uri.scheme_str(), uri.authority())
    else {
        return Err(
            "must be an OTLP/HTTP URL such as http://127.0.0.1:4318 (gRPC endpoints are not supported)"
                .to_owned(),
        );
    };
    Ok(match uri.path() {
        "" | "/" => format!("{scheme}://{authority}/v1/traces"),
        _ => endpoint.to_owned(),
    })
}

/// `[telemetry]`: off without `otlp_endpoint`; the endpoint an
/// `http(s)://` URL (`/v1/traces` added when it has no path), the ratio
/// from 0 to 1.
pub(super) fn telemetry(
    src: &Source<'_>,
    cfg: Option<&TelemetryConfig>,
) -> Result<Option<TelemetrySettings>, ConfigError> {
    let Some(cfg) = cfg else {
        return Ok(None);
    };
    let Some(endpoint) = &cfg.otlp_endpoint else {
        for (key, set) in [
            ("sample_ratio", cfg.sample_ratio.is_some()),
            ("trace_keys", cfg.trace_keys.is_some()),
            ("service_name", cfg.service_name.is_some()),
        ] {
            if set {
                return Err(ConfigError::new(format!(
                    "{}: telemetry.{key} is set but telemetry.otlp_endpoint is not: traces go nowhere",
                    src.file.display()
                )));
            }
        }
        return Ok(None);
    };
    if cfg!(not(feature = "otel")) {
        return Err(src.error(
            "telemetry.otlp_endpoint",
            endpoint,
            "this idem was built without its `otel` feature",
        ));
    }
    let endpoint_url = traces_url(endpoint.get_ref())
        .map_err(|why| src.error("telemetry.otlp_endpoint", endpoint, why))?;
    let sample_ratio = match &cfg.sample_ratio {
        None => 1.0,
        Some(v) if (0.0..=1.0).contains(v.get_ref()) => *v.get_ref(),
        Some(v) => {
            return Err(src.error(
                "telemetry.sample_ratio",
                v,
                "must be from 0 (no new trace) to 1 (every one)",
            ));
        }
    };
    let service_name = match &cfg.service_name {
        None => "idem".to_owned(),
        Some(v) if !v.get_ref().trim().is_empty() => v.get_ref().clone(),
        Some(v) => return Err(src.error("telemetry.service_name", v, "must not be empty")),
    };
    Ok(Some(TelemetrySettings {
        endpoint: endpoint_url,
        sample_ratio,
        trace_keys: cfg.trace_keys == Some(true),
        service_name,
    }))
}

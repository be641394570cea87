//! The configuration file as written (TOML, every table refusing keys it
//! does not know), and [`Source`], which locates a value in it for messages.

use std::path::Path;

use serde::Deserialize;
use toml::Spanned;

use super::error::ConfigError;

/// The file, as written. Every table refuses keys it does not know.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileConfig {
    pub(super) upstream: Option<Spanned<String>>,
    pub(super) upstream_ca_file: Option<Spanned<String>>,
    pub(super) upstream_client_cert: Option<Spanned<String>>,
    pub(super) upstream_client_key: Option<Spanned<String>>,
    pub(super) upstream_http2: Option<Spanned<String>>,
    pub(super) store: Option<Spanned<String>>,
    pub(super) listen: Option<Spanned<String>>,
    pub(super) admin_listen: Option<Spanned<String>>,
    pub(super) admin_token: Option<Spanned<String>>,
    pub(super) admin_token_file: Option<Spanned<String>>,
    pub(super) shutdown_grace: Option<Spanned<String>>,
    pub(super) workers: Option<Spanned<i64>>,
    pub(super) store_timeout: Option<Spanned<String>>,
    pub(super) encryption_keys_file: Option<Spanned<String>>,
    pub(super) require_sealed: Option<Spanned<bool>>,
    pub(super) hash_secret_file: Option<Spanned<String>>,
    pub(super) accept_v1_until: Option<Spanned<String>>,
    pub(super) ignore_path_case: Option<bool>,
    pub(super) ignore_path_parameters: Option<bool>,
    pub(super) ignore_path_suffixes: Option<bool>,
    pub(super) contract_path: Option<Spanned<String>>,
    pub(super) tenant: Option<TenantConfig>,
    pub(super) defaults: Option<PolicyConfig>,
    #[serde(default)]
    pub(super) route: Vec<PolicyConfig>,
    pub(super) cleanup: Option<CleanupConfig>,
    pub(super) monitor: Option<MonitorConfig>,
    pub(super) cache: Option<CacheConfig>,
    pub(super) limits: Option<LimitsConfig>,
    pub(super) telemetry: Option<TelemetryConfig>,
}

/// `[telemetry]`: traces exported over OTLP.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TelemetryConfig {
    pub(super) otlp_endpoint: Option<Spanned<String>>,
    pub(super) sample_ratio: Option<Spanned<f64>>,
    pub(super) trace_keys: Option<bool>,
    pub(super) service_name: Option<Spanned<String>>,
}

/// `[limits]`: what the gateway takes on at once, and slow clients.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct LimitsConfig {
    pub(super) max_connections: Option<Spanned<i64>>,
    pub(super) max_in_flight: Option<Spanned<i64>>,
    pub(super) max_connections_per_peer: Option<Spanned<i64>>,
    pub(super) max_in_flight_per_peer: Option<Spanned<i64>>,
    pub(super) max_bodies: Option<Spanned<i64>>,
    pub(super) max_bodies_per_peer: Option<Spanned<i64>>,
    pub(super) queue_wait: Option<Spanned<String>>,
    pub(super) header_read_timeout: Option<Spanned<String>>,
    pub(super) body_read_timeout: Option<Spanned<String>>,
    pub(super) body_total_timeout: Option<Spanned<String>>,
    pub(super) idle_timeout: Option<Spanned<String>>,
    pub(super) max_headers: Option<Spanned<i64>>,
    pub(super) max_header_bytes: Option<Spanned<String>>,
}

/// `[cache]`: the in-process copy of recent records in front of the store.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CacheConfig {
    pub(super) size: Option<Spanned<String>>,
    pub(super) max_age: Option<Spanned<String>>,
}

/// `[cleanup]`: the background deletion of expired records.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CleanupConfig {
    pub(super) enabled: Option<bool>,
    pub(super) interval: Option<Spanned<String>>,
    pub(super) batch: Option<Spanned<i64>>,
}

/// `[monitor]`: the stuck-record monitor.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct MonitorConfig {
    pub(super) enabled: Option<bool>,
    pub(super) interval: Option<Spanned<String>>,
    pub(super) stuck_after_leases: Option<Spanned<i64>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct TenantConfig {
    pub(super) from: Spanned<String>,
    pub(super) name: Option<Spanned<String>>,
    pub(super) trusted_proxies: Option<Spanned<Vec<String>>>,
}

/// `[defaults]` and each `[[route]]` (routes also say `method` and `path`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct PolicyConfig {
    pub(super) method: Option<Spanned<String>>,
    pub(super) path: Option<Spanned<String>>,
    pub(super) retention: Option<Spanned<String>>,
    pub(super) lease: Option<Spanned<String>>,
    pub(super) require_key: Option<bool>,
    pub(super) on_in_flight: Option<Spanned<String>>,
    pub(super) in_flight_wait: Option<Spanned<String>>,
    pub(super) on_store_error: Option<Spanned<String>>,
    pub(super) on_lease_expiry: Option<Spanned<String>>,
    pub(super) on_missing_tenant: Option<Spanned<String>>,
    pub(super) path_spelling: Option<Spanned<String>>,
    pub(super) max_request_body: Option<Spanned<String>>,
    pub(super) max_stored_response: Option<Spanned<String>>,
    pub(super) upstream_timeout: Option<Spanned<String>>,
    pub(super) mismatch_status: Option<Spanned<u16>>,
    pub(super) key_header: Option<Spanned<OneOrMany>>,
    pub(super) key_from: Option<Spanned<String>>,
    pub(super) fingerprint_headers: Option<Spanned<Vec<String>>>,
    pub(super) fingerprint_include: Option<Spanned<Vec<String>>>,
    pub(super) fingerprint_exclude: Option<Spanned<Vec<String>>>,
    pub(super) unstored_headers: Option<Spanned<Vec<String>>>,
    pub(super) release_statuses: Option<Spanned<Vec<u16>>>,
    pub(super) on_server_error: Option<Spanned<String>>,
    pub(super) profile: Option<Spanned<String>>,
    pub(super) replay_header: Option<Spanned<OneOrMany>>,
    pub(super) not_retained: Option<Spanned<String>>,
    pub(super) held_retry_after: Option<Spanned<String>>,
    pub(super) retention_header: Option<bool>,
    pub(super) key_format: Option<Spanned<String>>,
    pub(super) key_min_length: Option<Spanned<i64>>,
    pub(super) reconcile: Option<ReconcileConfig>,
    pub(super) webhook: Option<WebhookConfig>,
    pub(super) protocol: Option<Spanned<String>>,
    #[serde(default)]
    pub(super) call: Vec<CallConfig>,
}

/// `[[route.call]]`: the calls of one JSON-RPC method a `protocol =
/// "jsonrpc"` route protects.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct CallConfig {
    pub(super) method: Option<Spanned<String>>,
    pub(super) tools: Option<Spanned<Vec<String>>>,
    pub(super) tools_except: Option<Spanned<Vec<String>>>,
    pub(super) key_header: Option<Spanned<OneOrMany>>,
    pub(super) key_field: Option<Spanned<OneOrMany>>,
    pub(super) require_key: Option<bool>,
}

/// `[route.webhook]`: the route receives a provider's signed deliveries.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct WebhookConfig {
    pub(super) provider: Option<Spanned<String>>,
    pub(super) secrets_file: Option<Spanned<String>>,
    pub(super) secrets_env: Option<Spanned<String>>,
    pub(super) tolerance: Option<Spanned<String>>,
    pub(super) sender: Option<Spanned<String>>,
    pub(super) signature_header: Option<Spanned<String>>,
    pub(super) signature_encoding: Option<Spanned<String>>,
    pub(super) signature_prefix: Option<Spanned<String>>,
    pub(super) algorithm: Option<Spanned<String>>,
    pub(super) signed: Option<Spanned<String>>,
    pub(super) id_header: Option<Spanned<String>>,
    pub(super) id_field: Option<Spanned<String>>,
    pub(super) timestamp_header: Option<Spanned<String>>,
}

/// A value written as one string or a list of them (`key_header`,
/// `replay_header`).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub(super) enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl OneOrMany {
    pub(super) fn to_vec(&self) -> Vec<String> {
        match self {
            Self::One(one) => vec![one.clone()],
            Self::Many(many) => many.clone(),
        }
    }
}

/// `[route.reconcile]`: how the upstream is asked what became of a held
/// record of this route.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct ReconcileConfig {
    pub(super) method: Option<Spanned<String>>,
    pub(super) path: Option<Spanned<String>>,
    pub(super) status: Option<Spanned<u16>>,
    pub(super) first: Option<Spanned<String>>,
    pub(super) max_pause: Option<Spanned<String>>,
    pub(super) settle: Option<Spanned<String>>,
    pub(super) give_up: Option<Spanned<String>>,
}

/// Where in the file a value sits, for messages.
pub(super) struct Source<'a> {
    pub(super) file: &'a Path,
    pub(super) text: &'a str,
}

impl Source<'_> {
    pub(super) fn line(&self, span: std::ops::Range<usize>) -> usize {
        self.text[..span.start.min(self.text.len())]
            .matches('\n')
            .count()
            + 1
    }

    pub(super) fn error<T: std::fmt::Debug>(
        &self,
        key: &str,
        value: &Spanned<T>,
        why: impl std::fmt::Display,
    ) -> ConfigError {
        ConfigError::new(format!(
            "{}:{}: {key} = {:?}: {why}",
            self.file.display(),
            self.line(value.span()),
            value.get_ref()
        ))
    }
}

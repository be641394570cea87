//! `[route.webhook]`: a route that receives a provider's signed
//! deliveries, its secrets (from a file or an environment variable, one
//! or several while the sender rotates them), and the policy a webhook
//! route starts from.

use http::{HeaderName, Method};
use idem::ServerError;
use idem_http::RoutePolicy;
use idem_http::webhook::{IdSource, Provider, Scheme, Secret, Webhook};
use toml::Spanned;

use super::error::ConfigError;
use super::file::{PolicyConfig, Source, WebhookConfig};
use super::policy::post_route_of_kind;
use super::secrets::read_secret_file;
use super::values::{duration, positive};

/// The fewest bytes of a secret the gateway takes without a warning: a
/// shorter one may be guessed offline from one captured delivery.
pub(super) const SHORT_SECRET: usize = 16;

/// The keys a generic `hmac` sender is described by, which no provider of
/// a scheme of its own takes.
const HMAC_KEYS: [&str; 8] = [
    "signature_header",
    "signature_encoding",
    "signature_prefix",
    "algorithm",
    "signed",
    "id_header",
    "id_field",
    "timestamp_header",
];

/// The route's sender, checked against the rest of the route (`route` is
/// the whole `[[route]]`).
pub(super) fn webhook(
    src: &Source<'_>,
    at: &str,
    route: &PolicyConfig,
    method: &Method,
    cfg: &WebhookConfig,
) -> Result<Webhook, ConfigError> {
    let key = |k: &str| format!("{at}.webhook.{k}");
    let file = || src.file.display();
    post_route_of_kind(
        src,
        at,
        method,
        "a webhook route (every provider delivers with POST)",
        &[
            ("key_header", route.key_header.is_some()),
            ("key_from", route.key_from.is_some()),
            ("require_key", route.require_key.is_some()),
            ("on_missing_tenant", route.on_missing_tenant.is_some()),
        ],
        "a webhook route's key is its delivery id and its tenant its sender",
    )?;
    let provider_value = cfg.provider.as_ref().ok_or_else(|| {
        ConfigError::new(format!(
            "{}: {at}.webhook has no provider: write provider = \"stripe\" (or standard, github, shopify, hmac)",
            file()
        ))
    })?;
    let provider: Provider = provider_value
        .get_ref()
        .parse()
        .map_err(|why| src.error(&key("provider"), provider_value, why))?;
    let scheme = match provider.scheme() {
        Some(scheme) => {
            if let Some(name) = HMAC_KEYS.iter().find(|k| hmac_key(cfg, k).is_some()) {
                return Err(ConfigError::new(format!(
                    "{}: {at}.webhook.{name}: {provider} deliveries are read as {provider} documents them; only provider = \"hmac\" is described key by key",
                    file()
                )));
            }
            scheme
        }
        None => hmac_scheme(src, at, cfg)?,
    };
    let secrets = secrets(src, at, cfg, provider)?;
    let mut hook = Webhook::new(provider, scheme, secrets)
        .map_err(|e| ConfigError::new(format!("{}: {at}.webhook: {e}", file())))?;
    if let Some(v) = &cfg.tolerance {
        let d = positive(
            src,
            &key("tolerance"),
            v,
            duration(src, &key("tolerance"), v)?,
        )?;
        if !hook.scheme().has_timestamp() {
            return Err(src.error(
                &key("tolerance"),
                v,
                format!("{provider} deliveries carry no signed timestamp to hold to a tolerance"),
            ));
        }
        hook = hook.with_tolerance(d);
    }
    if let Some(v) = &cfg.sender {
        hook = hook
            .with_sender(v.get_ref())
            .map_err(|e| src.error(&key("sender"), v, e))?;
    }
    Ok(hook)
}

fn hmac_key<'a>(cfg: &'a WebhookConfig, name: &str) -> Option<&'a Spanned<String>> {
    match name {
        "signature_header" => cfg.signature_header.as_ref(),
        "signature_encoding" => cfg.signature_encoding.as_ref(),
        "signature_prefix" => cfg.signature_prefix.as_ref(),
        "algorithm" => cfg.algorithm.as_ref(),
        "signed" => cfg.signed.as_ref(),
        "id_header" => cfg.id_header.as_ref(),
        "id_field" => cfg.id_field.as_ref(),
        "timestamp_header" => cfg.timestamp_header.as_ref(),
        _ => None,
    }
}

/// A generic sender, described key by key.
fn hmac_scheme(src: &Source<'_>, at: &str, cfg: &WebhookConfig) -> Result<Scheme, ConfigError> {
    let key = |k: &str| format!("{at}.webhook.{k}");
    let header = |name: &str, v: &Spanned<String>| {
        HeaderName::from_bytes(v.get_ref().trim().to_ascii_lowercase().as_bytes())
            .map_err(|_| src.error(&key(name), v, "not a header name"))
    };
    let signature = cfg.signature_header.as_ref().ok_or_else(|| {
        ConfigError::new(format!(
            "{}: {at}.webhook: provider = \"hmac\" needs signature_header = \"X-Signature\", the header the sender signs in",
            src.file.display()
        ))
    })?;
    let id = match (&cfg.id_header, &cfg.id_field) {
        (Some(h), None) => IdSource::Header(vec![header("id_header", h)?]),
        (None, Some(f)) => IdSource::Field(
            f.get_ref()
                .parse()
                .map_err(|why| src.error(&key("id_field"), f, why))?,
        ),
        (Some(_), Some(f)) => {
            return Err(src.error(&key("id_field"), f, "set id_header or id_field, not both"));
        }
        (None, None) => {
            return Err(ConfigError::new(format!(
                "{}: {at}.webhook: provider = \"hmac\" needs id_header = \"X-Delivery-Id\" or id_field = \"/event_id\": where the sender puts each delivery's id",
                src.file.display()
            )));
        }
    };
    let mut scheme = Scheme::hmac(header("signature_header", signature)?, id);
    if let Some(v) = &cfg.algorithm {
        scheme = scheme.with_algorithm(
            v.get_ref()
                .parse()
                .map_err(|why| src.error(&key("algorithm"), v, why))?,
        );
    }
    if let Some(v) = &cfg.signature_encoding {
        scheme = scheme.with_encoding(
            v.get_ref()
                .parse()
                .map_err(|why| src.error(&key("signature_encoding"), v, why))?,
        );
    }
    if let Some(v) = &cfg.signature_prefix {
        scheme = scheme.with_prefix(v.get_ref());
    }
    if let Some(v) = &cfg.signed {
        scheme = scheme.with_signed(
            v.get_ref()
                .parse()
                .map_err(|why| src.error(&key("signed"), v, why))?,
        );
    }
    if let Some(v) = &cfg.timestamp_header {
        scheme = scheme.with_timestamp_header(header("timestamp_header", v)?);
    }
    if let Some(why) = scheme.check().err() {
        let at_key = cfg.signed.as_ref().map_or(signature, |s| s);
        return Err(src.error(&key("signed"), at_key, why));
    }
    if cfg.timestamp_header.is_some() && !scheme.has_timestamp() {
        return Err(src.error(
            &key("timestamp_header"),
            cfg.timestamp_header.as_ref().unwrap_or(signature),
            "the timestamp is not signed: name {timestamp} in signed, or anyone could set it",
        ));
    }
    Ok(scheme)
}

/// The secrets: one per line of `secrets_file` (`#` comments), or the
/// whitespace-separated words of the variable `secrets_env`. Errors name
/// where they came from, never a secret.
fn secrets(
    src: &Source<'_>,
    at: &str,
    cfg: &WebhookConfig,
    provider: Provider,
) -> Result<Vec<Secret>, ConfigError> {
    let key = |k: &str| format!("{at}.webhook.{k}");
    let (texts, from): (Vec<String>, String) = match (&cfg.secrets_file, &cfg.secrets_env) {
        (Some(_), Some(v)) => {
            return Err(src.error(
                &key("secrets_env"),
                v,
                "set secrets_file or secrets_env, not both",
            ));
        }
        (Some(path), None) => {
            let text =
                read_secret_file(src, &key("secrets_file"), path, "the webhook secrets file")?;
            let lines = text
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(str::to_owned)
                .collect();
            (lines, format!("{} {}", key("secrets_file"), path.get_ref()))
        }
        (None, Some(var)) => {
            let value = std::env::var(var.get_ref()).map_err(|_| {
                src.error(
                    &key("secrets_env"),
                    var,
                    "this environment variable is not set",
                )
            })?;
            let words = value.split_whitespace().map(str::to_owned).collect();
            (words, format!("{} ${}", key("secrets_env"), var.get_ref()))
        }
        (None, None) => {
            return Err(ConfigError::new(format!(
                "{}: {at}.webhook needs its signing secrets: secrets_file = \"/etc/idem/{}.secrets\" (one per line) or secrets_env = \"{}_WEBHOOK_SECRETS\"",
                src.file.display(),
                provider.name(),
                provider.name().to_ascii_uppercase()
            )));
        }
    };
    if texts.is_empty() {
        return Err(ConfigError::new(format!("{from}: holds no secret")));
    }
    texts
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let secret = Secret::parse(text, provider.secret_form())
                .map_err(|e| ConfigError::new(format!("{from}: secret {}: {e}", i + 1)))?;
            if secret.len() < SHORT_SECRET {
                tracing::warn!(reason = "webhook_secret_short", source = %from, secret = i + 1, bytes = secret.len(), "a webhook secret of fewer than {SHORT_SECRET} bytes may be guessed from one captured delivery");
            }
            Ok(secret)
        })
        .collect()
}

/// The policy a webhook route starts from, before its own keys: kept for
/// its provider's retry window, and a server error of the receiver frees
/// the delivery for the provider's next retry (a receiver's `5xx` asks for
/// the delivery again; held, it would wait for an operator while the
/// provider retries for days and then disables the endpoint). `502` and
/// `504`, which prove nothing, stay held.
pub(super) fn base_policy(defaults: &RoutePolicy, provider: Provider) -> RoutePolicy {
    let engine = defaults
        .engine
        .clone()
        .with_retention(provider.retry_window())
        .with_on_server_error(ServerError::Release);
    defaults.clone().with_engine(engine)
}

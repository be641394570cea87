//! `idem openapi`: the configured routes' idempotency contract as an
//! OpenAPI 3.1 document on stdout, the one the serving listener publishes
//! at `contract_path`.

use std::path::PathBuf;

use crate::config;
use crate::error::GatewayError;

/// `idem openapi` arguments.
#[derive(Debug, clap::Args)]
pub(super) struct OpenapiArgs {
    /// TOML configuration file (without one: the defaults alone).
    #[arg(long, env = "IDEM_CONFIG")]
    config: Option<PathBuf>,
}

/// Validates the configuration as `idem serve` does and prints the
/// document. The upstream plays no part in it: when neither the file nor
/// `IDEM_UPSTREAM` names one, a placeholder stands in.
pub(super) fn run(args: OpenapiArgs) -> Result<(), GatewayError> {
    let in_file = args.config.as_deref().is_some_and(|file| {
        std::fs::read_to_string(file)
            .ok()
            .and_then(|text| text.parse::<toml::Table>().ok())
            .is_some_and(|table| table.contains_key("upstream"))
    });
    let upstream = match std::env::var("IDEM_UPSTREAM") {
        Ok(url) => Some(url),
        Err(_) => (!in_file).then(|| "http://upstream.invalid".to_owned()),
    };
    let overrides = config::Overrides {
        upstream,
        ..config::Overrides::default()
    };
    let settings = config::load(args.config.as_deref(), &overrides)?;
    let doc = idem_http::openapi::document(&settings.routes);
    println!(
        "{}",
        serde_json::to_string_pretty(&doc).expect("a JSON value serialises")
    );
    Ok(())
}

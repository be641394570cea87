//! `idem serve`: the gateway in front of an upstream.

use std::path::PathBuf;

use crate::config;
use crate::error::GatewayError;
use crate::serve;

/// `idem serve` flags; each also has a config key and an `IDEM_*`
/// variable, and wins over both.
#[derive(Debug, clap::Args)]
pub(super) struct ServeArgs {
    /// TOML configuration file.
    #[arg(long, env = "IDEM_CONFIG")]
    config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1:8080].
    #[arg(long, env = "IDEM_LISTEN")]
    listen: Option<String>,
    /// Upstream origin, e.g. http://127.0.0.1:3000 (required here or in the config).
    #[arg(long, env = "IDEM_UPSTREAM")]
    upstream: Option<String>,
    /// Store URL [default: sqlite://idem.db].
    #[arg(long, env = "IDEM_STORE")]
    store: Option<String>,
    /// Admin listener address [default: 127.0.0.1:9090].
    #[arg(long, env = "IDEM_ADMIN_LISTEN")]
    admin_listen: Option<String>,
    /// Bearer token for the admin API (required on a non-loopback address).
    #[arg(long, env = "IDEM_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
}

impl ServeArgs {
    /// The config file named by `--config` or `IDEM_CONFIG`.
    pub(super) fn config_file(&self) -> Option<&std::path::Path> {
        self.config.as_deref()
    }
}

/// Loads the configuration, binds, says it is ready, serves until a
/// signal.
pub(super) async fn run(args: ServeArgs) -> Result<(), GatewayError> {
    let overrides = config::Overrides {
        upstream: args.upstream,
        store: args.store,
        listen: args.listen,
        admin_listen: args.admin_listen,
        admin_token: args.admin_token,
        encryption_keys: config::encryption_keys_from_env(),
        hash_secret: config::hash_secret_from_env(),
    };
    let settings = config::load(args.config.as_deref(), &overrides)?;
    let server = serve::bind(&settings).await?;
    // Before the ready line: a signal right after it must stop us cleanly.
    let stop = crate::shutdown::shutdown_signal();
    let addr = server
        .local_addr()
        .map_err(|e| GatewayError::io("the listener's address", e))?;
    let admin = server
        .admin_addr()
        .map_err(|e| GatewayError::io("the admin listener's address", e))?;
    tracing::info!(%addr, %admin, upstream = %settings.upstream, store = %idem::store::redact_url(&settings.store), "idem serve ready");
    // One plain line on stdout for scripts and tests to find the ports.
    println!(
        "idem: listening on {addr} (admin {admin}), upstream {}",
        settings.upstream
    );
    server.run(stop).await;
    tracing::info!("idem serve stopped");
    Ok(())
}

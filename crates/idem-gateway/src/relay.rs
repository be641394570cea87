//! `idem relay`: publishes the PostgreSQL outbox to a broker (NATS
//! JetStream), with as many relays running at once as wanted; see
//! [`idem_messaging::relay`] for the guarantees.

use std::time::Duration;

use idem_messaging::{NatsPublisher, Relay, RelayOptions};
use idem_postgres::{PgOptions, PgStore};

use crate::server::error_chain;

/// What `idem relay` was asked to do.
#[derive(Debug, Clone, clap::Args)]
pub struct RelayArgs {
    /// The PostgreSQL database holding the outbox (`postgres://…`).
    #[arg(long, env = "IDEM_STORE")]
    pub store: String,
    /// The broker (`nats://host:port`).
    #[arg(long, env = "IDEM_BROKER")]
    pub broker: String,
    /// The JetStream stream that captures the subjects.
    #[arg(long, env = "IDEM_STREAM", default_value = "IDEM")]
    pub stream: String,
    /// Subject prefix: `<prefix>.<aggregate_type>.<message_type>`.
    #[arg(long, env = "IDEM_PREFIX", default_value = "idem")]
    pub prefix: String,
    /// Create the stream (subjects `<prefix>.>`) if it is missing.
    #[arg(long)]
    pub create_stream: bool,
    /// The duplicate window of a stream created with --create-stream.
    #[arg(long, default_value = "2m", value_parser = humantime::parse_duration)]
    pub duplicate_window: Duration,
    /// Partitions aggregates are hashed into; every relay of one outbox
    /// must use the same number.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub partitions: u16,
    /// Attempts before a row becomes dead.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(i32).range(1..=1000))]
    pub max_attempts: i32,
}

/// Runs the relay until SIGINT or SIGTERM.
pub async fn run(args: RelayArgs) -> Result<(), String> {
    let opts = PgOptions::from_url(&args.store).map_err(|e| error_chain(&e))?;
    if !args.broker.starts_with("nats://") {
        return Err(format!(
            "--broker {}: only nats:// brokers are supported by this build",
            idem::store::redact_url(&args.broker)
        ));
    }
    if args.prefix.is_empty() || args.prefix.contains(['*', '>', ' ']) {
        return Err(format!(
            "--prefix {:?}: must be a non-empty subject prefix without wildcards or spaces",
            args.prefix
        ));
    }
    let namespace = opts.schema.clone().unwrap_or_else(|| "public".to_owned());
    let lock_options = opts.connect.clone();
    let store = PgStore::connect_with(opts)
        .await
        .map_err(|e| error_chain(&e))?;
    let publisher = NatsPublisher::connect(&args.broker, &args.stream)
        .await
        .map_err(|e| e.to_string())?;
    if args.create_stream {
        publisher
            .create_stream(vec![format!("{}.>", args.prefix)], args.duplicate_window)
            .await
            .map_err(|e| e.to_string())?;
    }
    let options = RelayOptions {
        prefix: args.prefix.clone(),
        partitions: args.partitions,
        max_attempts: args.max_attempts,
        ..RelayOptions::default()
    };
    let relay = Relay::new(
        store.pool().clone(),
        lock_options,
        &namespace,
        publisher,
        options,
    );
    if let Some(warning) = relay.check_duplicate_window().await {
        eprintln!("idem relay: WARNING: {warning}");
    }
    println!(
        "idem relay: publishing the outbox of {} to {} stream {} (subjects {}.>)",
        idem::store::redact_url(&args.store),
        args.broker,
        args.stream,
        args.prefix
    );
    let stats = relay.run(crate::server::shutdown_signal()).await;
    println!(
        "idem relay: stopped after publishing {} row(s) ({} already in the stream), {} failed attempt(s), {} dead",
        stats.published, stats.duplicates, stats.failures, stats.dead
    );
    Ok(())
}

//! `idem`: Stripe-style `Idempotency-Key` handling in front of any HTTP API.
//!
//! ```text
//! idem serve --upstream http://127.0.0.1:3000        # the gateway
//! idem demo                                          # a retry storm, end to end
//! ```

use idem_gateway::{cli, config, demo, server};

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

/// idem makes retries safe: a retried request never repeats its side effect,
/// and the caller gets the original answer back.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about)]
struct Cli {
    /// Log format.
    #[arg(long, global = true, env = "IDEM_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Log filter, e.g. `info` or `info,idem_http=debug`.
    #[arg(long, global = true, env = "IDEM_LOG", default_value = "info")]
    log: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gateway in front of an upstream.
    Serve(ServeArgs),
    /// Start a toy payments upstream, the gateway in front of it on the
    /// embedded store, and a retry storm; print what happened.
    Demo(demo::DemoArgs),
    /// Create or upgrade the store's schema (PostgreSQL, SQLite) and exit.
    Migrate(MigrateArgs),
    /// Inspect and act on idempotency records in a store.
    #[command(subcommand)]
    Records(RecordsCommand),
    /// Delete expired completed and failed records in batches (never
    /// processing ones); safe to interrupt and run again.
    Cleanup(CleanupArgs),
}

#[derive(Debug, clap::Args)]
struct StoreArg {
    /// Store URL.
    #[arg(long, env = "IDEM_STORE", default_value = config::DEFAULT_STORE)]
    store: String,
}

#[derive(Debug, Subcommand)]
enum RecordsCommand {
    /// List records, oldest first.
    List {
        #[command(flatten)]
        store: StoreArg,
        #[command(flatten)]
        filter: cli::ListArgs,
    },
    /// Show one record (as JSON).
    Show {
        #[command(flatten)]
        store: StoreArg,
        #[command(flatten)]
        id: cli::RecordId,
        /// Include the stored response body.
        #[arg(long)]
        body: bool,
    },
    /// Free a processing record's key (its work is known not to have happened).
    Release {
        #[command(flatten)]
        store: StoreArg,
        #[command(flatten)]
        id: cli::RecordId,
    },
    /// Record the final answer of a processing record (reconcile an outcome_unknown one).
    Resolve {
        #[command(flatten)]
        store: StoreArg,
        #[command(flatten)]
        id: cli::RecordId,
        #[command(flatten)]
        answer: cli::ResolveArgs,
    },
    /// Delete one record, whatever its state.
    Purge {
        #[command(flatten)]
        store: StoreArg,
        #[command(flatten)]
        id: cli::RecordId,
    },
}

#[derive(Debug, clap::Args)]
struct CleanupArgs {
    #[command(flatten)]
    store: StoreArg,
    /// Records deleted per batch (one transaction each).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    batch: u32,
    /// Stop after this many seconds (the next run carries on).
    #[arg(long)]
    max_seconds: Option<u64>,
}

#[derive(Debug, clap::Args)]
struct MigrateArgs {
    #[command(flatten)]
    store: StoreArg,
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
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

fn init_logs(format: LogFormat, filter: &str) -> Result<(), String> {
    let targets: tracing_subscriber::filter::Targets = filter
        .parse()
        .map_err(|e| format!("--log / IDEM_LOG {filter:?}: {e}"))?;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let registry = tracing_subscriber::registry().with(targets);
    match format {
        LogFormat::Text => registry
            .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
            .init(),
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .json()
                    .with_writer(std::io::stderr),
            )
            .init(),
    }
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(err) = init_logs(cli.log_format, &cli.log) {
        eprintln!("idem: {err}");
        return ExitCode::from(2);
    }
    let result = match cli.command {
        Command::Serve(args) => serve(args).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Migrate(args) => idem_gateway::store::migrate(&args.store.store)
            .await
            .map(|done| println!("idem: {done}")),
        Command::Records(command) => records(command).await,
        Command::Cleanup(args) => match cli::open(&args.store.store).await {
            Ok(store) => {
                cli::cleanup(
                    &store,
                    args.batch as usize,
                    args.max_seconds.map(std::time::Duration::from_secs),
                )
                .await
            }
            Err(err) => Err(err),
        },
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("idem: {err}");
            ExitCode::FAILURE
        }
    }
}

async fn records(command: RecordsCommand) -> Result<(), String> {
    match command {
        RecordsCommand::List { store, filter } => {
            cli::list(&cli::open(&store.store).await?, &filter).await
        }
        RecordsCommand::Show { store, id, body } => {
            cli::show(&cli::open(&store.store).await?, &id, body).await
        }
        RecordsCommand::Release { store, id } => {
            cli::release(&cli::open(&store.store).await?, &id).await
        }
        RecordsCommand::Resolve { store, id, answer } => {
            cli::resolve(&cli::open(&store.store).await?, &id, &answer).await
        }
        RecordsCommand::Purge { store, id } => {
            cli::purge(&cli::open(&store.store).await?, &id).await
        }
    }
}

async fn serve(args: ServeArgs) -> Result<(), String> {
    let overrides = config::Overrides {
        upstream: args.upstream,
        store: args.store,
        listen: args.listen,
        admin_listen: args.admin_listen,
        admin_token: args.admin_token,
    };
    let settings = config::load(args.config.as_deref(), &overrides).map_err(|e| e.to_string())?;
    let server = server::bind(&settings).await?;
    let addr = server.local_addr().map_err(|e| e.to_string())?;
    let admin = server.admin_addr().map_err(|e| e.to_string())?;
    tracing::info!(%addr, %admin, upstream = %settings.upstream, store = %idem::store::redact_url(&settings.store), "idem serve ready");
    // One plain line on stdout for scripts and tests to find the ports.
    println!(
        "idem: listening on {addr} (admin {admin}), upstream {}",
        settings.upstream
    );
    server.run(server::shutdown_signal()).await;
    tracing::info!("idem serve stopped");
    Ok(())
}

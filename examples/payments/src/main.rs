//! `payments`: the reference Payment API, its fake provider and (soon) the
//! Order service, as one binary with a subcommand each.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use payments::api::{Api, ApiConfig};
use payments::provider::Provider;

#[derive(Debug, Parser)]
#[command(
    name = "payments",
    about = "idem's reference Payment API and fake provider"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// The fake payment provider.
    Provider {
        /// Where to listen.
        #[arg(long, default_value = "127.0.0.1:4100")]
        listen: SocketAddr,
    },
    /// The Payment API (and its reconciliation worker).
    Api {
        /// Where to listen.
        #[arg(long, default_value = "127.0.0.1:4000")]
        listen: SocketAddr,
        /// PostgreSQL for payments, idempotency records and the outbox.
        #[arg(
            long,
            env = "PAYMENTS_DATABASE",
            default_value = "postgres://postgres@127.0.0.1:5432/test?schema=payments"
        )]
        database: String,
        /// The provider's base URL.
        #[arg(long, default_value = "http://127.0.0.1:4100")]
        provider: String,
        /// How long to wait for the provider.
        #[arg(long, default_value = "2s", value_parser = humantime_secs)]
        provider_timeout: Duration,
        /// The idempotency lease.
        #[arg(long, default_value = "30s", value_parser = humantime_secs)]
        lease: Duration,
        /// How often the reconciliation worker runs.
        #[arg(long, default_value = "5s", value_parser = humantime_secs)]
        reconcile_every: Duration,
    },
}

fn humantime_secs(s: &str) -> Result<Duration, String> {
    let (n, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len()));
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{s:?}: expected e.g. 2s, 500ms, 1m"))?;
    match unit {
        "ms" => Ok(Duration::from_millis(n)),
        "s" | "" => Ok(Duration::from_secs(n)),
        "m" => Ok(Duration::from_secs(n * 60)),
        _ => Err(format!("{s:?}: expected e.g. 2s, 500ms, 1m")),
    }
}

async fn shutdown() {
    let _ = tokio::signal::ctrl_c().await;
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .with_writer(std::io::stderr)
        .init();
    let result = match Cli::parse().command {
        Command::Provider { listen } => run_provider(listen).await,
        Command::Api {
            listen,
            database,
            provider,
            provider_timeout,
            lease,
            reconcile_every,
        } => {
            let mut config = ApiConfig::new(&database, &provider);
            config.provider_timeout = provider_timeout;
            config.lease = lease;
            run_api(listen, config, reconcile_every).await
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("payments: {err}");
            ExitCode::FAILURE
        }
    }
}

async fn run_provider(listen: SocketAddr) -> Result<(), String> {
    let (addr, task) = payments::serve(listen, Provider::default().router(), shutdown()).await?;
    println!("payments provider: listening on http://{addr}");
    task.await.map_err(|e| e.to_string())
}

async fn run_api(listen: SocketAddr, config: ApiConfig, every: Duration) -> Result<(), String> {
    let api = Api::connect(config).await?;
    let worker = tokio::spawn({
        let api = api.clone();
        async move {
            loop {
                tokio::time::sleep(every).await;
                match api.reconcile().await {
                    Ok(r) if r.examined > 0 => tracing::info!(?r, "reconciliation pass"),
                    Ok(_) => {}
                    Err(err) => tracing::warn!(%err, "reconciliation pass failed"),
                }
            }
        }
    });
    let (addr, task) = payments::serve(listen, api.router(), shutdown()).await?;
    println!("payments api: listening on http://{addr}");
    let served = task.await.map_err(|e| e.to_string());
    worker.abort();
    served
}

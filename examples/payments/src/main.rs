//! `payments`: the reference Payment API, its fake provider, the Order
//! service and their outbox relays, as one binary with a subcommand each;
//! `payments all` runs them all as child processes. The broker is NATS
//! JetStream or Kafka, by the `--broker` URL's scheme (see
//! [`payments::Bus`]).

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
            default_value = PAYMENTS_DB
        )]
        database: String,
        /// The provider's base URL.
        #[arg(long, default_value = "http://127.0.0.1:4100")]
        provider: String,
        /// The Order service (payments for unknown orders or other amounts
        /// are refused before charging).
        #[arg(long)]
        orders: Option<String>,
        /// How long to wait for the provider.
        #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
        provider_timeout: Duration,
        /// The idempotency lease.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        lease: Duration,
        /// How often the reconciliation worker runs.
        #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
        reconcile_every: Duration,
    },
    /// The Order service: HTTP and the PaymentAuthorized consumer (it
    /// creates the broker's streams or topics if missing).
    Orders {
        /// Where to listen.
        #[arg(long, default_value = "127.0.0.1:4001")]
        listen: SocketAddr,
        /// PostgreSQL for orders, inbox, outbox and idempotency records.
        #[arg(long, env = "ORDERS_DATABASE", default_value = ORDERS_DB)]
        database: String,
        #[command(flatten)]
        bus: BusArgs,
    },
    /// An outbox relay for one service's database.
    Relay {
        /// The service's database (its `schema=`).
        #[arg(long)]
        database: String,
        #[command(flatten)]
        bus: BusArgs,
    },
    /// Everything on loopback: provider, Payment API, Order service and
    /// both relays, as child processes.
    All {
        /// PostgreSQL server (each service gets its own schema).
        #[arg(long, default_value = "postgres://postgres@127.0.0.1:5432/test")]
        postgres: String,
        #[command(flatten)]
        bus: BusArgs,
    },
}

/// Where events travel (see `payments::Bus`).
#[derive(Debug, Clone, clap::Args)]
struct BusArgs {
    /// The broker: nats://host:port (NATS JetStream) or
    /// kafka://host:port[,host:port…] (Kafka). `--nats` is an older name
    /// for it.
    #[arg(long, alias = "nats", default_value = "nats://127.0.0.1:4222")]
    broker: String,
    /// NATS: the event stream.
    #[arg(long, default_value = "PAYMENTS")]
    stream: String,
    /// Subject prefix (NATS); topic prefix, `<prefix>.<aggregate_type>`
    /// (Kafka).
    #[arg(long, default_value = "idem")]
    prefix: String,
    /// Kafka: partitions of the topics created at start.
    #[arg(long, default_value_t = 6, value_parser = clap::value_parser!(i32).range(1..=10_000))]
    topic_partitions: i32,
    /// Kafka: replication factor of the topics created at start (1 fits
    /// a single broker; 3 survives losing one).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(i32).range(1..=100))]
    topic_replication: i32,
    /// Kafka: the Order service's consumer-group session timeout.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    session_timeout: Duration,
}

impl BusArgs {
    /// The bus these flags give; an error for a broker URL of another
    /// scheme.
    fn bus(&self) -> Result<payments::Bus, String> {
        let bus = payments::Bus {
            broker: self.broker.clone(),
            stream: self.stream.clone(),
            prefix: self.prefix.clone(),
            topics: idem_messaging::TopicSpec {
                partitions: self.topic_partitions,
                replication: self.topic_replication,
            },
            session_timeout: self.session_timeout,
        };
        bus.kind()?;
        Ok(bus)
    }
}

const PAYMENTS_DB: &str = "postgres://postgres@127.0.0.1:5432/test?schema=payments";
const ORDERS_DB: &str = "postgres://postgres@127.0.0.1:5432/test?schema=orders";

/// Ctrl-C or SIGTERM.
async fn shutdown() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = term => {}
    }
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
            orders,
            provider_timeout,
            lease,
            reconcile_every,
        } => {
            let mut config = ApiConfig::new(&database, &provider);
            config.orders = orders;
            config.provider_timeout = provider_timeout;
            config.lease = lease;
            run_api(listen, config, reconcile_every).await
        }
        Command::Orders {
            listen,
            database,
            bus,
        } => run_orders(listen, &database, &bus).await,
        Command::Relay { database, bus } => run_relay(&database, &bus).await,
        Command::All { postgres, bus } => run_all(&postgres, &bus).await,
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

async fn run_orders(listen: SocketAddr, database: &str, bus: &BusArgs) -> Result<(), String> {
    let bus = bus.bus()?;
    let orders = payments::orders::Orders::connect(database).await?;
    bus.ensure_destinations().await?;
    let (addr, task) = payments::serve(listen, orders.router(), shutdown()).await?;
    println!(
        "payments orders: listening on http://{addr}, consuming from {}",
        bus.describe()
    );
    let stats = bus.run_order_consumer(&orders, shutdown()).await?;
    tracing::info!(?stats, "consumer stopped");
    task.await.map_err(|e| e.to_string())
}

async fn run_relay(database: &str, bus: &BusArgs) -> Result<(), String> {
    let bus = bus.bus()?;
    println!("payments relay: publishing to {}", bus.describe());
    let stats = bus.run_relay(database, shutdown()).await?;
    println!(
        "payments relay: stopped after publishing {}",
        stats.published
    );
    Ok(())
}

/// `schema=NAME` on a PostgreSQL URL.
fn with_schema(postgres: &str, schema: &str) -> String {
    let sep = if postgres.contains('?') { '&' } else { '?' };
    format!("{postgres}{sep}schema={schema}")
}

async fn run_all(postgres: &str, bus: &BusArgs) -> Result<(), String> {
    let bus = bus.bus()?;
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let (payments_db, orders_db) = (
        with_schema(postgres, "payments"),
        with_schema(postgres, "orders"),
    );
    bus.ensure_destinations().await?;
    let with_bus = |mut args: Vec<String>| {
        args.extend(bus.to_args());
        args
    };
    let parts: [(&str, Vec<String>); 5] = [
        ("provider", vec!["provider".into()]),
        (
            "api",
            vec![
                "api".into(),
                "--database".into(),
                payments_db.clone(),
                "--orders".into(),
                "http://127.0.0.1:4001".into(),
            ],
        ),
        (
            "orders",
            with_bus(vec![
                "orders".into(),
                "--database".into(),
                orders_db.clone(),
            ]),
        ),
        (
            "relay (payments)",
            with_bus(vec!["relay".into(), "--database".into(), payments_db]),
        ),
        (
            "relay (orders)",
            with_bus(vec!["relay".into(), "--database".into(), orders_db]),
        ),
    ];
    let mut children = Vec::new();
    for (name, args) in parts {
        let child = tokio::process::Command::new(&me)
            .args(&args)
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start {name}: {e}"))?;
        children.push((name, child));
    }
    println!(
        "payments all: provider http://127.0.0.1:4100, Payment API http://127.0.0.1:4000, \
         Order service http://127.0.0.1:4001, relays to {}; Ctrl-C stops everything",
        bus.describe()
    );
    shutdown().await;
    for (_, child) in &mut children {
        let _ = child.start_kill();
    }
    for (_, mut child) in children {
        let _ = child.wait().await;
    }
    Ok(())
}

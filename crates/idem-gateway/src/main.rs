//! `idem`: Stripe-style `Idempotency-Key` handling in front of any HTTP API.
//!
//! ```text
//! idem serve --upstream http://127.0.0.1:3000        # the gateway
//! idem demo                                          # a retry storm, end to end
//! ```

use idem_gateway::{cli, config, demo, server};

/// mimalloc instead of the system allocator: the request path makes many
/// small short-lived allocations (see docs/BENCHMARKS.md, profiles).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

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
    /// Publish the PostgreSQL outbox to NATS JetStream, in order per
    /// aggregate; run several for availability.
    Relay(idem_gateway::relay::RelayArgs),
    /// Inspect the outbox; replay or discard dead rows.
    #[command(subcommand)]
    Outbox(idem_gateway::relay::OutboxCommand),
    /// Probe any HTTP endpoint from the outside: is it really idempotent?
    /// Exit 0 when every selected probe passes, 1 when one fails, 2 when
    /// the check cannot run.
    Check(CheckArgs),
}

#[derive(Debug, clap::Args)]
struct CheckArgs {
    /// The endpoint, e.g. http://127.0.0.1:8080/v1/payments (every request goes here, nowhere else).
    #[arg(long)]
    url: String,
    /// HTTP method.
    #[arg(long, default_value = "POST")]
    method: String,
    /// Request body, or @FILE.
    #[arg(long, default_value = "{}")]
    body: String,
    /// Extra header `name: value` (repeatable), e.g. the Authorization of a test account.
    #[arg(long = "header")]
    headers: Vec<String>,
    /// A second credential (an Authorization value) for the tenants probe.
    #[arg(long)]
    auth2: Option<String>,
    /// Top-level JSON field the reuse probe changes, e.g. amount_cents.
    #[arg(long)]
    vary_field: Option<String>,
    /// Copies the concurrent probe sends at once.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(2..=1000))]
    concurrency: u32,
    /// Probes to run: all, or a comma-separated list of retry, concurrent, reuse,
    /// equivalent-json, distinct-keys, missing-key, malformed-key, tenants.
    #[arg(long, default_value = "all")]
    probes: String,
    /// The endpoint must refuse requests without a key (missing-key probe).
    #[arg(long)]
    key_required: bool,
    /// JSON field of the answer holding the created resource's id (else the Location header).
    #[arg(long, default_value = "id")]
    id_field: String,
    /// PEM file of certificate authorities to trust for an https:// URL,
    /// besides the system's (a private CA).
    #[arg(long)]
    ca_file: Option<std::path::PathBuf>,
    /// Per-request timeout.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration)]
    timeout: std::time::Duration,
    /// The most requests the whole run may send.
    #[arg(long, default_value_t = 100)]
    max_requests: u32,
    /// Report format.
    #[arg(long, value_enum, default_value_t = CheckFormat::Text)]
    format: CheckFormat,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum CheckFormat {
    Text,
    Json,
    Junit,
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
        Command::Relay(args) => idem_gateway::relay::run(args).await,
        Command::Outbox(command) => idem_gateway::relay::outbox(command).await,
        Command::Check(args) => return check(args).await,
        Command::Cleanup(args) => {
            let run = async {
                let store = cli::open(&args.store.store).await?;
                cli::cleanup(
                    &store,
                    args.batch as usize,
                    args.max_seconds.map(std::time::Duration::from_secs),
                )
                .await
            };
            match run.await {
                // Interrupted: the conventional SIGINT status, so cron and
                // scripts can tell it did not finish.
                Ok(false) => return ExitCode::from(130),
                other => other.map(|_| ()),
            }
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("idem: {err}");
            ExitCode::FAILURE
        }
    }
}

async fn check(args: CheckArgs) -> ExitCode {
    use idem_gateway::check;
    let fail = |msg: String| {
        eprintln!("idem check: {msg}");
        ExitCode::from(2)
    };
    let url: http::Uri = match args.url.parse() {
        Ok(u) => u,
        Err(e) => return fail(format!("--url {}: not a URL ({e})", args.url)),
    };
    let Ok(method) = http::Method::from_bytes(args.method.to_ascii_uppercase().as_bytes()) else {
        return fail(format!("--method {}: not an HTTP method", args.method));
    };
    let body = match args.body.strip_prefix('@') {
        Some(path) => match std::fs::read(path) {
            Ok(b) => b,
            Err(e) => return fail(format!("--body @{path}: cannot read it: {e}")),
        },
        None => args.body.clone().into_bytes(),
    };
    let mut headers = http::HeaderMap::new();
    for h in &args.headers {
        let parsed = h.split_once(':').and_then(|(n, v)| {
            Some((
                http::HeaderName::from_bytes(n.trim().as_bytes()).ok()?,
                http::HeaderValue::from_str(v.trim()).ok()?,
            ))
        });
        match parsed {
            Some((n, v)) => {
                headers.append(n, v);
            }
            None => return fail(format!("--header {h:?}: expected `name: value`")),
        }
    }
    if !headers.contains_key(http::header::CONTENT_TYPE)
        && serde_json::from_slice::<serde_json::Value>(&body).is_ok()
    {
        headers.insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/json"),
        );
    }
    let second_auth = match args.auth2.as_deref().map(http::HeaderValue::from_str) {
        None => None,
        Some(Ok(v)) => Some(v),
        Some(Err(_)) => return fail("--auth2: not a valid header value".to_owned()),
    };
    let probes: Vec<check::Probe> = if args.probes.trim() == "all" {
        check::PROBES.to_vec()
    } else {
        let mut chosen = Vec::new();
        for name in args.probes.split(',') {
            match check::Probe::parse(name) {
                Some(p) => chosen.push(p),
                None => {
                    let names: Vec<&str> = check::PROBES.iter().map(|p| p.name()).collect();
                    return fail(format!(
                        "--probes: unknown probe {name:?}; known: all, {}",
                        names.join(", ")
                    ));
                }
            }
        }
        chosen.sort();
        chosen.dedup();
        chosen
    };
    let extra_roots = match &args.ca_file {
        Some(path) => match check::load_ca_file(path) {
            Ok(certs) => certs,
            Err(msg) => return fail(msg),
        },
        None => Vec::new(),
    };
    let target = check::Target {
        url: url.clone(),
        method,
        body: body.into(),
        headers,
        vary_field: args.vary_field,
        second_auth,
        concurrency: args.concurrency,
        key_required: args.key_required,
        id_field: args.id_field,
        timeout: args.timeout,
        max_requests: args.max_requests,
        extra_roots,
    };
    let explicit = args.probes.trim() != "all";
    if let Err(msg) = check::validate(&target, &probes, explicit) {
        return fail(msg);
    }
    let outcomes = check::run(target, &probes).await;
    let report = match args.format {
        CheckFormat::Text => check::text_report(&url, &outcomes),
        CheckFormat::Json => check::json_report(&url, &outcomes),
        CheckFormat::Junit => check::junit_report(&url, &outcomes),
    };
    print!("{report}");
    if !report.ends_with('\n') {
        println!();
    }
    ExitCode::from(check::exit_code(&outcomes))
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
        encryption_keys: config::encryption_keys_from_env(),
        hash_secret: config::hash_secret_from_env(),
    };
    let settings = config::load(args.config.as_deref(), &overrides).map_err(|e| e.to_string())?;
    let server = server::bind(&settings).await?;
    // Before the ready line: a signal right after it must stop us cleanly.
    let stop = server::shutdown_signal();
    let addr = server.local_addr().map_err(|e| e.to_string())?;
    let admin = server.admin_addr().map_err(|e| e.to_string())?;
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

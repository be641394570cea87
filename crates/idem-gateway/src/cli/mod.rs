//! The command line: one subcommand per file, behind one `Command` enum. Each
//! subcommand's arguments live with the code that runs it; this module
//! parses them, sets up logging and dispatches.

mod cleanup;
mod demo;
mod log_fields;
mod migrate;
mod openapi;
mod outbox;
mod records;
// A build without any broker keeps the command, which then refuses every
// `--broker` URL: the publishing half of the module goes unused.
#[cfg_attr(
    not(any(feature = "nats", feature = "rabbitmq", feature = "kafka")),
    allow(dead_code, unused_variables)
)]
mod relay;
mod serve;

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use crate::error::GatewayError;

pub use demo::DemoArgs;

/// idem makes retries safe: a retried request never repeats its side effect,
/// and the caller gets the original answer back.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about)]
pub struct Cli {
    /// Log format.
    #[arg(long, global = true, env = "IDEM_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Log filter: a level (error, warn, info, debug, trace, off), then
    /// TARGET=LEVEL exceptions, e.g. `info,idem_http=debug`. The NATS
    /// client's own reconnect lines show only when named
    /// (`info,async_nats=info`).
    /// [default: info; warn for `idem demo`, whose summary is its output]
    #[arg(long, global = true, env = "IDEM_LOG")]
    log: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gateway in front of an upstream.
    Serve(serve::ServeArgs),
    /// Start a toy payments upstream, the gateway in front of it on the
    /// embedded store, and a retry storm; print what happened.
    Demo(demo::DemoArgs),
    /// Create or upgrade the store's schema (PostgreSQL, MySQL, SQLite) and exit.
    Migrate(migrate::MigrateArgs),
    /// Inspect and act on idempotency records in a store.
    #[command(subcommand)]
    Records(records::RecordsCommand),
    /// Delete expired completed and failed records in batches (never
    /// processing ones); safe to interrupt and run again.
    Cleanup(cleanup::CleanupArgs),
    /// Publish the PostgreSQL outbox to a broker (NATS JetStream, RabbitMQ
    /// or Kafka), in order per aggregate; run several for availability.
    Relay(relay::RelayArgs),
    /// Print the configured routes' idempotency contract as an OpenAPI 3.1
    /// document (JSON), for SDK generators and API portals.
    Openapi(openapi::OpenapiArgs),
    /// Inspect the outbox; replay or discard dead rows.
    #[command(subcommand)]
    Outbox(outbox::OutboxCommand),
    /// Probe any HTTP endpoint from the outside: is it really idempotent?
    /// Exit 0 when every selected probe passes, 1 when one fails, 2 when
    /// the check cannot run.
    Check(idem_check::CheckArgs),
}

/// Parses the command line, sets up logging and runs the command; the
/// process's exit status comes back.
pub async fn main() -> ExitCode {
    let cli = Cli::parse();
    let quiet = matches!(cli.command, Command::Demo(_));
    let filter = cli
        .log
        .clone()
        .unwrap_or_else(|| if quiet { "warn" } else { "info" }.to_owned());
    // Traces are set up with the logs, so `[telemetry]` is read first.
    // `idem relay` exports its publish spans with the same exporter, when
    // given `--otlp-endpoint`.
    let traces = match &cli.command {
        Command::Serve(args) => {
            crate::config::telemetry_settings(args.config_file()).map_err(GatewayError::from)
        }
        Command::Relay(args) => args.telemetry(),
        _ => Ok(None),
    };
    let telemetry =
        match traces.and_then(|traces| init_logs(cli.log_format, &filter, traces.as_ref())) {
            Ok(telemetry) => telemetry,
            Err(err) => {
                eprintln!("idem: {}", crate::error::error_chain(&err));
                return ExitCode::from(2);
            }
        };
    let result = match cli.command {
        Command::Serve(args) => serve::run(args).await,
        Command::Demo(args) => demo::run(args).await,
        Command::Migrate(args) => migrate::run(args).await,
        Command::Openapi(args) => openapi::run(args),
        Command::Records(command) => records::run(command).await,
        Command::Relay(args) => relay::run(args).await,
        Command::Outbox(command) => outbox::run(command).await,
        Command::Check(args) => return idem_check::main(args).await,
        Command::Cleanup(args) => match cleanup::run(args).await {
            // Interrupted: the conventional SIGINT status, so cron and
            // scripts can tell it did not finish.
            Ok(false) => return ExitCode::from(130),
            other => other.map(|_| ()),
        },
    };
    // Flushes the traces still queued (built without `otel`, there are none).
    #[cfg_attr(
        not(feature = "otel"),
        expect(clippy::drop_non_drop, reason = "the guard flushes only with otel")
    )]
    drop(telemetry);
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("idem: {}", crate::error::error_chain(&err));
            ExitCode::FAILURE
        }
    }
}

/// Colour in log lines only on a terminal, and never with `NO_COLOR` set
/// to anything but the empty string (no-color.org): a redirected log file
/// gets no escape codes.
fn colour(terminal: bool, no_color: Option<std::ffi::OsString>) -> bool {
    terminal && no_color.is_none_or(|v| v.is_empty())
}

/// The log output (filtered by `--log`; the spans meant for traces are
/// never logged) and, with `[telemetry]`, the trace exporter, whose guard
/// is returned to be dropped at exit. Without traces the filter is the
/// subscriber's own, as it always was; with them it is the log output's
/// alone, so that `--log warn` does not silence the traces.
fn init_logs(
    format: LogFormat,
    filter: &str,
    traces: Option<&crate::config::TelemetrySettings>,
) -> Result<Option<crate::telemetry::Telemetry>, GatewayError> {
    use tracing_subscriber::Layer;
    use tracing_subscriber::filter::LevelFilter;
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    let targets = crate::config::log_filter(filter)
        .map_err(|why| GatewayError::Invalid(format!("--log / IDEM_LOG: {why}")))?
        .with_target(idem_http::trace::TARGET, LevelFilter::OFF);
    let Some(settings) = traces else {
        let registry = tracing_subscriber::registry().with(targets);
        match format {
            LogFormat::Text => registry.with(text_output()).init(),
            LogFormat::Json => registry.with(json_output()).init(),
        }
        return Ok(None);
    };
    let (exporter, guard) = crate::telemetry::install(settings)?;
    let registry = tracing_subscriber::registry().with(exporter);
    match format {
        LogFormat::Text => registry.with(text_output().with_filter(targets)).init(),
        LogFormat::Json => registry.with(json_output().with_filter(targets)).init(),
    }
    Ok(Some(guard))
}

/// Log lines as text on stderr.
fn text_output<S>() -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    tracing_subscriber::fmt::layer()
        .fmt_fields(log_fields::QuotedFields)
        .with_ansi(colour(
            std::io::stderr().is_terminal(),
            std::env::var_os("NO_COLOR"),
        ))
        .with_writer(std::io::stderr)
}

/// Log lines as JSON on stderr.
fn json_output<S>() -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    tracing_subscriber::fmt::layer()
        .json()
        .with_writer(std::io::stderr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(colour(true, None));
        assert!(colour(true, Some("".into())));
        assert!(!colour(true, Some("1".into())));
        assert!(!colour(false, None));
    }
}

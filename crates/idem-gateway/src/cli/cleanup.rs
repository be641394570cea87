//! `idem cleanup`: batched deletion of expired records.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use idem::{DynStore, operator};

use super::records::StoreArg;
use crate::error::GatewayError;

/// `idem cleanup` arguments.
#[derive(Debug, clap::Args)]
pub(super) struct CleanupArgs {
    #[command(flatten)]
    store: StoreArg,
    /// Records deleted per batch (on SQLite, in commits of 8 rows).
    #[arg(long, default_value_t = crate::config::defaults::CLEANUP_BATCH, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    batch: u32,
    /// Stop after this many seconds (the next run carries on).
    #[arg(long)]
    max_seconds: Option<u64>,
}

/// Opens the store and cleans it; `Ok(false)` when interrupted.
pub(super) async fn run(args: CleanupArgs) -> Result<bool, GatewayError> {
    let store = super::records::open(&args.store.store).await?;
    cleanup(
        &store,
        args.batch as usize,
        args.max_seconds.map(Duration::from_secs),
    )
    .await
}

/// `idem cleanup`: batched deletion of expired records with a progress
/// line on a terminal and a summary always. Stops cleanly on SIGINT or
/// SIGTERM after the batch in hand (each batch is its own transaction, so
/// nothing is half done) and says so. Returns whether it ran to the end
/// (false: interrupted).
async fn cleanup(
    store: &DynStore,
    batch: usize,
    max: Option<Duration>,
) -> Result<bool, GatewayError> {
    let started = Instant::now();
    let tty = std::io::stderr().is_terminal();
    let done = std::cell::Cell::new(0u64);
    let progress = |deleted: u64| {
        done.set(deleted);
        if tty {
            let rate = deleted as f64 / started.elapsed().as_secs_f64().max(0.001);
            eprint!("\ridem cleanup: {deleted} deleted ({rate:.0}/s)   ");
        }
    };
    let run = operator::cleanup(store, batch, max, progress);
    let (report, interrupted) = tokio::select! {
        report = run => (report?, false),
        () = crate::shutdown::shutdown_signal() => (operator::CleanupReport::default(), true),
    };
    if tty {
        eprintln!();
    }
    let secs = started.elapsed().as_secs_f64();
    if interrupted {
        println!(
            "idem cleanup: interrupted after {secs:.1}s with {} expired record(s) deleted; every finished batch is committed, run it again to continue",
            done.get()
        );
    } else {
        println!(
            "idem cleanup: deleted {} expired record(s) in {} batch(es) of up to {batch} in {secs:.1}s{}",
            report.deleted,
            report.batches,
            if report.stopped_early {
                " (stopped at --max-seconds; more may be left)"
            } else {
                ""
            }
        );
    }
    Ok(!interrupted)
}

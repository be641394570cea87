//! The fake payment service of `idem_testkit::ledger` as a process, for
//! `bench/retrying-clients`: it charges on every request (no
//! deduplication), drops its answer after charging on every
//! `--lost-every`-th, answers late on every `--slow-every`-th, and reports
//! its tally at `GET /v1/stats`.
//!
//! Usage: `ledger [--listen ADDR] [--lost-every N] [--slow-every N]
//! [--slow-ms MS]`. Prints `listening on ADDR` once ready.

use std::time::Duration;

use idem_testkit::ledger::{Ledger, Schedule};

fn main() {
    let mut listen = "127.0.0.1:0".to_owned();
    let mut faults = Schedule {
        lost_every: 10,
        slow_every: 5,
        slow_for: Duration::from_millis(1500),
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().unwrap_or_default();
        let number = || value.parse::<u64>().unwrap_or_else(|_| usage(&flag));
        match flag.as_str() {
            "--listen" => listen = value.clone(),
            "--lost-every" => faults.lost_every = number(),
            "--slow-every" => faults.slow_every = number(),
            "--slow-ms" => faults.slow_for = Duration::from_millis(number()),
            _ => usage(&flag),
        }
    }
    let addr = listen.parse().unwrap_or_else(|_| usage("--listen"));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let ledger = Ledger::start_on(addr, faults).await;
        println!("listening on {}", ledger.addr());
        std::future::pending::<()>().await;
    });
}

fn usage(flag: &str) -> ! {
    eprintln!(
        "ledger: bad {flag}; usage: ledger [--listen ADDR] [--lost-every N] [--slow-every N] [--slow-ms MS]"
    );
    std::process::exit(2)
}

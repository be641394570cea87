//! WAL checkpoints on a thread of their own.
//!
//! In WAL mode SQLite copies committed pages back into the database file
//! (a checkpoint) by default from inside the commit that crossed 1,000 WAL
//! pages — on our single writer thread, so every caller queued behind that
//! commit waited for the copy and its fsync of the database file. Measured
//! with 200,000 records stored: a serving p99 of 32 ms against 8–9 ms on an
//! empty store (docs/BENCHMARKS.md). Here a background connection runs a
//! `PASSIVE` checkpoint every few hundred milliseconds, which never blocks
//! the writer; the writer itself checkpoints only if the WAL outgrows
//! [`WRITER_FALLBACK_PAGES`] (the background fell behind).

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rusqlite::Connection;

/// WAL size (pages) at which the writer checkpoints by itself.
pub(crate) const WRITER_FALLBACK_PAGES: u32 = 20_000;

/// The running checkpoint thread; dropping it stops the thread.
#[derive(Debug)]
pub(crate) struct Checkpointer {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Checkpointer {
    /// Checkpoints through `conn` every `every` until dropped.
    pub(crate) fn spawn(conn: Connection, every: Duration) -> std::io::Result<Self> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let signal = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("idem-sqlite-checkpoint".to_owned())
            .spawn(move || {
                let (flag, wake) = &*signal;
                let mut stopped = flag.lock().unwrap_or_else(|p| p.into_inner());
                while !*stopped {
                    stopped = wake
                        .wait_timeout(stopped, every)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                    if *stopped {
                        break;
                    }
                    drop(stopped);
                    if let Err(err) =
                        conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
                    {
                        tracing::warn!(%err, "sqlite: background checkpoint failed");
                    }
                    stopped = flag.lock().unwrap_or_else(|p| p.into_inner());
                }
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        let (flag, wake) = &*self.stop;
        *flag.lock().unwrap_or_else(|p| p.into_inner()) = true;
        wake.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

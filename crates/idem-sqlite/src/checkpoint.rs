//! WAL checkpoints on a thread of their own, right behind the commits.
//!
//! In WAL mode SQLite copies committed pages back into the database file
//! (a checkpoint) by default from inside the commit that crossed 1,000 WAL
//! pages — on our single writer thread, so every caller queued behind that
//! commit waited for the copy and its fsync of the database file. Measured
//! with 200,000 records stored: a serving p99 of 32 ms against 8–9 ms on an
//! empty store (docs/BENCHMARKS.md). Here a background connection runs
//! `PASSIVE` checkpoints, which never block the writer; the writer itself
//! checkpoints only if the WAL outgrows [`WRITER_FALLBACK_PAGES`] (the
//! background fell behind).
//!
//! How often matters as much as where. Each checkpoint ends with an fsync
//! of the database file that carries every page copied since the last
//! one, and the WAL commits' own fsyncs queue behind it on the same disk.
//! Every 250 ms, under a cleanup that dirties many scattered pages, those
//! fsyncs took up to 60–80 ms and doubled the serving p99. So the writer
//! [`kick`](Kick::kick)s the checkpointer after each commit, and it runs at
//! most every [`MIN_GAP`]: small checkpoints, small fsyncs, and none at all
//! while the store is idle.

use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use rusqlite::Connection;

/// WAL size (pages) at which the writer checkpoints by itself.
pub(crate) const WRITER_FALLBACK_PAGES: u32 = 20_000;

/// Shortest time between two checkpoints while commits keep coming.
pub(crate) const MIN_GAP: Duration = Duration::from_millis(10);

#[derive(Debug, Default)]
struct State {
    /// Commits since the last checkpoint started.
    dirty: bool,
    stopped: bool,
}

type Shared = Arc<(Mutex<State>, Condvar)>;

/// Tells the checkpointer there is something new in the WAL.
#[derive(Debug, Clone)]
pub(crate) struct Kick(Shared);

impl Kick {
    /// After a commit: a checkpoint is due (within [`MIN_GAP`]).
    pub(crate) fn kick(&self) {
        let (state, wake) = &*self.0;
        let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
        if !s.dirty {
            s.dirty = true;
            wake.notify_one();
        }
    }
}

/// The running checkpoint thread; dropping it stops the thread.
#[derive(Debug)]
pub(crate) struct Checkpointer {
    shared: Shared,
    thread: Option<JoinHandle<()>>,
}

impl Checkpointer {
    /// Checkpoints through `conn` after each [`Kick::kick`], at most every
    /// `gap`, until dropped.
    pub(crate) fn spawn(conn: Connection, gap: Duration) -> std::io::Result<(Self, Kick)> {
        let shared: Shared = Arc::default();
        let signal = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("idem-sqlite-checkpoint".to_owned())
            .spawn(move || {
                let (state, wake) = &*signal;
                let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    while !s.dirty && !s.stopped {
                        s = wake.wait(s).unwrap_or_else(|p| p.into_inner());
                    }
                    if s.stopped {
                        break;
                    }
                    s.dirty = false;
                    drop(s);
                    if let Err(err) =
                        conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
                    {
                        tracing::warn!(%err, "sqlite: background checkpoint failed");
                    }
                    s = state.lock().unwrap_or_else(|p| p.into_inner());
                    // The gap: commits meanwhile only mark the next one due.
                    let until = std::time::Instant::now() + gap;
                    while !s.stopped {
                        let left = until.saturating_duration_since(std::time::Instant::now());
                        if left.is_zero() {
                            break;
                        }
                        s = wake
                            .wait_timeout(s, left)
                            .unwrap_or_else(|p| p.into_inner())
                            .0;
                    }
                }
            })?;
        let kick = Kick(Arc::clone(&shared));
        Ok((
            Self {
                shared,
                thread: Some(thread),
            },
            kick,
        ))
    }
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        let (state, wake) = &*self.shared;
        state.lock().unwrap_or_else(|p| p.into_inner()).stopped = true;
        wake.notify_all();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

//! WAL checkpoints on a thread of their own, right behind the commits.
//!
//! In WAL mode SQLite copies committed pages back into the database file (a
//! checkpoint) by default from inside the commit that crosses 1,000 WAL
//! pages — on our single writer thread, so every caller queued behind that
//! commit would wait for the copy and its fsync of the database file.
//! Measured with 200,000 records stored: a serving p99 of 32 ms against
//! 8–9 ms on an empty store (docs/BENCHMARKS.md#current-figures). Here a
//! background connection runs `PASSIVE` checkpoints, which never block the
//! writer; the writer itself checkpoints only if the WAL outgrows
//! [`WRITER_FALLBACK_PAGES`] (the background fell behind).
//!
//! How often matters as much as where. Each checkpoint syncs the WAL and
//! then the database file, and the commits' own syncs queue behind those
//! on the same disk:
//!
//! * too rarely, and one checkpoint carries many scattered pages: every
//!   250 ms under a cleanup, its fsyncs take 60–80 ms and double the
//!   serving p99 (docs/BENCHMARKS.md#current-figures);
//! * too often, and the checkpoints' syncs outnumber the commits': one
//!   caller at a time, a checkpoint every 10 ms adds about one fsync to
//!   every unique key's two, each waiting on the same disk
//!   (docs/BENCHMARKS.md#current-figures).
//!
//! So the pace follows the WAL, not the clock: the writer's WAL hook
//! counts the frames each commit appends ([`Kick::committed`]); a
//! checkpoint runs once [`DUE_FRAMES`] have piled up (and at most every
//! [`MIN_GAP`]), or once the writer has been quiet for [`IDLE`] with
//! anything uncopied. Small checkpoints under load, few of them for one
//! caller, and none while the store sits idle.

use std::ffi::c_int;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rusqlite::Connection;

/// WAL size (pages) at which the writer checkpoints by itself.
pub(crate) const WRITER_FALLBACK_PAGES: u32 = 20_000;

/// Shortest time between two checkpoints while commits keep coming.
pub(crate) const MIN_GAP: Duration = Duration::from_millis(10);

/// WAL frames appended since the last checkpoint that make the next one
/// due. Under load (64 connections, about a hundred frames a commit) this
/// is reached within [`MIN_GAP`], so the gap paces checkpoints; one caller
/// at a time (a few frames a key) reaches it every dozen or so keys. At
/// 1,000 (SQLite's own default) the checkpoints under load carry ten times
/// the scattered pages, and the serving p99 during a cleanup rises to
/// 1.51 × the p99 without (`bench/growth`: docs/BENCHMARKS.md#current-figures).
pub(crate) const DUE_FRAMES: u32 = 64;

/// How long the writer stays quiet before what it left in the WAL is
/// copied anyway.
pub(crate) const IDLE: Duration = Duration::from_millis(100);

#[derive(Debug, Default)]
struct State {
    /// Frames appended since the last checkpoint started.
    pending: u32,
    /// The WAL's size in frames after the latest commit.
    wal_frames: u32,
    /// When the latest commit appended to the WAL.
    last_commit: Option<Instant>,
    stopped: bool,
}

impl State {
    /// How long until a checkpoint is due: `Some(ZERO)` now, `None` when
    /// nothing waits to be copied. Checkpoints start at least `gap` apart;
    /// `last` is when the previous one started.
    fn due_in(&self, now: Instant, last: Option<Instant>, gap: Duration) -> Option<Duration> {
        if self.pending == 0 {
            return None;
        }
        let gap = last.map_or(Duration::ZERO, |at| {
            gap.saturating_sub(now.saturating_duration_since(at))
        });
        if self.pending >= DUE_FRAMES {
            return Some(gap);
        }
        let quiet = self
            .last_commit
            .map_or(Duration::ZERO, |at| now.saturating_duration_since(at));
        Some(IDLE.saturating_sub(quiet).max(gap))
    }
}

type Shared = Arc<(Mutex<State>, Condvar)>;

/// Tells the checkpointer what the commits appended to the WAL.
#[derive(Debug, Clone)]
pub(crate) struct Kick(Shared);

impl Kick {
    /// From the writer's WAL hook, after a commit: the WAL now holds
    /// `wal_frames` frames (fewer than before when the commit started the
    /// WAL over).
    pub(crate) fn committed(&self, wal_frames: u32) {
        let (state, wake) = &*self.0;
        let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
        let appended = if wal_frames > s.wal_frames {
            wal_frames - s.wal_frames
        } else {
            wal_frames
        };
        s.wal_frames = wal_frames;
        s.last_commit = Some(Instant::now());
        let was = s.pending;
        s.pending = s.pending.saturating_add(appended);
        // Wake the thread when there is a new deadline to set: the first
        // frames after a checkpoint, and when the frames make one due.
        if was == 0 || (was < DUE_FRAMES && s.pending >= DUE_FRAMES) {
            wake.notify_one();
        }
    }
}

/// Installs the writer's WAL hook: each commit tells `kick` the WAL's size,
/// and past [`WRITER_FALLBACK_PAGES`] the writer checkpoints by itself
/// (the hook takes the place of SQLite's own `wal_autocheckpoint`).
pub(crate) fn hook(conn: &mut Connection, kick: Kick) -> rusqlite::Result<()> {
    hook_at(conn, kick, WRITER_FALLBACK_PAGES)
}

/// [`hook`], with the writer's own checkpoint past `fallback_pages`.
///
/// The hook runs after the commit is durable, and SQLite turns an error
/// from it into an error of the statement that committed: every caller of
/// the batch would hear that its durable write failed. So a fallback
/// checkpoint that fails (`SQLITE_BUSY` while the checkpoint thread holds
/// the checkpoint lock, which is when the WAL is this long) is logged and
/// left to the next commit; the hook itself never fails.
fn hook_at(conn: &mut Connection, kick: Kick, fallback_pages: u32) -> rusqlite::Result<()> {
    conn.wal_hook(Some(
        move |wal: &mut rusqlite::hooks::Wal, frames: c_int| {
            let frames = u32::try_from(frames).unwrap_or(0);
            kick.committed(frames);
            if frames >= fallback_pages
                && let Err(err) = wal.checkpoint_v2(rusqlite::wal::CheckpointMode::PASSIVE)
            {
                tracing::debug!(%err, frames, "sqlite: the writer's own checkpoint did not run; the next commit tries again");
            }
            Ok(())
        },
    ))
}

/// The running checkpoint thread; dropping it stops the thread.
#[derive(Debug)]
pub(crate) struct Checkpointer {
    shared: Shared,
    thread: Option<JoinHandle<()>>,
}

impl Checkpointer {
    /// Checkpoints through `conn` as the WAL fills (see the module docs),
    /// at most every `gap`, until dropped.
    pub(crate) fn spawn(conn: Connection, gap: Duration) -> std::io::Result<(Self, Kick)> {
        let shared: Shared = Arc::default();
        let signal = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("idem-sqlite-checkpoint".to_owned())
            .spawn(move || {
                let (state, wake) = &*signal;
                let mut s = state.lock().unwrap_or_else(|p| p.into_inner());
                let mut last = None;
                loop {
                    if s.stopped {
                        break;
                    }
                    match s.due_in(Instant::now(), last, gap) {
                        None => s = wake.wait(s).unwrap_or_else(|p| p.into_inner()),
                        Some(wait) if !wait.is_zero() => {
                            s = wake
                                .wait_timeout(s, wait)
                                .unwrap_or_else(|p| p.into_inner())
                                .0;
                        }
                        Some(_) => {
                            s.pending = 0;
                            drop(s);
                            last = Some(Instant::now());
                            if let Err(err) =
                                conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()))
                            {
                                tracing::warn!(%err, "sqlite: background checkpoint failed");
                            }
                            s = state.lock().unwrap_or_else(|p| p.into_inner());
                        }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn kick() -> (Kick, Shared) {
        let shared: Shared = Arc::default();
        (Kick(Arc::clone(&shared)), shared)
    }

    fn due(shared: &Shared, now: Instant, last: Option<Instant>) -> Option<Duration> {
        let s = shared.0.lock().expect("state");
        s.due_in(now, last, MIN_GAP)
    }

    #[test]
    fn nothing_is_due_before_the_first_commit() {
        let (_, shared) = kick();
        assert_eq!(due(&shared, Instant::now(), None), None);
    }

    /// One caller at a time appends a few frames per commit; a checkpoint
    /// after each of them (every `MIN_GAP`) cost about one more fsync per
    /// unique key. Commits that keep coming wait for `DUE_FRAMES`.
    #[test]
    fn a_steady_trickle_of_commits_waits_for_due_frames() {
        let (kick, shared) = kick();
        let last = Some(Instant::now() - Duration::from_secs(1));
        let mut frames = 0;
        while frames + 5 < DUE_FRAMES {
            frames += 5;
            // Asked as of the commit: a stall of this thread in between
            // would otherwise eat into the idle time being checked.
            let now = Instant::now();
            kick.committed(frames);
            let wait = due(&shared, now, last).expect("frames pending");
            assert!(wait > IDLE / 2, "due after {frames} frames: {wait:?}");
        }
        kick.committed(frames + 5);
        assert_eq!(due(&shared, Instant::now(), last), Some(Duration::ZERO));
    }

    #[test]
    fn a_due_checkpoint_still_keeps_the_gap() {
        let (kick, shared) = kick();
        kick.committed(DUE_FRAMES);
        let now = Instant::now();
        let wait = due(&shared, now, Some(now)).expect("due");
        assert!(wait > Duration::ZERO && wait <= MIN_GAP, "{wait:?}");
    }

    #[test]
    fn a_quiet_writer_has_its_frames_copied_after_idle() {
        let (kick, shared) = kick();
        kick.committed(3);
        let then = Instant::now() + IDLE;
        assert_eq!(due(&shared, then, None), Some(Duration::ZERO));
    }

    /// The writer's own checkpoint meets the checkpoint lock held
    /// elsewhere (here a FULL checkpoint waiting for the writer's lock):
    /// it fails with `SQLITE_BUSY`, and the commit that ran the hook must
    /// still report the success it is: an error passed on by the hook makes
    /// SQLite report the durable commit as "SQL logic error" to every
    /// caller of its batch (docs/BENCHMARKS.md#current-figures).
    #[test]
    fn a_failed_fallback_checkpoint_does_not_fail_the_commit() {
        use std::sync::atomic::{AtomicBool, Ordering};
        static WAITING: AtomicBool = AtomicBool::new(false);
        fn busy(n: i32) -> bool {
            WAITING.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(1));
            n < 10_000
        }
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("hook.db");
        let mut writer = Connection::open(&path).expect("open");
        writer
            .execute_batch("PRAGMA journal_mode = WAL; CREATE TABLE t (x INTEGER)")
            .expect("schema");
        let (kick, _shared) = kick();
        hook_at(&mut writer, kick, 1).expect("hook");
        writer
            .execute_batch("BEGIN IMMEDIATE; INSERT INTO t VALUES (1)")
            .expect("write");
        let mut other = Connection::open(&path).expect("open");
        other.busy_handler(Some(busy)).expect("busy handler");
        let checkpoint = std::thread::spawn(move || {
            other.query_row("PRAGMA wal_checkpoint(FULL)", [], |r| r.get::<_, i64>(0))
        });
        while !WAITING.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        writer
            .execute_batch("COMMIT")
            .expect("the commit succeeded");
        let rows: i64 = writer
            .query_row("SELECT count(*) FROM t", [], |r| r.get(0))
            .expect("count");
        assert_eq!(rows, 1);
        checkpoint.join().expect("thread").expect("checkpoint");
    }

    /// A commit after a complete checkpoint starts the WAL over: its frame
    /// count drops, and all of it is new.
    #[test]
    fn a_restarted_wal_counts_from_its_start() {
        let (kick, shared) = kick();
        kick.committed(900);
        shared.0.lock().expect("state").pending = 0;
        kick.committed(4);
        assert_eq!(shared.0.lock().expect("state").pending, 4);
        kick.committed(10);
        assert_eq!(shared.0.lock().expect("state").pending, 10);
    }
}

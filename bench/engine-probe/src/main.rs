//! The embedded store's write work, done by SQLite and by fjall in one
//! process, one engine after the other, on the same disk.
//!
//! Each batch is one durable commit holding `B` operations: half of them
//! reserve a fresh key, half resolve a key reserved by an earlier batch
//! (at `B = 1` the batches alternate, as at one connection, where a key's
//! reservation and its resolution are committed apart). A key is one
//! reservation plus one resolution, the store work of one unique-key
//! request.
//!
//! * SQLite: the store's own table and indexes (`0001_records.sql`), its
//!   `INSERT … ON CONFLICT DO NOTHING` and fenced `UPDATE`, WAL with
//!   `synchronous=FULL`, one `BEGIN IMMEDIATE … COMMIT` per batch.
//! * fjall: the same record packed into one value under
//!   `tenant\0operation\0key`, and the two indexes the store needs (by
//!   creation, for listings; by expiry, for cleanup) as keyspaces of their
//!   own; a read of the record before each write (absent for a
//!   reservation, owner and attempt for a resolution); one write batch
//!   committed with `fdatasync` per batch.
//!
//! * append: the floor: the batch's records appended to a file and one
//!   `fdatasync`.
//!
//! Prints keys per second and the process's CPU (user + system, every
//! thread: SQLite's checkpoints, fjall's flushes and compactions) per key.
//!
//! * sqlite-wr: the same table `WITHOUT ROWID`, clustered on its key;
//!   sqlite-hk: its unique key a 16-byte hash of the names (see
//!   [`Layout`]).
//!
//! Keys come in order (`k-1-1`, `k-1-2`, …, as `bench/post.lua` makes
//! them), or with `PROBE_KEYS=random` in no order, as UUIDs would.
//!
//! ```sh
//! cargo run --release --manifest-path bench/engine-probe/Cargo.toml -- /tmp/engine-probe 4 1,6,20,44
//! PROBE_KEYS=random engine-probe /tmp/engine-probe 4 20,44 sqlite,sqlite-wr
//! ```

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fjall::{Database, KeyspaceCreateOptions, PersistMode};
use rusqlite::{Connection, params};

/// A tenant as the gateway stores it: the credential's keyed hash, 64 hex
/// digits.
const TENANT: &str = "7925faaac5fd9b69762654e8635863f0bf9001f7cd512428a0ecf845bcb84c5a";
const OPERATION: &str = "POST /v1/payments";
const HEADERS: &[u8] =
    b"content-type: application/json\r\nx-request-id: 0b6f5e1c-5d0e-4a4e-9b8f-2f1c3a4d5e6f\r\n";
const BODY: &[u8] = br#"{"id":"pay_000000000001","amount_cents":100,"currency":"EUR","status":"succeeded","payment_method_id":"pm_card_visa"}"#;

fn cpu() -> Duration {
    let mut usage = std::mem::MaybeUninit::<Rusage>::zeroed();
    // SAFETY: getrusage writes a `struct rusage` into the pointer.
    let usage = unsafe {
        getrusage(0, usage.as_mut_ptr());
        usage.assume_init()
    };
    let tv =
        |s: i64, us: i64| Duration::from_micros(u64::try_from(s * 1_000_000 + us).unwrap_or(0));
    tv(usage.utime_s, usage.utime_us) + tv(usage.stime_s, usage.stime_us)
}

/// The first four fields of `struct rusage` on 64-bit Linux, and room for
/// the rest.
#[repr(C)]
struct Rusage {
    utime_s: i64,
    utime_us: i64,
    stime_s: i64,
    stime_us: i64,
    rest: [i64; 14],
}

unsafe extern "C" {
    fn getrusage(who: i32, usage: *mut Rusage) -> i32;
}

/// One engine doing the store's writes.
trait Engine {
    /// Commits one batch: reservations of `fresh`, resolutions of `done`.
    fn batch(&mut self, fresh: &[String], done: &[String], now: i64);
}

/// How the probe lays out SQLite's records table.
#[derive(Clone, Copy, PartialEq)]
enum Layout {
    /// The store's own schema.
    Store,
    /// The same table clustered on its key: `PRIMARY KEY (tenant,
    /// operation, key) WITHOUT ROWID`, one B-tree for the row and its key
    /// instead of a table and a unique index.
    WithoutRowid,
    /// The unique key a 16-byte hash of (tenant, operation, key), and the
    /// listing indexes on `(created_at, id)`: index entries of some 30
    /// bytes instead of the names' 100 or so.
    HashedKey,
}

struct Sqlite(Connection, Layout);

/// The store's records table (its migrations, in order).
const RECORDS: &str = concat!(
    include_str!("../../../crates/idem-sqlite/migrations/0001_records.sql"),
    include_str!("../../../crates/idem-sqlite/migrations/0003_processing.sql"),
);

/// `text` with `from` replaced by `to`, which must be there.
fn swap(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "the migrations changed shape: {from}");
    text.replace(from, to)
}

impl Sqlite {
    fn open(dir: &Path, layout: Layout) -> Self {
        let conn = Connection::open(dir.join("probe.db")).unwrap();
        conn.query_row("PRAGMA journal_mode = WAL", [], |r| r.get::<_, String>(0))
            .unwrap();
        conn.pragma_update(None, "synchronous", "FULL").unwrap();
        let schema = match layout {
            Layout::Store => RECORDS.to_owned(),
            Layout::WithoutRowid => swap(
                RECORDS,
                "    UNIQUE (tenant, operation, key)\n);",
                "    PRIMARY KEY (tenant, operation, key)\n) WITHOUT ROWID;",
            ),
            Layout::HashedKey => swap(
                &swap(
                    RECORDS,
                    "    UNIQUE (tenant, operation, key)\n);",
                    "    id BLOB NOT NULL UNIQUE\n);",
                ),
                "(created_at, tenant, operation, key)",
                "(created_at, id)",
            ),
        };
        conn.execute_batch(&schema).unwrap();
        Self(conn, layout)
    }
}

/// A 16-byte name for (tenant, operation, key): FNV-1a, 128 bits (the
/// store would use a keyed hash; the probe needs only the bytes).
fn hashed(key: &str) -> [u8; 16] {
    let mut h: u128 = 0x6c62_272e_07bb_0142_62b8_2175_6295_c58d;
    for b in TENANT
        .bytes()
        .chain([0])
        .chain(OPERATION.bytes())
        .chain([0])
        .chain(key.bytes())
    {
        h ^= u128::from(b);
        h = h.wrapping_mul(0x0000_0000_0100_0000_0000_0000_0000_013b);
    }
    h.to_le_bytes()
}

impl Engine for Sqlite {
    fn batch(&mut self, fresh: &[String], done: &[String], now: i64) {
        let Self(conn, layout) = self;
        let hashed_key = *layout == Layout::HashedKey;
        conn.execute_batch("BEGIN IMMEDIATE").unwrap();
        for key in fresh {
            let (fp, owner) = ([7u8; 32], [9u8; 16]);
            let (expires, locked) = (now + 86_400_000, now + 30_000);
            let changed = if hashed_key {
                conn.prepare_cached(
                    "INSERT INTO idem_records \
                     (tenant, operation, key, fingerprint, state, created_at, updated_at, expires_at, \
                      locked_until, owner, attempt, id) \
                     VALUES (?1, ?2, ?3, ?4, 'processing', ?5, ?5, ?6, ?7, ?8, 1, ?9) \
                     ON CONFLICT (id) DO NOTHING",
                )
                .unwrap()
                .execute(params![TENANT, OPERATION, key, fp, now, expires, locked, owner, hashed(key)])
            } else {
                conn.prepare_cached(
                    "INSERT INTO idem_records \
                     (tenant, operation, key, fingerprint, state, created_at, updated_at, expires_at, \
                      locked_until, owner, attempt) \
                     VALUES (?1, ?2, ?3, ?4, 'processing', ?5, ?5, ?6, ?7, ?8, 1) \
                     ON CONFLICT (tenant, operation, key) DO NOTHING",
                )
                .unwrap()
                .execute(params![TENANT, OPERATION, key, fp, now, expires, locked, owner])
            };
            assert_eq!(changed.unwrap(), 1);
        }
        const SET: &str = "UPDATE idem_records SET \
             state = ?4, updated_at = ?5, expires_at = ?6, response_status = ?7, \
             response_headers = ?8, response_body = ?9, resource_id = ?10, error_code = ?11 ";
        for key in done {
            let (owner, expires) = ([9u8; 16], now + 86_400_000);
            let (resource, error) = ("pay_000000000001", None::<String>);
            let changed = if hashed_key {
                conn.prepare_cached(&format!(
                    "{SET} WHERE id = ?1 AND owner = ?2 AND attempt = ?3"
                ))
                .unwrap()
                .execute(params![
                    hashed(key),
                    owner,
                    1,
                    "completed",
                    now,
                    expires,
                    201,
                    HEADERS,
                    BODY,
                    resource,
                    error
                ])
            } else {
                conn.prepare_cached(&format!(
                    "{SET} WHERE tenant = ?12 AND operation = ?13 AND key = ?1 AND owner = ?2 \
                     AND attempt = ?3"
                ))
                .unwrap()
                .execute(params![
                    key,
                    owner,
                    1,
                    "completed",
                    now,
                    expires,
                    201,
                    HEADERS,
                    BODY,
                    resource,
                    error,
                    TENANT,
                    OPERATION
                ])
            };
            assert_eq!(changed.unwrap(), 1);
        }
        conn.execute_batch("COMMIT").unwrap();
    }
}

struct Fjall {
    db: Database,
    records: fjall::Keyspace,
    created: fjall::Keyspace,
    expiry: fjall::Keyspace,
}

impl Fjall {
    fn open(dir: &Path) -> Self {
        let db = Database::builder(dir.join("fjall")).open().unwrap();
        let records = db
            .keyspace("records", KeyspaceCreateOptions::default)
            .unwrap();
        let created = db
            .keyspace("created", KeyspaceCreateOptions::default)
            .unwrap();
        let expiry = db
            .keyspace("expiry", KeyspaceCreateOptions::default)
            .unwrap();
        Self {
            db,
            records,
            created,
            expiry,
        }
    }

    fn record_key(key: &str) -> Vec<u8> {
        [
            TENANT.as_bytes(),
            b"\0",
            OPERATION.as_bytes(),
            b"\0",
            key.as_bytes(),
        ]
        .concat()
    }

    fn time_key(at: i64, record: &[u8]) -> Vec<u8> {
        [&at.to_be_bytes()[..], record].concat()
    }
}

/// A record packed as the store would: fixed fields, then the answer.
fn packed(state: u8, now: i64, answer: Option<(&[u8], &[u8])>) -> Vec<u8> {
    let mut v = Vec::with_capacity(128 + answer.map_or(0, |(h, b)| h.len() + b.len()));
    v.push(state);
    v.extend_from_slice(&[7u8; 32]);
    v.extend_from_slice(&[9u8; 16]);
    for t in [now, now, now + 86_400_000, now + 30_000, 1] {
        v.extend_from_slice(&t.to_le_bytes());
    }
    if let Some((headers, body)) = answer {
        v.extend_from_slice(&201u16.to_le_bytes());
        for part in [headers, body, b"pay_000000000001".as_slice()] {
            v.extend_from_slice(&u32::try_from(part.len()).unwrap().to_le_bytes());
            v.extend_from_slice(part);
        }
    }
    v
}

impl Engine for Fjall {
    fn batch(&mut self, fresh: &[String], done: &[String], now: i64) {
        let mut batch = self.db.batch().durability(Some(PersistMode::SyncData));
        for key in fresh {
            let k = Self::record_key(key);
            assert!(self.records.get(&k).unwrap().is_none());
            batch.insert(&self.created, Self::time_key(now, &k), []);
            batch.insert(&self.records, k, packed(0, now, None));
        }
        for key in done {
            let k = Self::record_key(key);
            let old = self.records.get(&k).unwrap().expect("reserved");
            // The fence: owner and attempt as reserved.
            assert_eq!(&old[33..49], &[9u8; 16]);
            batch.insert(&self.expiry, Self::time_key(now + 86_400_000, &k), []);
            batch.insert(&self.records, k, packed(1, now, Some((HEADERS, BODY))));
        }
        batch.commit().unwrap();
    }
}

/// The floor: the batch's records appended to a file, then one
/// `fdatasync`; no index, no reads.
struct Append(std::fs::File);

impl Engine for Append {
    fn batch(&mut self, fresh: &[String], done: &[String], now: i64) {
        use std::io::Write;
        let mut out = Vec::new();
        for key in fresh {
            out.extend_from_slice(key.as_bytes());
            out.extend_from_slice(&packed(0, now, None));
        }
        for key in done {
            out.extend_from_slice(key.as_bytes());
            out.extend_from_slice(&packed(1, now, Some((HEADERS, BODY))));
        }
        self.0.write_all(&out).unwrap();
        self.0.sync_data().unwrap();
    }
}

/// Runs batches of `size` operations for `secs`; keys per second and CPU
/// per key.
fn run(engine: &mut dyn Engine, size: usize, secs: f64, tag: &str) -> (f64, f64) {
    let random_keys = std::env::var("PROBE_KEYS").is_ok_and(|k| k == "random");
    let half = (size / 2).max(1);
    let mut next = 0u64;
    let mut reserved: Vec<String> = Vec::new();
    let mut keys = 0u64;
    let (start, cpu0) = (Instant::now(), cpu());
    let mut turn = 0u64;
    while start.elapsed().as_secs_f64() < secs {
        let now = 1_764_800_000_000 + i64::try_from(start.elapsed().as_millis()).unwrap();
        // One operation per batch (size 1): reserve and resolve alternate.
        let (fresh_n, done_n) = if size == 1 {
            if turn.is_multiple_of(2) {
                (1, 0)
            } else {
                (0, 1)
            }
        } else {
            (half, half.min(reserved.len()))
        };
        turn += 1;
        let fresh: Vec<String> = (0..fresh_n)
            .map(|_| {
                next += 1;
                if random_keys {
                    format!("{tag}-{:016x}", mix(next))
                } else {
                    format!("{tag}-1-{next}")
                }
            })
            .collect();
        let done: Vec<String> = reserved.drain(..done_n).collect();
        engine.batch(&fresh, &done, now);
        keys += done.len() as u64;
        reserved.extend(fresh);
    }
    let wall = start.elapsed().as_secs_f64();
    let used = (cpu() - cpu0).as_secs_f64();
    (keys as f64 / wall, used / keys as f64 * 1e6)
}

/// splitmix64: keys in no order, as UUIDs from many clients arrive.
fn mix(n: u64) -> u64 {
    let mut z = n.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().unwrap_or_else(|| "/tmp/engine-probe".into()));
    let secs: f64 = args.next().map_or(5.0, |s| s.parse().unwrap());
    let sizes: Vec<usize> = args.next().map_or_else(
        || vec![1, 16, 64, 256],
        |s| s.split(',').map(|n| n.parse().unwrap()).collect(),
    );
    let engines: Vec<String> = args.next().map_or_else(
        || vec!["append".into(), "sqlite".into(), "fjall".into()],
        |s| s.split(',').map(str::to_owned).collect(),
    );
    println!(
        "{secs} s per point, batches of B operations (half reservations, half resolutions), one durable commit each"
    );
    println!(
        "{:<7} {:>5} {:>10} {:>12}",
        "engine", "B", "keys/s", "CPU µs/key"
    );
    for size in sizes {
        for name in &engines {
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            let mut engine: Box<dyn Engine> = match name.as_str() {
                "sqlite" => Box::new(Sqlite::open(&dir, Layout::Store)),
                "sqlite-wr" => Box::new(Sqlite::open(&dir, Layout::WithoutRowid)),
                "sqlite-hk" => Box::new(Sqlite::open(&dir, Layout::HashedKey)),
                "append" => Box::new(Append(std::fs::File::create(dir.join("log")).unwrap())),
                "fjall" => Box::new(Fjall::open(&dir)),
                other => panic!("no engine {other}: append, sqlite, sqlite-wr, sqlite-hk or fjall"),
            };
            // Warm: the files grow to their working size first.
            run(engine.as_mut(), size.max(16), secs.min(2.0), "warm");
            let (rate, cpu) = run(engine.as_mut(), size, secs, "k");
            println!("{name:<7} {size:>5} {rate:>10.0} {cpu:>12.1}");
            drop(engine);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

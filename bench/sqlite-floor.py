#!/usr/bin/env python3
"""SQLite's own floor for a unique key, run by bench/stores.sh.

The embedded store commits twice per key (the reservation, then the
answer). This times those two commits with the store's schema (its
migration file) and its statements, one client, WAL with
synchronous=FULL as the store opens it, and nothing else: no gateway, no
HTTP, no thread hand-offs. It is to the embedded store what pgbench's
reserve + complete is to PostgreSQL. Checkpoints run between pairs,
untimed, as the store runs them on a thread of its own; RESTART lets the
next commit write over the WAL's start instead of growing the file.

    bench/sqlite-floor.py DIR SECONDS crates/idem-sqlite/migrations/0001_records.sql

It uses Python's sqlite3 (the system library, whose version it prints),
not the one bundled into idem; both sync with fdatasync.
"""
import os, sqlite3, statistics, sys, time
# The statements as in crates/idem-sqlite/src/schema.rs (INSERT_NEW,
# RESOLVE); the pgbench scripts in bench/stores.sh copy PostgreSQL's alike.
d, seconds, migration = sys.argv[1], float(sys.argv[2]), sys.argv[3]
path = os.path.join(d, "idem-sqlite-floor.db")
for suffix in ("", "-wal", "-shm"):
    if os.path.exists(path + suffix):
        os.unlink(path + suffix)
db = sqlite3.connect(path, isolation_level=None)
db.execute("PRAGMA journal_mode = WAL")
db.execute("PRAGMA synchronous = FULL")
db.execute("PRAGMA wal_autocheckpoint = 0")
db.executescript(open(migration).read())
reserve = ("INSERT INTO idem_records (tenant, operation, key, fingerprint, state, created_at, "
           "updated_at, expires_at, locked_until, owner, attempt) "
           "VALUES (?1, ?2, ?3, ?4, 'processing', ?5, ?5, ?6, ?7, ?8, 1) "
           "ON CONFLICT (tenant, operation, key) DO NOTHING")
resolve = ("UPDATE idem_records SET state = ?6, updated_at = ?7, expires_at = ?8, "
           "response_status = ?9, response_headers = ?10, response_body = ?11, resource_id = ?12, "
           "error_code = ?13 WHERE tenant = ?1 AND operation = ?2 AND key = ?3 AND owner = ?4 AND attempt = ?5")
body = b'{"id":"pay_1","status":"succeeded","amount_cents":100}'
headers = b"\x00" * 48
pairs, end, i = [], time.monotonic() + seconds, 0
while time.monotonic() < end:
    i += 1
    key, now, owner = f"floor-{i}", int(time.time() * 1000), os.urandom(16)
    t = time.perf_counter()
    db.execute("BEGIN IMMEDIATE")
    db.execute(reserve, ("bench", "POST /v1/payments", key, os.urandom(32), now, now + 86_400_000, now + 30_000, owner))
    db.execute("COMMIT")
    db.execute("BEGIN IMMEDIATE")
    db.execute(resolve, ("bench", "POST /v1/payments", key, owner, 1, "completed", now, now + 86_400_000, 201, headers, body, "pay_1", None))
    db.execute("COMMIT")
    pairs.append(time.perf_counter() - t)
    if i % 200 == 0:
        db.execute("PRAGMA wal_checkpoint(RESTART)")
db.close()
for suffix in ("", "-wal", "-shm"):
    if os.path.exists(path + suffix):
        os.unlink(path + suffix)
pairs.sort()
print(f"sqlite commits pairs={len(pairs)} p50_ms={statistics.median(pairs) * 1000:.3f} "
      f"p99_ms={pairs[int(len(pairs) * 0.99)] * 1000:.3f} sqlite={sqlite3.sqlite_version}")

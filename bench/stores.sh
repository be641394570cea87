#!/usr/bin/env bash
# Raw limits of the shared stores, measured in the same run as idem's own
# store benchmarks, so idem's figures can be read against them.
#
#   pgbench        reserve (one INSERT ... ON CONFLICT DO NOTHING) and
#                  reserve-and-complete (that INSERT, then the UPDATE that
#                  records the answer) straight on idem_records, in a schema
#                  of its own (idem_bench_raw, dropped at the end);
#   mysqlslap      the same two on MySQL (MariaDB here): reserve (the
#                  INSERT) and reserve-and-complete (INSERT, then UPDATE),
#                  and the store's own insert + lease read + resolve
#                  statements at one client, on idem_records in a database
#                  of its own (idem_bench_raw, dropped at the end); each
#                  operation first draws its key (SET @k = UUID());
#   dynamodb       the DynamoDB emulator's own round trips (moto, from
#                  bench/dynamodb-floor.py): a conditional PutItem, then
#                  that and the conditional UpdateItem of the answer;
#   redis-benchmark SET key val NX EX 60 on random keys (database 9, keys
#                  expire by themselves);
#   cargo bench    idem-postgres and idem-redis `reserve` benches (criterion),
#                  unless SKIP_CARGO_BENCH=1.
#
#   fdatasync      the embedded store's floor: pairs of (small overwrite,
#                  fdatasync) in a file under FSYNC_DIR (default target/tmp:
#                  the disk the SQLite file lives on), as a unique key needs
#                  two durable commits;
#   sqlite commits the embedded store's own two commits per key, its schema
#                  and statements with nothing around them, in the same
#                  directory (bench/sqlite-floor.py).
#
# Servers: IDEM_TEST_PG_URL (default postgres://postgres@127.0.0.1:5432/test)
# and REDIS_HOST/REDIS_PORT (default 127.0.0.1:6379).
# MySQL: the local MariaDB as root (127.0.0.1:3306, no password).
# Knobs: SECONDS_PER_RUN (default 10), PG_CLIENTS (default "1 16 64 256";
# a count above the server's max_connections less 10 runs at that bound
# and says so), MYSQL_CLIENTS (default "1 16 64 256"), REDIS_CLIENTS
# (default "1 16 64 256"), DYNAMODB_CLIENTS (default "1 16 64"),
# SKIP_PG=1, SKIP_MYSQL=1, SKIP_DYNAMODB=1, SKIP_REDIS=1.
set -euo pipefail
cd "$(dirname "$0")/.."

PG_URL=${IDEM_TEST_PG_URL:-postgres://postgres@127.0.0.1:5432/test}
REDIS_HOST=${REDIS_HOST:-127.0.0.1}
REDIS_PORT=${REDIS_PORT:-6379}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-10}
PG_CLIENTS=${PG_CLIENTS:-"1 16 64 256"}
REDIS_CLIENTS=${REDIS_CLIENTS:-"1 16 64 256"}
MYSQL_CLIENTS=${MYSQL_CLIENTS:-"1 16 64 256"}
MYSQL=(mariadb -h 127.0.0.1 -P 3306 -u root)
MYSQL_DB=idem_bench_raw
FSYNC_DIR=${FSYNC_DIR:-target/tmp}
SCHEMA=idem_bench_raw

echo "== machine"
echo "load average at start: $(cut -d" " -f1-3 /proc/loadavg) (other work on the machine skews every figure)"
echo "cpus: $(nproc); $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
echo "memory: $(free -g | awk '/^Mem:/ {print $2 " GiB"}')"
echo "kernel: $(uname -r)"
if [ "${SKIP_PG:-0}" != 1 ]; then
  psql "$PG_URL" -Atc 'SELECT version()'
  psql "$PG_URL" -Atc 'SHOW max_connections' | sed 's/^/postgres max_connections: /'
  psql "$PG_URL" -Atc 'SHOW synchronous_commit' | sed 's/^/postgres synchronous_commit: /'
fi
if [ "${SKIP_MYSQL:-0}" != 1 ]; then
  "${MYSQL[@]}" -Ne "SELECT CONCAT('mysql: ', VERSION(), ', innodb_flush_log_at_trx_commit=', @@innodb_flush_log_at_trx_commit, ', log_bin=', @@log_bin)"
fi
if [ "${SKIP_REDIS:-0}" != 1 ]; then
  redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" INFO server | grep -E '^redis_version' | tr -d '\r'
  redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" CONFIG GET appendonly | paste -sd' '
fi
date -u

work=$(mktemp -d)
cleanup() {
  psql "$PG_URL" -qc "DROP SCHEMA IF EXISTS $SCHEMA CASCADE" >/dev/null 2>&1 || true
  "${MYSQL[@]}" -e "DROP DATABASE IF EXISTS $MYSQL_DB" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

echo
echo "== fdatasync in $FSYNC_DIR ($(df --output=source,fstype "$FSYNC_DIR" | tail -1 | tr -s ' '))"
mkdir -p "$FSYNC_DIR"
python3 - "$FSYNC_DIR" "$SECONDS_PER_RUN" <<'PY'
import os, statistics, sys, time
# A unique key commits twice (reserve, then the answer); each commit is a
# small write made durable. Overwrites in a preallocated file: the data's
# own sync, no file growth.
path = os.path.join(sys.argv[1], "idem-fsync-floor")
fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
os.pwrite(fd, b"\0" * 65536, 0)
os.fsync(fd)
pairs, end, i = [], time.monotonic() + min(float(sys.argv[2]), 5.0), 0
while time.monotonic() < end:
    t = time.perf_counter()
    for _ in range(2):
        os.pwrite(fd, os.urandom(200), (i % 256) * 256)
        os.fdatasync(fd)
        i += 1
    pairs.append(time.perf_counter() - t)
os.close(fd)
os.unlink(path)
pairs.sort()
print(f"fdatasync pairs={len(pairs)} p50_ms={statistics.median(pairs) * 1000:.3f} p99_ms={pairs[int(len(pairs) * 0.99)] * 1000:.3f}")
PY

echo
echo "== SQLite's own commits, reserve + resolve, one client, in $FSYNC_DIR"
python3 bench/sqlite-floor.py "$FSYNC_DIR" "$(( SECONDS_PER_RUN < 5 ? SECONDS_PER_RUN : 5 ))" \
  crates/idem-sqlite/migrations/0001_records.sql

if [ "${SKIP_PG:-0}" != 1 ]; then
echo
echo "== pgbench on idem_records (schema $SCHEMA)"
psql "$PG_URL" -qv ON_ERROR_STOP=1 <<SQL
SET client_min_messages = warning;
DROP SCHEMA IF EXISTS $SCHEMA CASCADE;
CREATE SCHEMA $SCHEMA;
SET search_path = $SCHEMA;
\i crates/idem-postgres/migrations/0001_records.sql
SQL

cat > "$work/reserve.sql" <<'SQL'
\set k random(1, 1000000000000)
INSERT INTO idem_records (tenant, operation, key, fingerprint, state, created_at,
                          updated_at, expires_at, locked_until, owner, attempt)
VALUES ('bench', 'POST /v1/payments', :client_id || '-' || :k,
        decode(repeat('ab', 32), 'hex'), 'processing', clock_timestamp(),
        clock_timestamp(), clock_timestamp() + interval '1 day',
        clock_timestamp() + interval '30 seconds', decode(repeat('cd', 16), 'hex'), 1)
ON CONFLICT (tenant, operation, key) DO NOTHING;
SQL
cat "$work/reserve.sql" > "$work/reserve_complete.sql"
cat >> "$work/reserve_complete.sql" <<'SQL'
UPDATE idem_records
SET state = 'completed', updated_at = clock_timestamp(),
    expires_at = clock_timestamp() + interval '1 day',
    response_status = 201, response_headers = '\x'::bytea, response_body = 'ok'::bytea
WHERE tenant = 'bench' AND operation = 'POST /v1/payments' AND key = :client_id || '-' || :k
  AND owner = decode(repeat('cd', 16), 'hex') AND attempt = 1;
SQL

bound=$(( $(psql "$PG_URL" -Atc 'SHOW max_connections') - 10 ))
# The store's own two statements (crates/idem-postgres/queries), their
# parameters filled in: the same work as the gateway's reserve and
# resolve at one client, where the scripts above are the plainest SQL
# that does it.
python3 - "$work/store_statements.sql" <<'PY'
import re, sys
def fill(path, vals):
    sql = open(path).read()
    return re.sub(r"\$(\d+)", lambda m: vals[int(m.group(1))], sql).rstrip().rstrip(";") + ";\n"
key = ":client_id || '-' || :k"
fp, owner = "decode(repeat('ab', 32), 'hex')", "decode(repeat('cd', 16), 'hex')"
scope = {1: "'bench'", 2: "'POST /v1/payments'", 3: key}
with open(sys.argv[1], "w") as out:
    out.write("\\set k random(1, 1000000000000)\n")
    out.write(fill("crates/idem-postgres/queries/reserve.sql",
                   {**scope, 4: fp, 5: owner, 6: "30000", 7: "86400000"}))
    out.write(fill("crates/idem-postgres/queries/resolve.sql",
                   {**scope, 4: owner, 5: "1", 6: "'completed'", 7: "86400000", 8: "201",
                    9: "'\\x'::bytea", 10: "'ok'::bytea", 11: "'pay_1'", 12: "NULL"}))
PY

pgpoint() { # script clients
  local script=$1 c=$2
  local j=$(( c < 2 ? 1 : 2 ))
  local ran=$(( c > bound ? bound : c ))
  rm -f "$work"/pglog*
  out=$(cd "$work" && PGOPTIONS="-c search_path=$SCHEMA" pgbench -n -M prepared -f "$work/$script.sql" \
          -c "$ran" -j "$j" -T "$SECONDS_PER_RUN" -l --log-prefix=pglog "$PG_URL" 2>&1)
  tps=$(awk -F'= ' '/^tps/ {split($2, a, " "); print a[1]}' <<<"$out")
  lat=$(awk -F'= ' '/^latency average/ {split($2, a, " "); print a[1]}' <<<"$out")
  # The median script latency (µs in the third column of -l's log): a
  # p50, like wrk's, where the average would be pulled up by the tail.
  p50=$(cat "$work"/pglog* | awk '{print $3}' | sort -n | awk '{v[NR] = $1} END {printf "%.3f", NR ? v[int((NR + 1) / 2)] / 1000 : 0}')
  note=""
  [ "$ran" != "$c" ] && note=" ran=$ran (max_connections less 10)"
  printf 'pgbench %-17s clients=%-4s tps=%s latency_ms=%s p50_ms=%s%s\n' "$script" "$c" "$tps" "$lat" "$p50" "$note"
}
for script in reserve reserve_complete; do
  for c in $PG_CLIENTS; do pgpoint "$script" "$c"; done
done
pgpoint store_statements 1
echo "pgbench command: PGOPTIONS='-c search_path=$SCHEMA' pgbench -n -M prepared -f <script> -c <clients> -j <1|2> -T $SECONDS_PER_RUN $PG_URL"
fi

if [ "${SKIP_MYSQL:-0}" != 1 ]; then
echo
echo "== mysqlslap on idem_records (database $MYSQL_DB)"
"${MYSQL[@]}" -e "DROP DATABASE IF EXISTS $MYSQL_DB; CREATE DATABASE $MYSQL_DB"
"${MYSQL[@]}" "$MYSQL_DB" < crates/idem-mysql/migrations/0001_records.sql

# One operation per line's statements, `;`-separated; @k is its key.
KEY="SET @k = UUID()"
INSERT="INSERT INTO idem_records (tenant, operation, idem_key, fingerprint, state, created_at, updated_at, expires_at, locked_until, owner, attempt) VALUES ('bench', 'POST /v1/payments', @k, UNHEX(REPEAT('ab', 32)), 'processing', UTC_TIMESTAMP(3), UTC_TIMESTAMP(3), UTC_TIMESTAMP(3) + INTERVAL 1 DAY, UTC_TIMESTAMP(3) + INTERVAL 30 SECOND, UNHEX(REPEAT('cd', 16)), 1)"
COMPLETE="UPDATE idem_records SET state = 'completed', updated_at = UTC_TIMESTAMP(3), expires_at = UTC_TIMESTAMP(3) + INTERVAL 1 DAY, response_status = 201, response_headers = '', response_body = 'ok' WHERE tenant = 'bench' AND operation = 'POST /v1/payments' AND idem_key = @k AND owner = UNHEX(REPEAT('cd', 16)) AND attempt = 1"
declare -A MYSQL_OP=(
  [reserve]="$KEY;$INSERT"
  [reserve_complete]="$KEY;$INSERT;$COMPLETE"
)
# The store's own statements (crates/idem-mysql/queries), their
# parameters filled in: insert, read of the lease, resolve.
MYSQL_OP[store_statements]=$(python3 - <<'PY'
import re
def fill(path, vals):
    sql = "\n".join(l for l in open(path).read().splitlines() if not l.lstrip().startswith("--"))
    it = iter(vals)
    return " ".join(re.sub(r"\?", lambda m: next(it), sql).split())
owner, fp, scope = "UNHEX(REPEAT('cd', 16))", "UNHEX(REPEAT('ab', 32))", ["'bench'", "'POST /v1/payments'", "@k"]
q = "crates/idem-mysql/queries/"
print(";".join([
    "SET @k = UUID()",
    fill(q + "insert.sql", scope + [fp, "86400000", "30000", owner]),
    fill(q + "read_lease.sql", scope + [owner, "1"]),
    fill(q + "resolve.sql", ["'completed'", "86400000", "201", "''", "'ok'", "'pay_1'", "NULL"] + scope + [owner, "1"]),
]))
PY
)

# mysqlslap runs a number of queries, not a time: a short run finds the
# rate, then the measured one runs about SECONDS_PER_RUN.
myslap() { # script clients operations-per-client
  mariadb-slap -h 127.0.0.1 -P 3306 -u root --create-schema="$MYSQL_DB" \
    --concurrency="$2" --iterations=1 --number-of-queries=$(( $2 * $3 * $4 )) \
    --delimiter=";" --query="${MYSQL_OP[$1]}" 2>&1 |
    awk '/Average number of seconds to run all queries/ {print $9}'
}
# A count above the server's max_connections less 10 runs at that bound
# and says so (mysqlslap's clients past the limit are refused, and it
# waits for them for ever).
mybound=$(( $("${MYSQL[@]}" -Ne 'SELECT @@max_connections') - 10 ))
mypoint() { # script clients
  local script=$1 asked=$2 per c note=""
  c=$(( asked > mybound ? mybound : asked ))
  [ "$c" != "$asked" ] && note=" ran=$c (max_connections less 10)"
  per=$(awk -F';' '{print NF}' <<<"${MYSQL_OP[$script]}")
  local probe=$(( c < 16 ? 200 : 20 ))
  local secs
  secs=$(myslap "$script" "$c" "$probe" "$per")
  local ops=$(awk -v s="$secs" -v n="$probe" -v t="$SECONDS_PER_RUN" 'BEGIN {r = n / (s > 0 ? s : 0.001); printf "%d", (r * t < n ? n : r * t)}')
  secs=$(myslap "$script" "$c" "$ops" "$per")
  awk -v s="$secs" -v n="$ops" -v c="$c" -v asked="$asked" -v name="$script" -v note="$note" \
    'BEGIN {printf "mysqlslap %-17s clients=%-4s tps=%.1f latency_ms=%.3f%s\n", name, asked, c * n / s, 1000 * s / n, note}'
}
for script in reserve reserve_complete; do
  for c in $MYSQL_CLIENTS; do mypoint "$script" "$c"; done
done
mypoint store_statements 1
echo "mysqlslap command: mariadb-slap --create-schema=$MYSQL_DB --concurrency=<clients> --iterations=1 --number-of-queries=<clients × operations × statements> --delimiter=';' --query='<SET @k = UUID(); the operation's statements>' (operations per client sized to about ${SECONDS_PER_RUN} s by a short first run; latency is the mean per operation)"
fi

if [ "${SKIP_REDIS:-0}" != 1 ]; then
echo
echo "== redis-benchmark SET key val NX EX 60 (database 9)"
for c in $REDIS_CLIENTS; do
  n=$(( c == 1 ? 50000 : 200000 ))
  redis-benchmark -h "$REDIS_HOST" -p "$REDIS_PORT" --dbnum 9 -q -n "$n" -c "$c" -r 1000000000 \
    SET 'idembench-raw:__rand_int__' v NX EX 60 \
    | tr '\r' '\n' | grep -E 'requests per second' | tail -1 | sed "s/^/clients=$c /"
done
echo "redis-benchmark command: redis-benchmark -h $REDIS_HOST -p $REDIS_PORT --dbnum 9 -q -n <50000|200000> -c <clients> -r 1000000000 SET idembench-raw:__rand_int__ v NX EX 60"
fi

if [ "${SKIP_DYNAMODB:-0}" != 1 ]; then
echo
echo "== the DynamoDB emulator's own round trips (bench/dynamodb-floor.py)"
# shellcheck disable=SC2086
python3 bench/dynamodb-floor.py "$SECONDS_PER_RUN" ${DYNAMODB_CLIENTS:-1 16 64}
fi

if [ "${SKIP_CARGO_BENCH:-0}" != 1 ]; then
  echo
  echo "== cargo bench -p idem-postgres --bench reserve"
  # (criterion's lines with % compare with an earlier run: left out)
  cargo bench -p idem-postgres --bench reserve 2>&1 | grep -E '^(reserve|engine_run)/|thrpt|SKIPPED' | grep -v '%'
  echo
  echo "== cargo bench -p idem-redis --bench reserve"
  cargo bench -p idem-redis --bench reserve 2>&1 | grep -E '^(reserve|engine_run)/|thrpt|SKIPPED|deleted' | grep -v '%'
fi

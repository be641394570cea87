#!/usr/bin/env bash
# Raw limits of the shared stores, measured in the same run as idem's own
# store benchmarks, so idem's figures can be read against them.
#
#   pgbench        reserve (one INSERT ... ON CONFLICT DO NOTHING) and
#                  reserve-and-complete (that INSERT, then the UPDATE that
#                  records the answer) straight on idem_records, in a schema
#                  of its own (idem_bench_raw, dropped at the end);
#   redis-benchmark SET key val NX EX 60 on random keys (database 9, keys
#                  expire by themselves);
#   cargo bench    idem-postgres and idem-redis `reserve` benches (criterion),
#                  unless SKIP_CARGO_BENCH=1.
#
# Servers: IDEM_TEST_PG_URL (default postgres://postgres@127.0.0.1:5432/test)
# and REDIS_HOST/REDIS_PORT (default 127.0.0.1:6379).
# Knobs: SECONDS_PER_RUN (default 10), PG_CLIENTS (default "1 16 64": the
# server's max_connections bounds it), REDIS_CLIENTS (default "1 16 256").
set -euo pipefail
cd "$(dirname "$0")/.."

PG_URL=${IDEM_TEST_PG_URL:-postgres://postgres@127.0.0.1:5432/test}
REDIS_HOST=${REDIS_HOST:-127.0.0.1}
REDIS_PORT=${REDIS_PORT:-6379}
SECONDS_PER_RUN=${SECONDS_PER_RUN:-10}
PG_CLIENTS=${PG_CLIENTS:-"1 16 64"}
REDIS_CLIENTS=${REDIS_CLIENTS:-"1 16 256"}
SCHEMA=idem_bench_raw

echo "== machine"
echo "load average at start: $(cut -d" " -f1-3 /proc/loadavg) (other work on the machine skews every figure)"
echo "cpus: $(nproc); $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
echo "memory: $(free -g | awk '/^Mem:/ {print $2 " GiB"}')"
echo "kernel: $(uname -r)"
psql "$PG_URL" -Atc 'SELECT version()'
psql "$PG_URL" -Atc 'SHOW max_connections' | sed 's/^/postgres max_connections: /'
psql "$PG_URL" -Atc 'SHOW synchronous_commit' | sed 's/^/postgres synchronous_commit: /'
redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" INFO server | grep -E '^redis_version' | tr -d '\r'
redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" CONFIG GET appendonly | paste -sd' '
date -u

work=$(mktemp -d)
cleanup() {
  psql "$PG_URL" -qc "DROP SCHEMA IF EXISTS $SCHEMA CASCADE" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

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

for script in reserve reserve_complete; do
  for c in $PG_CLIENTS; do
    j=$(( c < 2 ? 1 : 2 ))
    tps=$(PGOPTIONS="-c search_path=$SCHEMA" pgbench -n -M prepared -f "$work/$script.sql" \
            -c "$c" -j "$j" -T "$SECONDS_PER_RUN" "$PG_URL" 2>&1 \
          | awk -F'= ' '/^tps/ {split($2, a, " "); print a[1]}')
    printf 'pgbench %-17s clients=%-4s tps=%s\n' "$script" "$c" "$tps"
  done
done
echo "pgbench command: PGOPTIONS='-c search_path=$SCHEMA' pgbench -n -M prepared -f <script> -c <clients> -j <1|2> -T $SECONDS_PER_RUN $PG_URL"

echo
echo "== redis-benchmark SET key val NX EX 60 (database 9)"
for c in $REDIS_CLIENTS; do
  n=$(( c == 1 ? 50000 : 200000 ))
  redis-benchmark -h "$REDIS_HOST" -p "$REDIS_PORT" --dbnum 9 -q -n "$n" -c "$c" -r 1000000000 \
    SET 'idembench-raw:__rand_int__' v NX EX 60 \
    | tr '\r' '\n' | grep -E 'requests per second' | tail -1 | sed "s/^/clients=$c /"
done
echo "redis-benchmark command: redis-benchmark -h $REDIS_HOST -p $REDIS_PORT --dbnum 9 -q -n <50000|200000> -c <clients> -r 1000000000 SET idembench-raw:__rand_int__ v NX EX 60"

if [ "${SKIP_CARGO_BENCH:-0}" != 1 ]; then
  echo
  echo "== cargo bench -p idem-postgres --bench reserve"
  # (criterion's lines with % compare with an earlier run: left out)
  cargo bench -p idem-postgres --bench reserve 2>&1 | grep -E '^(reserve|engine_run)/|thrpt|SKIPPED' | grep -v '%'
  echo
  echo "== cargo bench -p idem-redis --bench reserve"
  cargo bench -p idem-redis --bench reserve 2>&1 | grep -E '^(reserve|engine_run)/|thrpt|SKIPPED|deleted' | grep -v '%'
fi

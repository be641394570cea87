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
    ("idem_pass_through", "idem serve, pass-through (no key)"),
    ("idem_unique_keys", "idem serve, unique keys, SQLite"),
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
        style = "--" if s in ("direct", "nginx") else "-"
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


def targets(present, data, conns):
    """The gateway targets of the performance issue that this run alone
    decides, one line each, with every connection count."""
    have = {s for s, _ in present}
    met = lambda ok: "met" if ok else "not met"
    out = []
    for s, name, want in (
        ("idem_unique_keys", "Embedded unique keys", 0.9),
        ("idem_replays", "Embedded replays", 1.5),
    ):
        if s in have and "nginx" in have:
            cells = []
            for c in conns:
                r = data[(s, c)]["rps"] / data[("nginx", c)]["rps"]
                cells.append(f"{c} conn {r:.2f}× ({met(r >= want)})")
            out.append(f"{name} (target ≥ {want} × nginx): " + ", ".join(cells) + ".")
    # Added latency: p50 through the gateway minus p50 straight to the
    # upstream, against the same difference for nginx. At one connection
    # it is the path's own latency; with more, queueing behind the
    # throughput limit dominates.
    if {"direct", "nginx"} <= have:
        for s, name in (("idem_pass_through", "pass-through"), ("idem_unique_keys", "unique keys, SQLite")):
            if s not in have:
                continue
            cells = []
            for c in conns:
                base = data[("direct", c)]["p50"]
                ours = data[(s, c)]["p50"] - base
                theirs = data[("nginx", c)]["p50"] - base
                verdict = met(ours <= 2 * theirs)
                ratio = f"{ours / theirs:.1f}×" if theirs > 0 else "n/a"
                cells.append(f"{c} conn +{ours * 1000:.0f} µs vs nginx +{theirs * 1000:.0f} µs ({ratio}, {verdict})")
            out.append(f"Added p50 over direct, {name} (target ≤ 2 × nginx's): " + ", ".join(cells) + ".")
    return out + ([""] if out else [])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", required=True)
    ap.add_argument("--rss-kb", type=int, required=True)
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
    lines += ["", f"Peak RSS of `idem serve` (SQLite) over the whole run (VmHWM): {a.rss_kb / 1024:.1f} MiB.", ""]
    lines += targets(present, data, conns)
    stores = os.path.join(a.results, "stores.txt")
    if os.path.exists(stores):
        raw = open(stores).read()
        lines += ["Raw store limits measured right after, on the same machine (`bench/stores.sh`):", "", "```", raw.strip(), "```", ""]
        tps = {m.group(1) + "/" + m.group(2): float(m.group(3)) for m in re.finditer(r"pgbench (\S+)\s+clients=(\d+)\s+tps=([\d.]+)", raw)}
        best = max((v for k, v in tps.items() if k.startswith("reserve/")), default=None)
        pairs = max((v for k, v in tps.items() if k.startswith("reserve_complete/")), default=None)
        if best and pairs and any(s == "idem_unique_keys_postgres" for s, _ in present):
            gw = max(data[("idem_unique_keys_postgres", c)]["rps"] for c in conns)
            met = lambda ok: "met" if ok else "not met"
            lines.append(
                f"PostgreSQL target, as the shared-stores issue puts it: gateway unique keys {gw:,.0f} req/s vs "
                f"0.7 × (best pgbench reserve {best:,.0f} tps ÷ 2) = {0.35 * best:,.0f}: "
                f"**{met(gw >= 0.35 * best)}** ({gw / (best / 2):.2f} × the half-rate); as the performance issue "
                f"puts it: vs 0.7 × best pgbench reserve-and-complete {pairs:,.0f} tps = {0.7 * pairs:,.0f}: "
                f"**{met(gw >= 0.7 * pairs)}** ({gw / pairs:.2f} × that rate)."
            )
        if any(s == "idem_unique_keys_redis" for s, _ in present):
            redis = {c: data[("idem_unique_keys_redis", c)]["rps"] / data[("nginx", c)]["rps"] for c in conns}
            lines.append("Redis target (unique keys ≥ 0.5 × nginx): " + ", ".join(f"{c} conn {r:.2f}×" for c, r in redis.items()) + ".")
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

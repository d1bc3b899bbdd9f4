"""Time to normal (`make bench-normal`): how long an application's reads stay slow after a restore, with
no hydration, the published recipe, pghydrate without a captured hot set (with and without naming the
application's table in --first), and pghydrate with one.

The workload: the benchmark's skewed database (scripts/bench.py) on the lazy-volume simulator (sim/);
pgbench clients look up rows of the big table by primary key. Keys follow a Zipfian distribution
(`random_zipfian(1, rows, --zipf)`) counted from the newest row down, as an application reads recent data
most: the hot rows are the last blocks of the heap and the right-most leaves of its index, a small part of
the database. `--keys scattered` spreads the same skew over the table (pgbench's permute()): hot rows
with no locality. `--keys old` counts the same skew up from a third into the table: a hot set that is
neither the newest data nor the whole table (an old partition, a customer's rows loaded long ago), the
case where only a captured hot set knows what to read first.

The workload is open-loop, as an application's requests are: pgbench --rate schedules --rate transactions
a second across --clients connections whether or not the server keeps up, and each transaction's latency
counts from its scheduled start, so a client held up by a cold read makes the requests queued behind it
late too. (A closed loop hides this: while one client waits 50 ms for a cold fetch, the others complete
thousands of cached lookups, and the p95 of a second looks normal however many reads were cold.)

1. On the loaded (local, fast) volume the workload runs closed-loop for --warmup seconds, and `pghydrate
   capture` stores what shared buffers then hold. The open-loop workload on that fully hydrated volume, from
   a restarted server, gives the baseline p95 (median of its windows).
2. Per strategy (--repeat times): restore (server stopped, volume remounted cold, server started), then
   the workload and the strategy start together. The p95 latency of the transactions scheduled in each
   --window (1 s) is recorded, smoothed by a rolling median of 3 windows: the hydrated volume itself shows
   isolated one-window spikes (2 cores shared by pgbench, PostgreSQL and the simulator), which are not a
   relapse. "Time to normal" is the start of the first window from which every later (smoothed) window's
   p95 stays within 1.5x the baseline's. With a sub-millisecond baseline, 1.5x is also within the CPU
   noise of a hydration still running beside the workload, while one cold read costs the volume's latency
   (50 ms); so the table also gives the time to normal with a floor (--floor-ms, default a tenth of the
   fetch latency): p95 within max(1.5x baseline, floor), i.e. cold reads no longer reach the p95.

Writes bench/normal.json and bench/normal.svg (p95 over time) and prints the table. Needs root (FUSE; the
server runs as the pghydrate user).

    python3 scripts/bench-normal.py [--major 15] [--seconds 60] [--latency 50ms] [--concurrency 4]
                                    [--rate 200] [--clients 32] [--zipf 1.2] [--repeat 1] [--scale 2000]
                                    [--keys newest|scattered|old] [--compare-bin LABEL=PATH] [--only TEXT,...]
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import bench  # noqa: E402
PASSWORD = bench.PASSWORD


def workload_script(path: Path, rows: int, zipf: float, keys: str = "newest"):
    """Zipfian keys counted from the newest row down ("newest"), scattered over the whole table by
    pgbench's permute() ("scattered": the same skew, no locality: hot rows anywhere in the heap), or
    counted up from a third into the table ("old": hot rows in the middle of the heap)."""
    key = {
        "newest": f"{rows} + 1 - :r",
        "scattered": f"permute(:r - 1, {rows}) + 1",
        "old": f"(:r - 1 + {rows // 3}) % {rows} + 1",
    }[keys]
    path.write_text(f"\\set r random_zipfian(1, {rows}, {zipf})\n\\set k {key}\n"
                    "SELECT a, b FROM big WHERE id = :k;\n")


def run_workload(b, seconds: int, clients: int, script: Path, tag: str, rate: int = 0):
    """pgbench for `seconds` (open-loop at `rate` tx/s when rate > 0); returns [(scheduled start epoch
    seconds, latency ms)] of every transaction (with --rate, latency counts from the scheduled start)."""
    logdir = b.workdir / f"pgbench-{tag}"
    logdir.mkdir(exist_ok=True)
    os.chown(logdir, *_uid_gid())
    for f in logdir.glob("tx*"):
        f.unlink()
    env = dict(os.environ, PGPASSWORD=PASSWORD)
    cmd = [str(b.pg.bin / "pgbench"), "-n", "-h", "127.0.0.1", "-p", str(b.pg.port), "-U", "postgres",
           "-c", str(clients), "-j", str(min(clients, 2)), "-T", str(seconds), "-f", str(script),
           "-l", "--log-prefix", str(logdir / "tx"), "app"]
    if rate:
        cmd[1:1] = ["--rate", str(rate)]
    subprocess.run(cmd, env=env, cwd=logdir, check=True, capture_output=True, text=True)
    out = []
    for f in logdir.glob("tx*"):
        for line in f.read_text().split("\n"):
            p = line.split()
            if len(p) >= 6 and p[2] != "skipped":
                done = int(p[4]) + int(p[5]) / 1e6
                ms = int(p[2]) / 1000.0
                out.append((done - ms / 1000.0, ms))
    return out


class CpuSampler:
    """Share of the machine's CPU time busy (not idle or iowait), per second, from /proc/stat."""
    def __init__(self):
        self.busy = []
        self._stop = threading.Event()
        self._th = threading.Thread(target=self._run, daemon=True)
        self._th.start()

    @staticmethod
    def _read():
        v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
        return sum(v), v[3] + v[4]

    def _run(self):
        total, idle = self._read()
        while not self._stop.wait(1.0):
            t, i = self._read()
            self.busy.append(round(1 - (i - idle) / max(t - total, 1), 3))
            total, idle = t, i

    def stop(self):
        self._stop.set()
        self._th.join()
        return self.busy


def _uid_gid():
    import pwd
    pw = pwd.getpwnam(bench.RUN_AS)
    return pw.pw_uid, pw.pw_gid


def p95_per_window(tx, start: float, seconds: int, window: float):
    n = int(seconds / window)
    buckets = [[] for _ in range(n)]
    for t, ms in tx:
        i = int((t - start) / window)
        if 0 <= i < n:
            buckets[i].append(ms)
    return [round(statistics.quantiles(b, n=20)[18], 3) if len(b) >= 20 else (max(b) if b else None)
            for b in buckets]


def smoothed(p95s):
    """Rolling median of 3 windows (None where a window had no transaction)."""
    out = []
    for i in range(len(p95s)):
        near = [v for v in p95s[max(0, i - 1):i + 2] if v is not None]
        out.append(statistics.median(near) if p95s[i] is not None and near else None)
    return out


def time_to_normal(p95s, limit: float, window: float):
    """Start (s) of the first window from which every later window's p95 is <= limit (None: never)."""
    normal_from = None
    for i, v in enumerate(p95s):
        ok = v is not None and v <= limit
        if ok and normal_from is None:
            normal_from = i
        elif not ok:
            normal_from = None
    return None if normal_from is None else round(normal_from * window, 3)


def svg(results: dict, path: Path):
    """p95 latency (log scale) over time, one line per strategy (its median run)."""
    colors = ["#7f7f7f", "#d62728", "#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"]
    w, h, left, top, pw, ph = 900, 420, 60, 30, 600, 340
    window = results["parameters"]["window"]
    tmax = results["parameters"]["seconds"]
    lo, hi = 0.1, 10000.0
    def y(v):
        v = min(max(v, lo), hi)
        return top + ph - ph * (math.log10(v) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>',
           f'<text x="{left}" y="{top - 10}" font-size="14">p95 latency (ms, log) of each {window} s window after the '
           f'restore; dashed: normal (1.5x baseline, floor)</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>']
    for v in (0.1, 1, 10, 100, 1000, 10000):
        out.append(f'<text x="{left - 45}" y="{y(v) + 4}">{v:g}</text>')
    for k in range(7):
        t = tmax * k / 6
        out.append(f'<text x="{left + pw * k / 6 - 8}" y="{top + ph + 16}">{t:.0f}</text>')
    ly = y(results["normal_limit_ms"])
    out.append(f'<line x1="{left}" y1="{ly:.1f}" x2="{left + pw}" y2="{ly:.1f}" stroke="#000" stroke-dasharray="4 3"/>')
    for i, (name, r) in enumerate(results["strategies"].items()):
        c = colors[i % len(colors)]
        pts = " ".join(f"{left + pw * (j + 0.5) * window / tmax:.1f},{y(v):.1f}"
                       for j, v in enumerate(r["p95"]) if v is not None)
        out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{pts}"/>')
        out.append(f'<text x="{left + pw + 10}" y="{top + 14 + 16 * i}" fill="{c}">{name}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out))


def main():
    bench.cleanup_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--major", type=int, default=15)
    ap.add_argument("--scale", type=float, default=2000, help="approximate MiB of the big table")
    ap.add_argument("--small", type=int, default=300)
    ap.add_argument("--latency", default="50ms")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seconds", type=int, default=90)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rate", type=int, default=200, help="transactions a second, all clients together")
    ap.add_argument("--zipf", type=float, default=1.2)
    ap.add_argument("--keys", choices=("newest", "scattered", "old"), default="newest",
                    help="hot keys from the newest row down, scattered over the table (permute), or counted "
                         "up from a third into it")
    ap.add_argument("--window", type=float, default=1.0, help="seconds per p95 window")
    ap.add_argument("--floor-ms", type=float, default=0.0, help="default: a tenth of --latency")
    ap.add_argument("--repeat", type=int, default=1, help="runs per strategy; the table shows the median")
    ap.add_argument("--fuse-threads", type=int, default=128,
                    help="the simulator's FUSE worker threads (requests it serves at once, hot or cold)")
    ap.add_argument("--extra", action="append", default=[],
                    help="one more pghydrate strategy with these options, e.g. \"--sessions 4\" (repeatable)")
    ap.add_argument("--compare-bin", action="append", default=[], metavar="LABEL=PATH",
                    help="also run every pghydrate strategy with this other build, named [LABEL] (repeatable)")
    ap.add_argument("--only", default="", help="comma-separated texts: run the strategies whose name has one")
    ap.add_argument("--out", default=str(ROOT / "bench" / "normal.json"))
    args = ap.parse_args()
    if not args.floor_ms:
        args.floor_ms = bench.parse_ms(args.latency) / 10
    if os.geteuid() != 0:
        raise SystemExit("bench-normal: needs root (FUSE mount; the server runs as the pghydrate user)")
    subprocess.run(["cargo", "build", "--release", "--locked", "-p", "pghydrate-cli", "-p", "pghydrate-lazyvol"],
                   cwd=ROOT, check=True, env=dict(os.environ, CARGO_TARGET_DIR=str(bench.TARGET)))
    vol_args = argparse.Namespace(scale=args.scale, small=args.small, latency=args.latency,
                                  concurrency=args.concurrency, bandwidth_mib=0.0, iops=0.0, throughput_mib=0.0,
                                  burst_seconds="0s", burst_iops=0.0, burst_throughput_mib=0.0,
                                  latency_jitter="0ms", seed=1, limit=args.seconds, recipe_limit=args.seconds,
                                  fuse_threads=args.fuse_threads)
    compare = bench.compare_bins(args.compare_bin)
    b = bench.Bench(args.major, vol_args)
    results = {"parameters": vars(args), "strategies": {}}
    try:
        info = b.load()
        rows = int(b.pg.psql("SELECT max(id) FROM big", db="app"))
        script = b.workdir / "zipf.sql"
        workload_script(script, rows, args.zipf, args.keys)
        os.chown(script, *_uid_gid())
        b.pg.psql("CREATE EXTENSION IF NOT EXISTS pg_buffercache")
        # 1. The source: the workload warms shared buffers; capture what they hold. Then the baseline.
        b.pg.stop()
        b.pg.start()
        run_workload(b, args.warmup, args.clients, script, "warmup")
        cap = subprocess.run([str(bench.PGHYDRATE), "capture", "--json", "--include-database", "app", b.url,
                              "--tls", "disable"], check=True, capture_output=True, text=True)
        captured = json.loads(cap.stdout)
        d = captured["databases"][0]
        hot_bytes = d["blocks"] * 8192
        print(f"bench-normal: captured {d['ranges']} ranges, {hot_bytes / 2**20:.1f} MiB "
              f"({d['buffers']} buffers) in {captured['seconds']:.2f} s", flush=True)
        b.pg.stop()
        b.pg.start()
        start = time.time()
        tx = run_workload(b, args.seconds, args.clients, script, "baseline", args.rate)
        base = smoothed(p95_per_window(tx, start, args.seconds, args.window))
        baseline = statistics.median([v for v in base if v is not None])
        limit = 1.5 * baseline
        floor_limit = max(limit, args.floor_ms)
        rate_mib = args.concurrency * 0.5 / (bench.parse_ms(args.latency) / 1000)
        print(f"bench-normal: hydrated baseline p95 {baseline:.2f} ms ({len(tx) / args.seconds:.0f} tx/s); "
              f"volume {rate_mib:.0f} MiB/s: the hot set alone takes {hot_bytes / 2**20 / rate_mib:.2f} s", flush=True)
        results.update(database=info, capture=captured, hot_bytes=hot_bytes, baseline_p95_ms=baseline,
                       baseline_p95=base, normal_limit_ms=limit, floor_limit_ms=floor_limit,
                       volume_mib_per_s=rate_mib, hot_set_seconds=hot_bytes / 2**20 / rate_mib)

        def ph(name, *opts):  # a pghydrate strategy, and the same with each --compare-bin build
            return {name: lambda: b.pghydrate(*opts), **{
                f"{name} [{label}]": (lambda path=path: b.pghydrate(*opts, binary=path)) for label, path in compare}}
        strategies = {
            "lazy loading only": None,
            "published recipe": lambda: b.recipe(),
            **ph("pghydrate --no-hot-set", "--no-hot-set"),
            **ph("pghydrate --no-hot-set --first big", "--no-hot-set", "--first", "big"),
            **ph("pghydrate (captured hot set)"),
        }
        for extra in args.extra:
            strategies.update(ph(f"pghydrate {extra} (captured hot set)", *extra.split()))
        only = [s.strip() for s in args.only.split(",") if s.strip()]
        for name, strategy in strategies.items():
            if only and not any(o in name for o in only):
                continue
            tries = []
            for i in range(args.repeat):
                status = b.cold()
                start = time.time()
                got = {}
                th = None
                if strategy is not None:
                    def run_strategy():
                        try:
                            got.update(strategy())
                        except Exception as e:  # noqa: BLE001 - reported after the workload, then raised
                            got["error"] = e
                    th = threading.Thread(target=run_strategy, daemon=True)
                    th.start()
                tag = "".join(c if c.isalnum() else "-" for c in name) + f"-{i}"
                cpu = CpuSampler()
                tx = run_workload(b, args.seconds, args.clients, script, tag, args.rate)
                cpu_busy = cpu.stop()
                if th is not None:
                    th.join()
                if "error" in got:  # a strategy that did not run must not be reported as if it had
                    raise RuntimeError(f"{name}: {got['error']}")
                p95 = smoothed(p95_per_window(tx, start, args.seconds, args.window))
                hot = got.get("hot_set") or {}
                tries.append({"p95": p95, "time_to_normal_s": time_to_normal(p95, limit, args.window),
                              "time_to_normal_floor_s": time_to_normal(p95, floor_limit, args.window),
                              "tx": len(tx), "full_s": got.get("full_s"), "returned_s": got.get("returned_s"),
                              "plan_s": got.get("plan_seconds"), "hot_phase_bytes": hot.get("bytes"), "hot_phase_read_by_s": hot.get("read_by_seconds"),
                              "hydrated": got.get("samples"), "coverage": got.get("verified_coverage"),
                              "levels": got.get("levels"), "cpu_busy": cpu_busy,
                              "cold_chunks": status.get("cold_chunks")})
                t = tries[-1]
                print(f"bench-normal: {name} #{i + 1}: normal after {t['time_to_normal_s']} s "
                      f"(with the floor {t['time_to_normal_floor_s']} s), {len(tx)} tx, volume 100% at "
                      f"{t['full_s']} (planned in {t['plan_s']} s)", flush=True)
            # The median run by time to normal with the floor (never sorts last).
            tries.sort(key=lambda x: (x["time_to_normal_floor_s"] is None, x["time_to_normal_floor_s"] or 0))
            r = dict(tries[len(tries) // 2])
            r["runs"] = [{k: v for k, v in t.items() if k not in ("p95", "hydrated", "cpu_busy")} for t in tries]
            results["strategies"][name] = r
    finally:
        b.close()
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    svg(results, out.with_suffix(".svg"))
    print()
    print(f"baseline p95 {baseline:.2f} ms (normal: <= {limit:.2f} ms; with the floor <= {floor_limit:.2f} ms); "
          f"hot set {hot_bytes / 2**20:.1f} MiB, {hot_bytes / 2**20 / rate_mib:.2f} s at the volume's "
          f"{rate_mib:.0f} MiB/s ({args.concurrency} fetches of 512 KiB at once, {args.latency} each); "
          f"{args.clients} clients, {args.rate} tx/s, zipf {args.zipf}, {args.seconds} s, "
          f"{args.repeat} run(s) per strategy (median)")
    print(f"| strategy | time to normal (s) | with the {args.floor_ms:g} ms floor (s) | all runs, with the floor (s) | "
          "volume at 100% (s) | hot phase read by (s) | p95 at 2, 5, 10, 20, 40 s (ms) |")
    print("|---|---|---|---|---|---|---|")
    fmt = lambda v: "never" if v is None else f"{v:g}"  # noqa: E731
    for name, r in results["strategies"].items():
        at = ", ".join(f"{r['p95'][int(s / args.window)]:.1f}" if int(s / args.window) < len(r["p95"])
                       and r["p95"][int(s / args.window)] is not None else "-" for s in (2, 5, 10, 20, 40))
        full = f"{r['full_s']:.1f}" if r["full_s"] else "-"
        allr = ", ".join(fmt(t["time_to_normal_floor_s"]) for t in r["runs"])
        hot = f"{r['hot_phase_read_by_s']:.1f}" if r.get("hot_phase_read_by_s") else "-"
        print(f"| {name} | {fmt(r['time_to_normal_s'])} | {fmt(r['time_to_normal_floor_s'])} | {allr} | {full} | "
              f"{hot} | {at} |")


if __name__ == "__main__":
    main()

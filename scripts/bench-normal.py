"""Time to normal (`make bench-normal`): how long a skewed read workload stays slow after a restore, with
no hydration, the published recipe, pghydrate without a captured hot set, and pghydrate with one.

On the lazy-volume simulator (sim/), the benchmark's skewed database (scripts/bench.py) serves a read
workload: pgbench clients looking up rows of the big table by primary key, keys drawn from a Zipfian
distribution (`random_zipfian(1, rows, --zipf)`), so a small part of the table and its index is hot.
1. On the loaded (local, fast) volume the workload runs --warmup seconds; `pghydrate capture` then stores
   what shared buffers hold. The same workload on that fully hydrated volume, from a restarted server,
   gives the baseline p95 (per second, median over the run).
2. For each strategy: restore (server stopped, volume remounted cold, server started), then the workload
   and the strategy start together; pgbench logs every transaction. Per second: p95 latency.
   "Time to normal" is the first second from which p95 stays within 1.5x the baseline to the end of the
   run. The strategy's time to 100% of the volume is recorded too.

Writes bench/normal.json and prints the table. Needs root (FUSE; the server runs as the pghydrate user).

    python3 scripts/bench-normal.py [--major 15] [--seconds 60] [--latency 20ms] [--concurrency 8]
"""
import argparse
import json
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


def workload_script(path: Path, rows: int, zipf: float):
    path.write_text(f"\\set k random_zipfian(1, {rows}, {zipf})\nSELECT a, b FROM big WHERE id = :k;\n")


def run_workload(b, seconds: int, clients: int, script: Path, tag: str):
    """pgbench for `seconds`; returns [(completion epoch seconds, latency ms)] of every transaction."""
    logdir = b.workdir / f"pgbench-{tag}"
    logdir.mkdir(exist_ok=True)
    os.chown(logdir, *_uid_gid())
    env = dict(os.environ, PGPASSWORD=PASSWORD)
    cmd = [str(b.pg.bin / "pgbench"), "-n", "-h", "127.0.0.1", "-p", str(b.pg.port), "-U", "postgres",
           "-c", str(clients), "-j", str(min(clients, 2)), "-T", str(seconds), "-f", str(script),
           "-l", "--log-prefix", str(logdir / "tx"), "app"]
    subprocess.run(cmd, env=env, cwd=logdir, check=True, capture_output=True, text=True)
    out = []
    for f in logdir.glob("tx*"):
        for line in f.read_text().split("\n"):
            p = line.split()
            if len(p) >= 6:
                out.append((int(p[4]) + int(p[5]) / 1e6, int(p[2]) / 1000.0))
    return out


def _uid_gid():
    import pwd
    pw = pwd.getpwnam(bench.RUN_AS)
    return pw.pw_uid, pw.pw_gid


def p95_per_second(tx, start: float, seconds: int):
    buckets = [[] for _ in range(seconds + 1)]
    for t, ms in tx:
        i = int(t - start)
        if 0 <= i <= seconds:
            buckets[i].append(ms)
    return [round(statistics.quantiles(b, n=20)[18], 3) if len(b) >= 20 else (max(b) if b else None)
            for b in buckets[:seconds]]


def time_to_normal(p95s, baseline: float, factor: float = 1.5):
    """First second from which every later second's p95 is within factor x baseline (None: never)."""
    normal_from = None
    for i, v in enumerate(p95s):
        ok = v is not None and v <= factor * baseline
        if ok and normal_from is None:
            normal_from = i
        elif not ok:
            normal_from = None
    return normal_from


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--major", type=int, default=15)
    ap.add_argument("--scale", type=float, default=400)
    ap.add_argument("--small", type=int, default=300)
    ap.add_argument("--latency", default="20ms")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seconds", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--zipf", type=float, default=1.2)
    ap.add_argument("--only", default="", help="comma-separated strategy names to run")
    ap.add_argument("--out", default=str(ROOT / "bench" / "normal.json"))
    args = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "--locked", "-p", "pghydrate-cli", "-p", "pghydrate-lazyvol"],
                   cwd=ROOT, check=True)
    vol_args = argparse.Namespace(scale=args.scale, small=args.small, latency=args.latency,
                                  concurrency=args.concurrency, bandwidth_mib=0.0, iops=0.0, throughput_mib=0.0,
                                  burst_seconds="0s", burst_iops=0.0, burst_throughput_mib=0.0,
                                  latency_jitter="0ms", seed=1, limit=args.seconds, recipe_limit=args.seconds)
    b = bench.Bench(args.major, vol_args)
    results = {"parameters": vars(args), "strategies": {}}
    try:
        info = b.load()
        rows = int(b.pg.psql("SELECT max(id) FROM big", db="app"))
        script = b.workdir / "zipf.sql"
        workload_script(script, rows, args.zipf)
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
        tx = run_workload(b, args.seconds, args.clients, script, "baseline")
        base = p95_per_second(tx, start, args.seconds)
        baseline = statistics.median([v for v in base if v is not None])
        print(f"bench-normal: hydrated baseline p95 {baseline:.2f} ms ({len(tx) / args.seconds:.0f} tx/s)", flush=True)
        results.update(database=info, capture=captured, hot_bytes=hot_bytes, baseline_p95_ms=baseline,
                       baseline_p95=base)

        strategies = {
            "lazy loading only": None,
            "published recipe": lambda: b.recipe(),
            "pghydrate --no-hot-set": lambda: b.pghydrate("--no-hot-set"),
            "pghydrate (captured hot set)": lambda: b.pghydrate(),
        }
        only = [s.strip() for s in args.only.split(",") if s.strip()]
        for name, strategy in strategies.items():
            if only and not any(o in name for o in only):
                continue
            status = b.cold()
            start = time.time()
            got = {}
            th = None
            if strategy is not None:
                th = threading.Thread(target=lambda: got.update(strategy()), daemon=True)
                th.start()
            tx = run_workload(b, args.seconds, args.clients, script, name.replace(" ", "-").replace("(", "").replace(")", ""))
            if th is not None:
                th.join()
            p95 = p95_per_second(tx, start, args.seconds)
            ttn = time_to_normal(p95, baseline)
            results["strategies"][name] = {"p95": p95, "time_to_normal_s": ttn, "tx": len(tx),
                                           "full_s": got.get("full_s"), "returned_s": got.get("returned_s"),
                                           "cold_chunks": status.get("cold_chunks")}
            print(f"bench-normal: {name}: normal after {ttn if ttn is not None else 'never'} s, "
                  f"{len(tx) / args.seconds:.0f} tx/s, volume 100% at {got.get('full_s')}", flush=True)
    finally:
        b.close()
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    print()
    print(f"baseline p95 {results['baseline_p95_ms']:.2f} ms; hot set {results['hot_bytes'] / 2**20:.1f} MiB; "
          f"volume {args.concurrency} fetches at once, {args.latency} each; {args.clients} pgbench clients, "
          f"zipf {args.zipf}, {args.seconds} s")
    print("| strategy | time to normal (s) | transactions | volume at 100% (s) | p95 at 1 s, 5 s, 10 s, 30 s (ms) |")
    print("|---|---|---|---|---|")
    for name, r in results["strategies"].items():
        at = ", ".join(f"{r['p95'][i]:.1f}" if i < len(r["p95"]) and r["p95"][i] is not None else "-"
                       for i in (1, 5, 10, 30))
        full = f"{r['full_s']:.1f}" if r["full_s"] else "-"
        print(f"| {name} | {r['time_to_normal_s'] if r['time_to_normal_s'] is not None else 'never'} | "
              f"{r['tx']:,} | {full} | {at} |")


if __name__ == "__main__":
    main()

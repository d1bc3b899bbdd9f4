"""The workflow's cost benchmark (`make bench-workflow`): what Lambda bills for the warm phase, measured.

For each configuration: a twin (moto running the real state machine, the real Lambda binaries behind
`cargo lambda watch`, a real PostgreSQL) whose database lives in a tablespace on the lazy-volume
simulator (sim/). Each run: stop PostgreSQL, remount the volume (all cold), start PostgreSQL, start an
execution, wait for it. Measured: the execution's duration, the warm calls and their summed durations
(the Report's `warm.call_seconds`, which Lambda bills x 0.25 GB), state transitions (StateEntered events
over the whole history, children included), the volume's hydrated fraction, and the Warm function's
peak RSS (VmHWM of its process).

Configurations: `before` is the workflow as it was (8 sessions per instance, one per call: 8 calls at
once), `after` the defaults (at most 64 sessions per instance, all in one call, adaptive), `2x32` two
calls at once of at most 32 sessions each.

Cost per TiB = billed GB-seconds per byte x 2^40 x the price, plus requests (the state transitions, a
run's fixed cost, are counted, not scaled); it scales
with the calls' throughput, which on AWS is the instance's volume, not this simulator. Needs root.
Functions run as Lambda runs them: release builds, each process held to its template MemorySize and
that memory's CPU share (256 MB: 14.5% of one vCPU), see twin.Sandboxes; `--build debug` runs the
twin as the tests do (debug builds, memory limit only).
    python3 scripts/bench-workflow.py [--scale MB] [--latency 50ms] [--concurrency 8] [--runs 2] [--only before,after,2x32] [--build debug]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "twin"))
sys.path.insert(0, str(ROOT / "scripts"))
from lazyvol import Volume  # noqa: E402
from twin import FUNCTIONS, HOME, RUN_AS, Twin, function_memory_mb  # noqa: E402

TARGET = Path(os.environ.get("CARGO_TARGET_DIR", HOME / "target"))
GB_SECOND = {"arm64": 0.0000133334, "x86_64": 0.0000166667}
REQUEST = 0.20 / 1e6
CONFIGS = {
    "before": {"PGHYDRATE_SESSIONS": "8", "PGHYDRATE_CALL_SESSIONS": "1"},
    "after": {},
    "2x32": {"PGHYDRATE_CALL_SESSIONS": "32"},
}


def skewed_sql(mb: int) -> str:
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench", ROOT / "scripts" / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.SKEWED_SQL.format(big_rows=int(mb * 5200), doc_rows=int(mb * 40), small=300)


def warm_rss_kib() -> int:
    """Peak RSS of the Warm function's processes (cargo lambda watch runs the binary `warm`)."""
    peak = 0
    for p in Path("/proc").iterdir():
        try:
            if (p / "comm").read_text().strip() == "warm":
                for line in (p / "status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        peak = max(peak, int(line.split()[1]))
        except (OSError, ValueError):
            pass
    return peak


def warm_intervals(history) -> list:
    """(start, end) of each Warm task, from the history's timestamps (children included)."""
    started, spans = {}, []
    for e in history:
        key = (e.get("mapRunArn"), e.get("child"))
        if e["type"] == "TaskScheduled" and '"FunctionName": "warm"' in e["taskScheduledEventDetails"]["parameters"]:
            started[key + (e["id"],)] = e["timestamp"]
        elif e["type"] in ("TaskSucceeded", "TaskFailed", "TaskTimedOut"):
            prev = [k for k in started if k[:2] == key and k[2] < e["id"]]
            if prev:
                k = max(prev, key=lambda k: k[2])
                spans.append((started.pop(k), e["timestamp"]))
    return spans


def state_seconds(history) -> dict:
    """Seconds spent in each state (by name, summed over entries), from the history's timestamps."""
    entered, total = {}, {}
    for e in history:
        key = (e.get("mapRunArn"), e.get("child"))
        if e["type"].endswith("StateEntered"):
            entered[key + (e["stateEnteredEventDetails"]["name"],)] = e["timestamp"]
        elif e["type"].endswith("StateExited"):
            name = e["stateExitedEventDetails"]["name"]
            start = entered.pop(key + (name,), None)
            if start:
                total[name] = total.get(name, 0.0) + (e["timestamp"] - start).total_seconds()
    return {k: round(v, 1) for k, v in sorted(total.items(), key=lambda kv: -kv[1])}


def peak_overlap(spans) -> int:
    points = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans], key=lambda p: (p[0], p[1]))
    peak = now = 0
    for _, d in points:
        now += d
        peak = max(peak, now)
    return peak


def measure(config: str, env: dict, args) -> list:
    voldir = Path(tempfile.mkdtemp(prefix="bench-workflow-", dir=HOME))
    shutil.chown(voldir, RUN_AS)
    vol = Volume(voldir, TARGET / args.build / "pghydrate-lazyvol")
    params = dict(latency=args.latency, concurrency=args.concurrency, throughput_mib=args.throughput_mib)
    rows = []
    try:
        vol.mount(latency="0ms", concurrency=64)
        with Twin.start(lambda_timeout=900, margin=60, mode="auto", env=env,
                        pg_conf={"shared_buffers": "1GB", "max_connections": "200"}) as t:
            t.pg.psql(f"CREATE TABLESPACE lazy LOCATION '{vol.mnt}'")
            t.pg.psql("CREATE DATABASE app TABLESPACE lazy")
            t.pg.psql(skewed_sql(args.scale), db="app")
            t.pg.psql("VACUUM ANALYZE", db="app")
            t.pg.psql("CHECKPOINT")
            size = int(t.pg.psql("SELECT pg_database_size('app')"))
            t.register_instance("app-restored", script=[{"status": "available"}] * 10000)
            seen = 0
            for run in range(args.runs):
                t.pg.stop()
                vol.remount(**params)
                t.pg.start()
                started = time.monotonic()
                d, history = t.run({"instance": "app-restored", "include_databases": ["app"], "maintenance": "none"},
                                   timeout=3600)
                seconds = time.monotonic() - started
                assert d["status"] == "SUCCEEDED", (d.get("error"), d.get("cause"))
                inst = json.loads(d["output"])["instances"][0]
                time.sleep(0.1)
                status = vol.status()
                transitions = sum(1 for e in history if e["type"].endswith("StateEntered"))
                warm = inst["warm"]
                spans = warm_intervals(history)
                calls = [line for line in t.log_text().splitlines() if "warm call" in line]
                for line in calls[seen:]:
                    print(f"bench-workflow:   {line.strip()[-300:]}", flush=True)
                seen = len(calls)
                row = {
                    "config": config, "run": run + 1, "database_bytes": size, "warmed_bytes": inst["warmed_bytes"],
                    "coverage": inst["coverage"], "hydrated": status["hydrated"], "execution_seconds": round(seconds, 1),
                    "calls": warm["calls"], "call_seconds": warm["call_seconds"], "calls_at_once": warm["calls_at_once"],
                    "sessions_per_call": warm["sessions_per_call"], "transitions": transitions,
                    "warm_phase_seconds": round((max(e for _, e in spans) - min(s for s, _ in spans)).total_seconds(), 1),
                    "peak_calls_at_once": peak_overlap(spans),
                    "state_seconds": state_seconds(history),
                    "warm_peak_rss_mib": round(warm_rss_kib() / 1024, 1), "volume": vol.params,
                    "build": args.build, "lambda_cpu_share": args.build == "release",
                }
                tib = 2**40 / max(inst["warmed_bytes"], 1)
                memory_gb = function_memory_mb()["warm"] / 1024  # as the template deploys Warm
                row["warm_memory_mb"] = function_memory_mb()["warm"]
                row["gb_seconds_per_tib"] = round(warm["call_seconds"] * memory_gb * tib)
                for arch, price in GB_SECOND.items():
                    # Lambda only: the state transitions are a run's fixed cost (about 3 per Warm call
                    # more), not a cost per byte; they are reported as they were counted.
                    row[f"usd_per_tib_{arch}"] = round(row["gb_seconds_per_tib"] * price + warm["calls"] * tib * REQUEST, 3)
                print(f"bench-workflow: {json.dumps(row)}", flush=True)
                rows.append(row)
            t.pg.stop()
    finally:
        vol.unmount()
        shutil.rmtree(voldir, ignore_errors=True)
    return rows


def table(rows: list) -> str:
    out = ["| config | calls at once x sessions per call | Warm MemorySize (MB) | warmed (MiB) | execution (s) | warm phase (s) | warm calls | billed call-seconds | "
           "transitions | GB-s per TiB | Lambda $ per TiB arm64 (x86_64) | Warm peak RSS (MiB) | volume hydrated |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['config']} | {r['calls_at_once']} x {r['sessions_per_call']} | {r.get('warm_memory_mb', 256)} | {r['warmed_bytes'] / 2**20:.0f} | "
                   f"{r['execution_seconds']} | {r['warm_phase_seconds']} | {r['calls']} | {r['call_seconds']} | {r['transitions']} | "
                   f"{r['gb_seconds_per_tib']:,} | {r['usd_per_tib_arm64']} ({r['usd_per_tib_x86_64']}) | "
                   f"{r['warm_peak_rss_mib']} | {r['hydrated']} |")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=int, default=400, help="approximate MiB of the big table, as bench.py (400: a 509 MiB database)")
    ap.add_argument("--latency", default="50ms")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--throughput-mib", type=float, default=0.0)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--only", default="before,after")
    ap.add_argument("--build", choices=["release", "debug"], default="release",
                    help="release (default): as Lambda runs the functions, with their CPU share; debug: as the tests do")
    ap.add_argument("--out", default=str(ROOT / "bench" / "workflow.json"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench-workflow: needs root (the lazy volume mounts with FUSE; servers run as the pghydrate user)")
    if args.build == "release":
        # As Lambda runs them: release builds, each process with its function's CPU share (MemorySize /
        # 1,769 MB of one vCPU) as well as its memory (twin.Sandboxes). Debug builds are many times
        # slower, so they run without the CPU share (--build debug: the twin as the tests run it).
        os.environ["PGHYDRATE_TWIN_RELEASE"] = "1"
        os.environ["PGHYDRATE_TWIN_LAMBDA_CPU"] = "1"
    profile = ["--release"] if args.build == "release" else []
    packages = [a for f in FUNCTIONS + ["pghydrate-lazyvol"] for a in ("-p", f)]
    subprocess.run(["cargo", "build", "--locked", *profile, *packages], cwd=ROOT, check=True,
                   env=dict(os.environ, CARGO_TARGET_DIR=str(TARGET)))  # where the binaries are read from
    rows = []
    for config in args.only.split(","):
        rows += measure(config, CONFIGS[config], args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print(table(rows))
    print(f"bench-workflow: results in {args.out}")


if __name__ == "__main__":
    main()

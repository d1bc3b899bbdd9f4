"""Planning at scale (`make bench-plan`): 100,000 relations across 4 databases on one local server.
Measures `pghydrate plan --json` (wall time, peak RSS, plan size) and `pghydrate run` (wall time, peak
RSS) with /usr/bin/time, and prints a markdown table. Needs root (the server runs as the pghydrate user).

    python3 scripts/bench-plan.py [--relations 100000] [--databases 4] [--major 15]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "twin"))
from twin import HOME, PASSWORD, RUN_AS, Postgres  # noqa: E402

PGHYDRATE = Path(os.environ.get("CARGO_TARGET_DIR", HOME / "target")) / "release" / "pghydrate"


def timed(args, out_path=None):
    """(seconds, peak RSS in MiB, stdout bytes) of a command, by /usr/bin/time -v."""
    t = time.monotonic()
    with open(out_path or os.devnull, "wb") as out:
        p = subprocess.run(["/usr/bin/time", "-v", *args], stdout=out, stderr=subprocess.PIPE, text=True,
                           env=dict(os.environ, PGHYDRATE_LOG="error"))
    seconds = time.monotonic() - t
    if p.returncode != 0:
        raise SystemExit(f"{args[1]} failed ({p.returncode}): {p.stderr[-1500:]}")
    rss_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", p.stderr).group(1))
    return seconds, rss_kib / 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--relations", type=int, default=100_000)
    ap.add_argument("--databases", type=int, default=4)
    ap.add_argument("--major", type=int, default=15)
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-plan-", dir=HOME))
    shutil.chown(workdir, RUN_AS)
    pg = Postgres(workdir, {"max_locks_per_transaction": "4096", "shared_buffers": "512MB"}, major=args.major)
    try:
        # Each table is 2 relations (heap + primary key); 10 tables per transaction step.
        tables = args.relations // 2 // args.databases
        t = time.monotonic()
        for d in range(args.databases):
            db = f"db{d}"
            pg.psql(f"CREATE DATABASE {db}")
            pg.psql(f"DO $$ BEGIN FOR i IN 1..{tables} LOOP "
                    f"EXECUTE format('CREATE TABLE t_%s (id int PRIMARY KEY)', i); "
                    f"IF i % 2000 = 0 THEN COMMIT; END IF; END LOOP; END $$", db=db)
            pg.psql("CREATE EXTENSION pg_prewarm", db=db)
        counted = sum(int(pg.psql("SELECT count(*) FROM pg_class WHERE relkind IN ('r','i','t','m','S')", db=f"db{d}"))
                      for d in range(args.databases))
        print(f"bench-plan: {counted} relations with storage in {args.databases} databases (catalogs included), "
              f"made in {time.monotonic() - t:.0f} s", flush=True)
        url = f"postgresql://postgres:{PASSWORD}@127.0.0.1:{pg.port}/postgres"
        plan_path = workdir / "plan.json"
        plan_s, plan_rss = timed([str(PGHYDRATE), "plan", url, "--tls", "disable", "--json"], plan_path)
        plan_bytes = plan_path.stat().st_size
        run_s, run_rss = timed([str(PGHYDRATE), "run", url, "--tls", "disable", "--maintenance", "none",
                                "--progress", "none", "--report", str(workdir / "report.json")])
        report = json.loads((workdir / "report.json").read_text())
        timings = report["timings"]
        print("| PostgreSQL | relations (all databases) | command | wall time (s) | of which plan / warm (s) | peak RSS (MiB) | plan JSON (MiB) |")
        print("|---|---|---|---|---|---|---|")
        print(f"| {args.major} | {counted} | pghydrate plan --json | {plan_s:.1f} | | {plan_rss:.0f} | {plan_bytes / 2**20:.1f} |")
        print(f"| {args.major} | {counted} | pghydrate run (hot, every fork) | {run_s:.1f} | "
              f"{timings['plan_seconds']:.1f} / {timings['warm_seconds']:.1f} | {run_rss:.0f} | |")
    finally:
        pg.stop("immediate")
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

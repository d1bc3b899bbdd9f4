"""Planning at scale (`make bench-plan`): 100,000 relations across 4 databases on one local server.
Measures `pghydrate plan --json` (wall time, peak RSS, plan size) and `pghydrate run` (wall time, peak
RSS) with /usr/bin/time, and prints a markdown table. Needs root (the server runs as the pghydrate user).

    python3 scripts/bench-plan.py [--relations 100000] [--databases 4] [--major 15]

With --cold-catalogs N: planning a restored server of N tenant databases whose catalogs are cold. Each
database (its catalogs too) lives in a tablespace on the lazy-volume simulator (sim/; --latency per
512 KiB fetch, --concurrency fetches at once); for each --at-once value, the volume is remounted all
cold and `pghydrate plan --json --databases-at-once K` is timed. Needs root (FUSE).

    python3 scripts/bench-plan.py --cold-catalogs 200 [--tables 20] [--at-once 1,8] [--latency 20ms]
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
from lazyvol import Volume  # noqa: E402

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
    ap.add_argument("--cold-catalogs", type=int, default=0, metavar="N",
                    help="plan N tenant databases on cold catalogs instead (see above)")
    ap.add_argument("--tables", type=int, default=20, help="tables per tenant database (with --cold-catalogs)")
    ap.add_argument("--at-once", default="1,8", help="--databases-at-once values to time (with --cold-catalogs)")
    ap.add_argument("--latency", default="20ms")
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
    if args.cold_catalogs:
        return cold_catalogs(args)
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


def cold_catalogs(args):
    workdir = Path(tempfile.mkdtemp(prefix="bench-plan-", dir=HOME))
    shutil.chown(workdir, RUN_AS)
    vol = Volume(workdir, PGHYDRATE.parent / "pghydrate-lazyvol")
    vol.mount(latency="0ms", concurrency=64)
    pg = Postgres(workdir, {"shared_buffers": "256MB", "max_connections": "100"}, major=args.major)
    try:
        t = time.monotonic()
        pg.psql(f"CREATE TABLESPACE lazy LOCATION '{vol.mnt}'")
        pg.psql("CREATE EXTENSION pg_prewarm", db="template1")
        pg.psql(f"""DO $$ BEGIN FOR i IN 1..{args.tables} LOOP
                      EXECUTE format('CREATE TABLE t_%s (id int PRIMARY KEY, body text, at timestamptz)', i);
                      EXECUTE format('CREATE INDEX ON t_%s (at)', i);
                      EXECUTE format('INSERT INTO t_%s SELECT g, md5(g::text), now() FROM generate_series(1, 100) g', i);
                    END LOOP; END $$""", db="template1")
        script = "".join(f"CREATE DATABASE tenant_{i:05d} TABLESPACE lazy;\n" for i in range(args.cold_catalogs))
        subprocess.run([str(pg.bin / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p",
                        str(pg.port), "-U", "postgres", "-d", "postgres"], input=script, text=True, check=True,
                       capture_output=True, env=dict(os.environ, PGPASSWORD=PASSWORD))
        pg.psql("CHECKPOINT")
        size = int(pg.psql("SELECT pg_database_size('tenant_00000')"))
        print(f"bench-plan: {args.cold_catalogs} tenant databases of {size / 2**20:.1f} MiB each "
              f"({args.tables} tables with 2 indexes each, besides the catalogs), made in {time.monotonic() - t:.0f} s; "
              f"volume: {args.latency} per fetch, {args.concurrency} at once", flush=True)
        url = f"postgresql://postgres:{PASSWORD}@127.0.0.1:{pg.port}/postgres"
        rows = []
        for k in [int(x) for x in args.at_once.split(",")]:
            pg.stop()
            vol.remount(latency=args.latency, concurrency=args.concurrency)
            pg.start()
            plan_path = workdir / "plan.json"
            seconds, rss = timed([str(PGHYDRATE), "plan", url, "--tls", "disable", "--json",
                                  "--include-database", "tenant_*", "--databases-at-once", str(k)], plan_path)
            plan = json.loads(plan_path.read_text())
            planned = sum(1 for d in plan["databases"] if d["outcome"] == "planned")
            fetched = vol.status()["hydrated"]
            rows.append((k, seconds, rss, planned, fetched))
            print(f"bench-plan: --databases-at-once {k}: {seconds:.1f} s, {planned} planned", flush=True)
        print(f"| PostgreSQL | tenant databases | volume | --databases-at-once | plan wall time (s) | peak RSS (MiB) "
              f"| databases planned | volume fetched |")
        print("|---|---|---|---|---|---|---|---|")
        for k, seconds, rss, planned, fetched in rows:
            print(f"| {args.major} | {args.cold_catalogs} | {args.latency} x {args.concurrency} | {k} | {seconds:.1f} "
                  f"| {rss:.0f} | {planned} | {fetched:.1%} |")
    finally:
        pg.stop("immediate")
        vol.unmount()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

"""What `pghydrate capture` costs (`make bench-capture`): one read of pg_buffercache and the write of the
hot set, on a server whose shared buffers are full.

Starts a PostgreSQL server with --shared-buffers, fills the cache with a table of the same size
(pg_prewarm, buffer mode), and runs `pghydrate capture --json` --runs times in two shapes: the cache
holding whole relations (few long runs), and holding every other block (the most runs a cache can have,
compacted to the cap). Prints a table: buffers, runs, ranges stored, the pg_buffercache read, the whole
capture, and the table's size. Needs root (the server runs as the pghydrate user).

    python3 scripts/bench-capture.py [--major 15] [--shared-buffers 2GB] [--runs 3] [--relations 100000]

--relations N adds a third shape: N relations (N/2 tables of one row with a primary key), every block of
them cached: one run per fork, the most relations a capture has to summarize.
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
from twin import HOME, PASSWORD, RUN_AS, Postgres  # noqa: E402


TARGET = Path(os.environ.get("CARGO_TARGET_DIR", HOME / "target"))
PGHYDRATE = TARGET / "release" / "pghydrate"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--major", type=int, default=15)
    ap.add_argument("--shared-buffers", default="2GB")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--relations", type=int, default=0, help="also a cache of this many small relations")
    ap.add_argument("--out", default=str(ROOT / "bench" / "capture.json"))
    args = ap.parse_args()
    subprocess.run(["cargo", "build", "--release", "--locked", "-p", "pghydrate-cli"], cwd=ROOT, check=True,
                   env=dict(os.environ, CARGO_TARGET_DIR=str(TARGET)))  # where the binary is read from
    workdir = Path(tempfile.mkdtemp(prefix="bench-capture-", dir=HOME))
    shutil.chown(workdir, RUN_AS)
    pg = Postgres(workdir, {"shared_buffers": args.shared_buffers, "max_connections": "50"}, major=args.major)
    url = f"postgresql://postgres:{PASSWORD}@127.0.0.1:{pg.port}/postgres?sslmode=disable"
    rows = []
    try:
        buffers = int(pg.psql("SELECT pg_size_bytes(current_setting('shared_buffers')) / 8192"))
        pg.psql("CREATE EXTENSION pg_buffercache")
        pg.psql("CREATE DATABASE app")
        pg.psql("CREATE EXTENSION pg_prewarm", db="app")
        t = time.monotonic()
        # ~25 rows per block at fillfactor 10: a table of about as many blocks as there are buffers, less
        # what the catalogs and the hot set itself take.
        pg.psql("CREATE TABLE filler (id int, v text) WITH (fillfactor = 10)", db="app")
        pg.psql(f"INSERT INTO filler SELECT i, 'f' || i FROM generate_series(1, {int(buffers * 0.9) * 25}) i", db="app")
        blocks = int(pg.psql("SELECT pg_relation_size('filler') / 8192", db="app"))
        print(f"bench-capture: PostgreSQL {args.major}, shared_buffers {args.shared_buffers} ({buffers} buffers), "
              f"table of {blocks} blocks loaded in {time.monotonic() - t:.0f} s", flush=True)
        shapes = {
            "whole relations": "SELECT pg_prewarm('filler')",
            "every other block": f"SELECT count(pg_prewarm('filler', 'buffer', 'main', b, b)) "
                                 f"FROM generate_series(0, {blocks - 1}, 2) b",
        }
        if args.relations:
            t = time.monotonic()
            tables = args.relations // 2
            pg.psql(f"DO $$ BEGIN FOR i IN 1..{tables} LOOP "
                    f"EXECUTE format('CREATE TABLE r_%s (id int PRIMARY KEY)', i); "
                    f"EXECUTE format('INSERT INTO r_%s VALUES (1)', i); "
                    f"IF i % 2000 = 0 THEN COMMIT; END IF; END LOOP; END $$", db="app")
            print(f"bench-capture: {tables} tables with a primary key made in {time.monotonic() - t:.0f} s", flush=True)
            shapes[f"{args.relations:,} small relations"] = (
                "SELECT count(pg_prewarm(c.oid)) FROM pg_class c "
                "WHERE c.relkind IN ('r', 'i') AND (c.relname LIKE 'r\\_%' OR c.relname LIKE 'r\\_%\\_pkey')")
        for shape, fill in shapes.items():
            pg.stop()
            pg.start()
            pg.psql(fill, db="app")
            for i in range(args.runs):
                t = time.monotonic()
                with tempfile.TemporaryFile(mode="w+") as stdout:
                    p = subprocess.Popen([str(PGHYDRATE), "capture", "--json", "--include-database", "app", url],
                                         stdout=stdout)
                    _, status, usage = os.wait4(p.pid, 0)
                    wall = time.monotonic() - t
                    if os.waitstatus_to_exitcode(status) != 0:
                        raise SystemExit(f"bench-capture: pghydrate capture exited {os.waitstatus_to_exitcode(status)}")
                    stdout.seek(0)
                    out = stdout.read()
                peak_mib = usage.ru_maxrss / 1024  # Linux: KiB
                c = json.loads(out)
                d = c["databases"][0]
                rows.append({"shape": shape, "run": i + 1, "shared_buffers": c["shared_buffers"],
                             "buffers_cached": c["buffers_cached"], "runs": d["runs"], "ranges": d["ranges"],
                             "largest_gap_merged": d["largest_gap_merged"], "read_seconds": c["read_seconds"],
                             "capture_seconds": c["seconds"], "wall_seconds": wall, "table_bytes": d["table_bytes"],
                             "peak_rss_mib": peak_mib})
                print(f"bench-capture: {shape} #{i + 1}: {d['runs']} runs -> {d['ranges']} ranges, "
                      f"read {c['read_seconds']:.2f} s, capture {c['seconds']:.2f} s, peak RSS {peak_mib:.0f} MiB",
                      flush=True)
    finally:
        pg.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"major": args.major, "shared_buffers": args.shared_buffers, "rows": rows}, indent=1))
    print()
    print("| cache holds | run | buffers cached | runs | ranges stored | pg_buffercache read (s) | capture (s) | hot_set table | peak RSS of capture |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['run']} | {r['buffers_cached']:,} of {r['shared_buffers']:,} | {r['runs']:,} | "
              f"{r['ranges']:,} | {r['read_seconds']:.2f} | {r['capture_seconds']:.2f} | "
              f"{r['table_bytes'] / 2**20:.2f} MiB | {r['peak_rss_mib']:.0f} MiB |")


if __name__ == "__main__":
    main()

"""The hydration benchmark (`make bench`): strategies side by side on a simulated lazy-loaded volume.

For each PostgreSQL version: a skewed database (one table holds most of the bytes, plus many small tables
with indexes, and a TOAST-heavy table) lives in a tablespace on pghydrate-lazyvol (sim/). For each
strategy: stop PostgreSQL, remount the volume (all cold), start PostgreSQL, start the strategy, and
watch the volume until every chunk of the snapshot is fetched (or the time limit passes). Reported: the
time until the strategy returned, the hydrated fraction at that moment, the time to 100%, and the ideal
time from the volume's parameters (cold chunks x latency / concurrency; bytes / bandwidth).

Writes bench/results.json, docs/benchmark.md (table) and docs/benchmark.svg (hydrated fraction over time).
Needs root (FUSE mount, servers run as the pghydrate user). Usage:
    python3 scripts/bench.py [--majors 15,18] [--scale MB] [--latency 20ms] [--concurrency 8] [--quick]
"""
import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "twin"))
from lazyvol import Volume  # noqa: E402
from twin import HOME, PASSWORD, RUN_AS, Postgres  # noqa: E402

TARGET = Path(os.environ.get("CARGO_TARGET_DIR", HOME / "target"))
PGHYDRATE = TARGET / "release" / "pghydrate"
LAZYVOL = TARGET / "release" / "pghydrate-lazyvol"

SKEWED_SQL = """
CREATE TABLE big (id bigint PRIMARY KEY, a int, b text, c text);
INSERT INTO big SELECT g, g % 1000, md5(g::text), repeat(md5((g * 7)::text), 3)
  FROM generate_series(1, {big_rows}) g;
CREATE TABLE docs (id int PRIMARY KEY, body text);
ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL;
INSERT INTO docs SELECT g, repeat(md5(g::text), 120) FROM generate_series(1, {doc_rows}) g;
DO $$ BEGIN FOR i IN 1..{small} LOOP
  EXECUTE format('CREATE TABLE small_%s (id int PRIMARY KEY, v text)', i);
  EXECUTE format('INSERT INTO small_%s SELECT g, md5(g::text) FROM generate_series(1, 200 + %s * 5) g', i, i);
END LOOP; END $$;
"""


def now():
    return time.monotonic()


class Bench:
    def __init__(self, major: int, args):
        self.major = major
        self.args = args
        self.workdir = Path(tempfile.mkdtemp(prefix=f"bench-pg{major}-", dir=HOME))
        shutil.chown(self.workdir, RUN_AS)
        self.vol = Volume(self.workdir, LAZYVOL)
        self.vol.mount(latency="0ms", concurrency=64)
        # The small tables are created in one transaction, about 5 locks each (table, key, TOAST): the
        # shared lock table holds max_locks_per_transaction x max_connections of them.
        locks = str(max(64, args.small // 10))
        self.pg = Postgres(self.workdir, {"shared_buffers": "1GB", "max_connections": "100",
                                          "max_locks_per_transaction": locks}, major=major)
        self.url = f"postgresql://postgres:{PASSWORD}@127.0.0.1:{self.pg.port}/postgres"

    def load(self):
        mb = self.args.scale
        t = now()
        self.pg.psql(f"CREATE TABLESPACE lazy LOCATION '{self.vol.mnt}'")
        self.pg.psql("CREATE DATABASE app TABLESPACE lazy")
        self.pg.psql(SKEWED_SQL.format(big_rows=int(mb * 5200), doc_rows=int(mb * 40), small=self.args.small), db="app")
        self.pg.psql("VACUUM ANALYZE", db="app")
        self.pg.psql("CREATE EXTENSION pg_prewarm", db="app")
        self.pg.psql("CREATE EXTENSION pg_prewarm")
        self.pg.psql("CHECKPOINT")
        size = int(self.pg.psql("SELECT pg_database_size('app')"))
        big = int(self.pg.psql("SELECT pg_total_relation_size('big')", db="app"))
        rels = int(self.pg.psql("SELECT count(*) FROM pg_class WHERE relkind IN ('r','i','t','m')", db="app"))
        print(f"bench: PostgreSQL {self.major}: database app {size / 2**20:.0f} MiB ({big / size:.0%} in one table), "
              f"{rels} relations, loaded in {now() - t:.0f} s", flush=True)
        return {"database_bytes": size, "big_table_bytes": big, "relations": rels}

    def cold(self):
        self.pg.stop()
        self.vol.remount(latency=self.args.latency, concurrency=self.args.concurrency,
                         bandwidth_mib=self.args.bandwidth_mib, iops=self.args.iops,
                         throughput_mib=self.args.throughput_mib, burst_seconds=self.args.burst_seconds,
                         burst_iops=self.args.burst_iops, burst_throughput_mib=self.args.burst_throughput_mib,
                         latency_jitter=self.args.latency_jitter, seed=self.args.seed,
                         threads=getattr(self.args, "fuse_threads", 32))
        self.pg.start()
        return self.vol.status()

    def watch(self, proc_or_fn, limit: float):
        """Runs the strategy and samples the volume until all is fetched or `limit` seconds pass."""
        start = now()
        returned = {}
        if callable(proc_or_fn):
            th = threading.Thread(target=lambda: (proc_or_fn(), returned.setdefault("t", now() - start)), daemon=True)
            th.start()
            alive = th.is_alive
        else:
            alive = lambda: proc_or_fn.poll() is None  # noqa: E731
        samples = []
        at_return = None
        full_at = None
        while now() - start < limit:
            s = self.vol.status()
            t = now() - start
            samples.append((round(t, 3), round(s["hydrated"], 5)))
            if at_return is None and not alive():
                returned.setdefault("t", t)
                at_return = s["hydrated"]
            if s["hydrated"] >= 1.0 and full_at is None:
                full_at = t
            if full_at is not None and at_return is not None:
                break
            time.sleep(0.05)
        if not callable(proc_or_fn) and proc_or_fn.poll() is None:
            proc_or_fn.kill()
        if not callable(proc_or_fn):
            out, err = proc_or_fn.communicate()
            if proc_or_fn.returncode not in (0, None, -9):
                raise RuntimeError(f"strategy failed ({proc_or_fn.returncode}): {err[-2000:]}")
        return {"returned_s": returned.get("t"), "hydrated_at_return": at_return, "full_s": full_at,
                "final_hydrated": samples[-1][1], "samples": samples}

    # --- strategies ------------------------------------------------------------------------------------
    def pghydrate(self, *opts, binary=None):
        """Runs `pghydrate run` (this checkout's release build, or `binary`: another build to compare)."""
        report = self.workdir / "report.json"
        report.unlink(missing_ok=True)
        p = subprocess.Popen([str(binary or PGHYDRATE), "run", self.url, "--tls", "disable", "--maintenance", "none",
                              "--progress", "none", "--report", str(report), *opts],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=dict(os.environ, PGHYDRATE_LOG="error"))
        r = self.watch(p, self.args.limit)
        if not report.exists():  # stopped at the limit before it finished
            r["verified_coverage"] = None
            return r
        rep = json.loads(report.read_text())
        r["verified_coverage"] = rep["coverage"]
        r["levels"] = rep.get("levels", [])
        r["hot_set"] = rep.get("hot_set")
        r["plan_seconds"] = rep["timings"]["plan_seconds"]
        return r

    def recipe(self, sessions=15):
        """The published method: pg_prewarm(relation, 'prefetch'), one relation per call, 15 sessions."""
        rels = self.pg.psql("SELECT c.oid FROM pg_class c WHERE c.relkind IN ('r','i','t','m') "
                            "AND c.relpersistence <> 't' ORDER BY pg_relation_size(c.oid) DESC", db="app").split()
        lists = [rels[i::sessions] for i in range(sessions)]
        env = dict(os.environ, PGPASSWORD=PASSWORD)

        def one(oids):
            sql = "".join(f"SELECT pg_prewarm({o}::regclass, 'prefetch');\n" for o in oids)
            p = subprocess.run([str(self.pg.bin / "psql"), "-X", "-q", "-h", "127.0.0.1", "-p", str(self.pg.port),
                                "-U", "postgres", "-d", "app", "-f", "-"], input=sql, text=True, env=env,
                               capture_output=True)
            if p.returncode != 0:
                # Where the recipe outlasts its window (bench-normal), the next restore stops the server
                # under it: said plainly, not as a thread's traceback.
                last = (p.stderr.strip().splitlines() or ["no message"])[-1]
                print(f"bench: a recipe session ended with psql exit {p.returncode}: {last}", flush=True)

        def run_all():
            ts = [threading.Thread(target=one, args=(lst,)) for lst in lists if lst]
            [t.start() for t in ts]
            [t.join() for t in ts]

        return self.watch(run_all, self.args.recipe_limit)

    def cat(self, parallel):
        files = sorted(str(p) for p in self.vol.mnt.rglob("*") if p.is_file())
        p = subprocess.Popen(["xargs", "-0", "-P", str(parallel), "-n", "16", "cat"], stdin=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        p.stdin.write("\0".join(files))
        p.stdin.close()
        p.stdin = None
        return self.watch(p, self.args.limit)

    def close(self):
        try:
            self.pg.stop("immediate")
        finally:
            self.vol.unmount()
            shutil.rmtree(self.workdir, ignore_errors=True)


def cleanup_on_sigterm():
    """SIGTERM (kill, a CI timeout) ends the main thread with SystemExit, so its `finally` stops PostgreSQL
    and unmounts the volume, as Ctrl-C already does; without it both were left behind."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def ideal_seconds(status: dict, args) -> float:
    chunks = status["total_chunks"] - status.get("discarded_chunks", 0)
    latency = parse_ms(args.latency) / 1000
    by_latency = math.ceil(chunks / args.concurrency) * latency
    by_bandwidth = chunks * status["chunk_bytes"] / (args.bandwidth_mib * 2**20) if args.bandwidth_mib > 0 else 0
    return max(by_latency, by_bandwidth)


def parse_ms(s: str) -> float:
    return float(s[:-2]) if s.endswith("ms") else float(s[:-1]) * 1000


def svg(results: dict, path: Path):
    """Hydrated fraction over time, one line per strategy, per PostgreSQL version (stacked panels)."""
    colors = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#17becf",
              "#bcbd22"]
    panels = list(results["runs"].items())
    w, ph, left, top = 900, 320, 60, 30
    h = top + len(panels) * (ph + 60)
    tmax = max((s[-1][0] for _, runs in panels for r in runs for s in [r["samples"]] if s), default=1)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">',
           f'<rect width="{w}" height="{h}" fill="white"/>']
    for pi, (major, runs) in enumerate(panels):
        y0 = top + pi * (ph + 60)
        out.append(f'<text x="{left}" y="{y0 - 8}" font-size="14">PostgreSQL {major}: hydrated fraction of the volume '
                   f'over time (s); ideal {results["ideal_s"][major]:.1f} s</text>')
        out.append(f'<rect x="{left}" y="{y0}" width="{w - left - 220}" height="{ph}" fill="none" stroke="#999"/>')
        pw = w - left - 220
        for frac in (0, 0.25, 0.5, 0.75, 1):
            y = y0 + ph - frac * ph
            out.append(f'<text x="{left - 36}" y="{y + 4}">{frac:.2f}</text>')
        for k in range(6):
            t = tmax * k / 5
            out.append(f'<text x="{left + pw * k / 5 - 8}" y="{y0 + ph + 16}">{t:.0f}</text>')
        ix = left + pw * results["ideal_s"][major] / tmax
        out.append(f'<line x1="{ix:.1f}" y1="{y0}" x2="{ix:.1f}" y2="{y0 + ph}" stroke="#000" stroke-dasharray="4 3"/>')
        for i, r in enumerate(runs):
            pts = " ".join(f"{left + pw * t / tmax:.1f},{y0 + ph - f * ph:.1f}" for t, f in r["samples"])
            c = colors[i % len(colors)]
            out.append(f'<polyline fill="none" stroke="{c}" stroke-width="1.5" points="{pts}"/>')
            out.append(f'<text x="{w - 210}" y="{y0 + 14 + 16 * i}" fill="{c}">{r["strategy"]}</text>')
    out.append("</svg>")
    path.write_text("\n".join(out))


def compare_bins(specs):
    """`LABEL=PATH` options: other pghydrate builds to run beside this checkout's (e.g. before a change)."""
    out = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not Path(path).is_file() or not os.access(path, os.X_OK):
            raise SystemExit(f"bench: --compare-bin {spec!r}: expected LABEL=PATH of an executable pghydrate")
        out.append((label, Path(path)))
    return out


def main():
    cleanup_on_sigterm()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--majors", default="15,18")
    ap.add_argument("--scale", type=float, default=400, help="approximate MiB of the big table")
    ap.add_argument("--small", type=int, default=300, help="number of small tables")
    ap.add_argument("--latency", default="50ms")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--bandwidth-mib", type=float, default=0.0, help="fetch bandwidth from the snapshot")
    ap.add_argument("--iops", type=float, default=0.0, help="the volume's IOPS cap (0: none)")
    ap.add_argument("--throughput-mib", type=float, default=0.0, help="the volume's (instance's) MiB/s cap (0: none)")
    ap.add_argument("--burst-seconds", default="0s")
    ap.add_argument("--burst-iops", type=float, default=0.0)
    ap.add_argument("--burst-throughput-mib", type=float, default=0.0)
    ap.add_argument("--latency-jitter", default="0ms")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fuse-threads", type=int, default=32,
                    help="the simulator's FUSE worker threads: requests it serves at once, hot or cold (the matrix "
                    "of 2026-12-04 ran with 32, so its 64-deep volume served at most 32 reads at once)")
    ap.add_argument("--extra", default="", help="one more pghydrate run with these options (space-separated)")
    ap.add_argument("--compare-bin", action="append", default=[], metavar="LABEL=PATH",
                    help="also run every pghydrate strategy with this other build, named [LABEL] (repeatable)")
    ap.add_argument("--sweep", default="", help="also run pghydrate with each of these fixed --sessions "
                    "(comma-separated), e.g. 4,8,16,32,64")
    ap.add_argument("--limit", type=float, default=300, help="seconds to wait for 100%% per strategy")
    ap.add_argument("--recipe-limit", type=float, default=60, help="seconds to wait after the recipe")
    ap.add_argument("--quick", action="store_true", help="fewer strategies (defaults, recipe, cat)")
    ap.add_argument("--only", default="", help="run only the strategies whose name contains one of these "
                    "comma-separated texts")
    ap.add_argument("--repeat", type=int, default=1, help="runs per strategy; the table shows the median")
    ap.add_argument("--out", default=str(ROOT / "bench"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: needs root (FUSE mount; the servers run as the pghydrate user)")
    compare = compare_bins(args.compare_bin)
    results = {"parameters": vars(args), "databases": {}, "runs": {}, "ideal_s": {}}
    for major in [int(m) for m in args.majors.split(",")]:
        b = Bench(major, args)
        try:
            results["databases"][major] = b.load()
            runs = []
            def ph(name, *opts):  # a pghydrate strategy, and the same with each --compare-bin build
                return [(name, lambda: b.pghydrate(*opts))] + [
                    (f"{name} [{label}]", (lambda path=path: b.pghydrate(*opts, binary=path)))
                    for label, path in compare]
            strategies = ph("pghydrate (defaults)") + [
                ("published recipe: prefetch, 1 relation/call, 15 sessions", lambda: b.recipe()),
                (f"cat of the files, {args.concurrency} at once", lambda: b.cat(args.concurrency))]
            if not args.quick:
                for m in ("read", "buffer", "prefetch"):
                    strategies += ph(f"pghydrate --mode {m}", "--mode", m)
                for n in (4, 16):
                    strategies += ph(f"pghydrate --sessions {n}", "--sessions", str(n))
            for n in [int(x) for x in args.sweep.split(",") if x]:
                strategies += ph(f"pghydrate --sessions {n}", "--sessions", str(n))
            if args.extra:
                strategies += ph(f"pghydrate {args.extra}", *args.extra.split())
            for name, run in strategies:
                if args.only and not any(o and o in name for o in args.only.split(",")):
                    continue
                tries = []
                for _ in range(args.repeat):
                    cold = b.cold()
                    results["ideal_s"][major] = ideal_seconds(cold, args)
                    tries.append(run())
                # The median run by time to 100% (never reaching it sorts last), by return time otherwise.
                tries.sort(key=lambda x: (x["full_s"] is None, x["full_s"] or 0, x["returned_s"] or 0))
                r = tries[len(tries) // 2]
                r["strategy"] = name if args.repeat == 1 else f"{name} (median of {args.repeat})"
                r["all_runs"] = [{k: t[k] for k in ("returned_s", "hydrated_at_return", "full_s", "final_hydrated")}
                                 for t in tries]
                runs.append(r)
                full = f"{r['full_s']:.1f} s" if r["full_s"] is not None else f"not reached ({r['final_hydrated']:.1%})"
                print(f"bench: PostgreSQL {major}: {name}: returned {r['returned_s']:.1f} s at "
                      f"{r['hydrated_at_return']:.1%}; 100% {full}", flush=True)
            results["runs"][major] = runs
        finally:
            b.close()
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    table = ["| PostgreSQL | strategy | returned (s) | hydrated when it returned | time to 100% (s) | x ideal | verified coverage |",
             "|---|---|---|---|---|---|---|"]
    for major, runs in results["runs"].items():
        ideal = results["ideal_s"][major]
        for r in runs:
            full = f"{r['full_s']:.1f}" if r["full_s"] is not None else f"never ({r['final_hydrated']:.1%} after {r['samples'][-1][0]:.0f} s)"
            ratio = f"{r['full_s'] / ideal:.2f}" if r["full_s"] is not None else "-"
            cov = f"{r['verified_coverage']:.3f}" if r.get("verified_coverage") is not None else "-"
            table.append(f"| {major} | {r['strategy']} | {r['returned_s']:.1f} | {r['hydrated_at_return']:.1%} | {full} | {ratio} | {cov} |")
        table.append(f"| {major} | ideal (cold chunks x latency / concurrency) | | | {ideal:.1f} | 1.00 | |")
    text = "\n".join(table)
    (out / "results.md").write_text(text + "\n")
    svg(results, out / "hydration.svg")
    print(text)
    print(f"bench: wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'hydration.svg'}")


if __name__ == "__main__":
    main()

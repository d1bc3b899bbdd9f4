"""The benchmark matrix (`make bench-matrix`): pghydrate's defaults against a sweep of fixed session counts
and the published recipe, on several simulated volumes.

For each volume (queue depth, fetch latency, and optionally an IOPS cap, a throughput cap and a burst),
scripts/bench.py runs on the same skewed database: pghydrate with no flag (`--sessions auto`),
`--sessions N` for each N of the sweep, and the published recipe. The best fixed count is the achievable
reference; the goal is the defaults within 1.15x of it. Writes bench/matrix.json and bench/matrix.md and
prints the table. Needs root (FUSE). Every volume parameter is in the output.

    python3 scripts/bench-matrix.py [--majors 15] [--sweep 4,8,16,32,64] [--volumes NAME,...]
"""
import argparse
import json
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> bench.py volume options: the grid of queue depth x fetch latency, then the capped volumes
VOLUMES = {
    **{f"q{depth}-{ms}ms": ["--concurrency", str(depth), "--latency", f"{ms}ms"]
       for depth in (4, 8, 32, 64) for ms in (5, 20, 50)},
    "q32-20ms-iops2000": ["--concurrency", "32", "--latency", "20ms", "--iops", "2000"],
    "q32-20ms-100mib-burst": ["--concurrency", "32", "--latency", "20ms", "--throughput-mib", "100",
                              "--burst-throughput-mib", "250", "--burst-seconds", "3s"],
    "q16-20ms-jitter": ["--concurrency", "16", "--latency", "20ms", "--latency-jitter", "15ms"],
}

GOAL = 1.15


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--majors", default="15")
    ap.add_argument("--sweep", default="4,8,16,32,64")
    ap.add_argument("--volumes", default=",".join(VOLUMES), help="comma-separated names: " + ", ".join(VOLUMES))
    ap.add_argument("--fuse-threads", type=int, default=32, help="passed to bench.py")
    ap.add_argument("--out", default=str(ROOT / "bench"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    rows, everything = [], {}
    for name in args.volumes.split(","):
        vout = out / f"matrix-{name}"
        cmd = [sys.executable, str(ROOT / "scripts" / "bench.py"), "--majors", args.majors, "--quick",
               "--only", "pghydrate,recipe", "--sweep", args.sweep, "--fuse-threads", str(args.fuse_threads), "--out", str(vout), *VOLUMES[name]]
        print(f"bench-matrix: {name}: {' '.join(cmd[1:])}", flush=True)
        child = subprocess.Popen(cmd)
        # SIGTERM here goes on to the volume's run, whose cleanup stops its server and unmounts.
        signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))
        if child.wait() != 0:
            raise SystemExit(f"bench-matrix: {name}: bench.py exited with {child.returncode}")
        res = json.loads((vout / "results.json").read_text())
        everything[name] = {"options": VOLUMES[name], "results": res}
        for major, runs in res["runs"].items():
            by = {r["strategy"]: r for r in runs}
            defaults = by["pghydrate (defaults)"]
            fixed = [(int(s.split()[-1]), r) for s, r in by.items() if s.startswith("pghydrate --sessions ")]
            fixed = [(n, r) for n, r in fixed if r["full_s"] is not None]
            best_n, best = min(fixed, key=lambda x: x[1]["full_s"])
            recipe = next(r for s, r in by.items() if s.startswith("published recipe"))
            ratio = defaults["full_s"] / best["full_s"] if defaults["full_s"] else None
            rows.append({
                "volume": name, "major": major, "options": " ".join(VOLUMES[name]),
                "ideal_s": res["ideal_s"][major],
                "defaults_s": defaults["full_s"],
                "levels": [lv["sessions"] for lv in defaults.get("levels", [])],
                "best_fixed": best_n, "best_fixed_s": best["full_s"],
                "fixed": {n: r["full_s"] for n, r in sorted(fixed)},
                "defaults_over_best": ratio,
                "recipe_returned_s": recipe["returned_s"], "recipe_hydrated_at_return": recipe["hydrated_at_return"],
                "recipe_full_s": recipe["full_s"],
            })
    (out / "matrix.json").write_text(json.dumps({"rows": rows, "runs": everything}, indent=1))
    table = ["| volume | PG | ideal (s) | defaults (s) | levels | best fixed | fixed sweep (s) | defaults / best | "
             f"within {GOAL}x | recipe: returned (s), hydrated then |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        sweep = ", ".join(f"{n}: {s:.1f}" for n, s in r["fixed"].items())
        levels = " -> ".join(map(str, r["levels"][:6])) + (" ..." if len(r["levels"]) > 6 else "")
        ok = "met" if r["defaults_over_best"] and r["defaults_over_best"] <= GOAL else "missed"
        table.append(f"| {r['volume']} | {r['major']} | {r['ideal_s']:.1f} | {r['defaults_s']:.1f} | {levels} | "
                     f"{r['best_fixed']} ({r['best_fixed_s']:.1f} s) | {sweep} | {r['defaults_over_best']:.2f} | {ok} | "
                     f"{r['recipe_returned_s']:.1f}, {r['recipe_hydrated_at_return']:.1%} |")
    text = "\n".join(table)
    (out / "matrix.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

"""The lazy-volume simulator (sim/) never loses or corrupts a byte, and is lazy: a PostgreSQL tablespace
on it, written, then read back cold, checks out (table contents, amcheck on its indexes, every file
byte-identical to its backing file), and the first read of each chunk is what fetches it."""
import hashlib
import os
import shutil
import time
import tempfile
from pathlib import Path

import pytest

from lazyvol import Volume
from twin import HOME, ROOT, RUN_AS, Postgres

BINARY = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug" / "pghydrate-lazyvol"


@pytest.fixture()
def workdir():
    d = Path(tempfile.mkdtemp(prefix="lazyvol-", dir=HOME))
    shutil.chown(d, RUN_AS)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def digest(pg, db):
    return pg.psql("SELECT md5(string_agg(t::text, ',' ORDER BY id)) FROM t", db=db)


@pytest.mark.parametrize("major", [15, 18])
def test_a_tablespace_on_the_lazy_volume_reads_back_intact_and_cold(workdir, major):
    vol = Volume(workdir, BINARY)
    pg = None
    try:
        vol.mount(latency="0ms")
        pg = Postgres(workdir, {"shared_buffers": "32MB"}, major=major)
        pg.psql(f"CREATE TABLESPACE lazy LOCATION '{vol.mnt}'")
        pg.psql("CREATE DATABASE app TABLESPACE lazy")
        pg.psql("CREATE EXTENSION amcheck; CREATE TABLE t (id int PRIMARY KEY, v text, big text);"
                "INSERT INTO t SELECT g, md5(g::text), CASE WHEN g % 100 = 0 THEN repeat(md5(g::text), 400) END"
                "  FROM generate_series(1, 200000) g; CREATE INDEX t_v ON t (v)", db="app")
        pg.psql("VACUUM ANALYZE t", db="app")
        before = digest(pg, "app")
        pg.stop()

        vol.remount(latency="2ms", concurrency=4)
        time.sleep(0.2)
        cold = vol.status()
        assert cold["fetched_chunks"] == 0 and cold["total_chunks"] > 40, cold
        pg.start()
        assert digest(pg, "app") == before
        pg.psql("SELECT bt_index_check('t_pkey', true), bt_index_check('t_v', true)", db="app")
        time.sleep(0.2)
        warm = vol.status()
        assert warm["fetched_chunks"] > 0 and warm["cold_reads"] > 0, warm
        assert warm["fetched_chunks"] <= warm["total_chunks"]
        pg.stop()
        # Byte for byte, through the volume (cold again) and beside it.
        vol.remount(latency="0ms", concurrency=8)
        files = [p for p in vol.back.rglob("*") if p.is_file()]
        assert len(files) > 20
        for f in files:
            through = vol.mnt / f.relative_to(vol.back)
            assert hashlib.sha256(through.read_bytes()).digest() == hashlib.sha256(f.read_bytes()).digest(), f
        time.sleep(0.2)  # the status file is rewritten every 20 ms
        done = vol.status()
        assert done["hydrated"] == 1.0 and done["fetched_chunks"] == done["total_chunks"], done
    finally:
        if pg:
            pg.stop("immediate")
        vol.unmount()


def read_through(vol, name: str) -> float:
    """Reads a file through the volume in 1 MiB reads; returns the seconds it took."""
    started = time.monotonic()
    with open(vol.mnt / name, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass
    return time.monotonic() - started


def test_the_volume_enforces_its_iops_throughput_and_burst(workdir):
    """What an instance's volume adds to the lazy fetch: every read request costs I/O operations (one
    per 256 KiB) against an IOPS cap, all reads share a throughput cap, and a burst allowance runs out.
    Each cap is checked from below (the time a read must at least take), where a clock cannot flake."""
    vol = Volume(workdir, BINARY)
    for name in ("a", "b", "c", "d"):
        (vol.back / name).write_bytes(os.urandom(16 << 20))
    try:
        vol.mount(latency="0ms", iops=50)
        took = read_through(vol, "a")
        time.sleep(0.1)
        s = vol.status()
        assert s["read_bytes"] >= 16 << 20 and s["io_ops"] >= 64, s
        assert took >= (s["io_ops"] - 1) / 50 * 0.95, (took, s)
        assert s["paced_seconds"] > 0, s

        vol.remount(latency="0ms", throughput_mib=8)
        took = read_through(vol, "b")
        assert took >= 16 / 8 * 0.95, took

        # 1 s of burst at 1,000 IOPS, then 20: the first file's requests fit in the burst, the next
        # one's do not.
        vol.remount(latency="0ms", iops=20, burst_iops=1000, burst_seconds="1s")
        took = read_through(vol, "c")
        time.sleep(0.1)
        s = vol.status()
        ops_in_burst = s["io_ops"]
        # The volume's own account of the time it held reads back (not a clock, which a busy machine
        # stretches): at the baseline these requests would have been held ops / 20 s.
        assert ops_in_burst >= 64 and s["paced_seconds"] < ops_in_burst / 20 / 2, (s, "the burst did not apply")
        time.sleep(max(0.0, 1.1 - took))
        took = read_through(vol, "d")
        time.sleep(0.1)
        ops_after = vol.status()["io_ops"] - ops_in_burst
        assert took >= (ops_after - 1) / 20 * 0.95, (took, ops_after, "the baseline did not apply after the burst")
        for k, v in (("iops", 20), ("burst_iops", 1000), ("burst_seconds", 1.0)):
            assert vol.status()[k] == v, vol.status()
    finally:
        vol.unmount()

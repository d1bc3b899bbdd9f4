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

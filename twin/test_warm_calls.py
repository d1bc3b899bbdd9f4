"""How the workflow spreads an instance's sessions over Warm calls, on a database whose tablespace is a
lazy-loaded volume (sim/, pghydrate-lazyvol): each call drives several sessions (it waits on the
database, not on its CPU, and Lambda bills per call), never more than half the server's free
connection slots in all, and every block of the volume is fetched."""
import json
import os
import threading
import time
from pathlib import Path

import pytest

from lazyvol import mounted
from twin import HOME, PASSWORD, ROOT, Twin

BINARY = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug" / "pghydrate-lazyvol"
# The server's slots: 40, less 3 reserved for superusers and the twin's own; pghydrate takes at most half
# of what is free.
MAX_CONNECTIONS = 40


@pytest.fixture(scope="module")
def lazy_twin():
    with mounted(BINARY, HOME, latency="0ms") as vol:
        with Twin.start(lambda_timeout=60, margin=5, mode="read",
                        pg_conf={"max_connections": str(MAX_CONNECTIONS), "shared_buffers": "32MB"}) as t:
            t.pg.psql(f"CREATE TABLESPACE lazy LOCATION '{vol.mnt}'")
            t.pg.psql("CREATE DATABASE lazy TABLESPACE lazy")
            # 8 tables of ~20 MiB with an index each: 190 MiB, about 380 chunks of 512 KiB.
            t.pg.psql("""DO $$ BEGIN FOR i IN 1..8 LOOP
                           EXECUTE format('CREATE TABLE t%s AS SELECT g AS id, md5(g::text) AS v
                                             FROM generate_series(1, 250000) g', i);
                           EXECUTE format('CREATE INDEX ON t%s (id)', i);
                         END LOOP; END $$""", db="lazy")
            t.pg.psql("VACUUM", db="lazy")
            t.pg.stop()
            # Cold: 40 ms per fetch, 64 fetches at once. One session would need about 15 s.
            vol.remount(latency="40ms", concurrency=64)
            t.pg.start()
            t.vol = vol
            yield t
            assert t.places_containing(PASSWORD) == []
            t.pg.stop()


class SessionSampler:
    """Samples pghydrate's connections (application_name "pghydrate <execution>") every few ms while a
    run goes on: the most open at once, and the most reading (state active) at once."""

    def __init__(self, pg):
        self.pg, self.peak_open, self.peak_active, self.samples = pg, 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            row = self.pg.psql("SELECT count(*), count(*) FILTER (WHERE state = 'active') FROM pg_stat_activity "
                               "WHERE application_name LIKE 'pghydrate %'")
            opened, active = (int(x) for x in row.split("|"))
            self.peak_open, self.peak_active = max(self.peak_open, opened), max(self.peak_active, active)
            self.samples += 1
            time.sleep(0.02)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def test_a_warm_call_reads_with_several_sessions_within_half_the_free_slots(lazy_twin):
    t = lazy_twin
    t.register_instance("lazy-restored", script=[{"status": "available"}] * 20)
    with SessionSampler(t.pg) as sampler:
        d, history = t.run({"instance": "lazy-restored", "include_databases": ["lazy"], "maintenance": "none"})
    assert d["status"] == "SUCCEEDED", (d.get("error"), d.get("cause"), t.report_of(history))
    inst = json.loads(d["output"])["instances"][0]
    assert inst["coverage"] == 1.0 and inst["warmed_bytes"] == inst["total_bytes"] > 150 * 2**20, inst
    # Every chunk of the volume was fetched: the volume's own account, not pghydrate's.
    time.sleep(0.1)
    status = t.vol.status()
    assert status["hydrated"] == 1.0, status
    # Sized from the server: at most half of the free slots (40 less 3 reserved less the few in use).
    warm = inst["warm"]
    cap = (MAX_CONNECTIONS - 3 - 1) // 2
    assert warm["calls_at_once"] == 1 and 2 <= warm["sessions_per_call"] <= cap, warm
    assert "free connection slots" in warm["note"], warm
    # Seen from the server: several sessions read at once, and never more than the plan allowed.
    assert sampler.samples > 20, sampler.samples
    assert 2 <= sampler.peak_active <= sampler.peak_open <= warm["sessions_per_call"], vars(sampler)
    # Billed time: the calls' durations add up to more than nothing and less than the execution.
    run_seconds = (d["stopDate"] - d["startDate"]).total_seconds()
    assert 0 < warm["call_seconds"] < run_seconds, (warm, run_seconds)
    print(f"measured: {inst['warmed_bytes'] / 2**20:.0f} MiB in {warm['calls']} warm calls, "
          f"{warm['call_seconds']} s billed, peak {sampler.peak_active} sessions reading "
          f"({sampler.peak_open} open) of {warm['sessions_per_call']} allowed; execution {run_seconds:.1f} s")

"""The warm phase against a slow volume, through the twin (real state machine, real Lambda binaries, real
PostgreSQL): a table whose files live on the lazy-loading volume simulator (sim/, pghydrate-lazyvol) at
250 ms per cold 512 KiB chunk and at most 4 fetches at once. The volume, not the machine's CPU, sets how
fast the table can be read at most (8 MiB/s), so what the tests need happens whatever the machine:
- Warm calls of 7 s (12 s timeout, 5 s margin) cannot read it in one call, and a 64 MiB statement
  cannot end within one: the deadline cuts ranges, and the item continues call after call;
- a restart and an outage are made while a call is reading a range, as the server itself shows it
  (a session in pg_prewarm, a call that began less than 3 s before), not after a guessed sleep.
Every test begins with a cold volume; conftest.py starts the server again after a test that failed
with it down."""
import datetime
import json
import math
import os
import time
from pathlib import Path

import pytest

from lazyvol import mounted
from test_scenarios import unbuffered_forks
from twin import HOME, PASSWORD, ROOT, Twin

BINARY = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug" / "pghydrate-lazyvol"
LATENCY_S, FETCHES_AT_ONCE = 0.25, 4
LAMBDA_TIMEOUT, MARGIN, RECONNECT = 12, 5, 3
WINDOW = LAMBDA_TIMEOUT - MARGIN


@pytest.fixture(scope="module")
def slow_twin():
    with mounted(BINARY, HOME, latency="0ms") as vol:
        # Whole 64 MiB ranges per statement (no 8 MiB steps): statements longer than a call's window.
        # A Warm call gives up on a lost database after 3 s (ConnectionFailed, retried by the state machine).
        with Twin.start(lambda_timeout=LAMBDA_TIMEOUT, margin=MARGIN, mode="buffer",
                        pg_conf={"shared_buffers": "512MB"},
                        env={"PGHYDRATE_STEP_BLOCKS": "8192", "PGHYDRATE_RECONNECT_SECONDS": str(RECONNECT)}) as t:
            t.pg.psql(f"CREATE TABLESPACE lazy LOCATION '{vol.mnt}'")
            t.pg.psql("CREATE DATABASE big")  # its catalogs on the ordinary disk: planning is not slowed
            t.pg.psql("CREATE TABLE big TABLESPACE lazy AS SELECT g AS id, md5(g::text) AS payload "
                      "FROM generate_series(1, 1500000) g; CREATE INDEX big_id ON big (id) TABLESPACE lazy;"
                      "CREATE EXTENSION pg_buffercache", db="big")
            t.pg.psql("VACUUM big", db="big")
            t.vol = vol
            yield t
            assert t.places_containing(PASSWORD) == []


@pytest.fixture()
def cold(slow_twin):
    """The slow twin with everything cold (shared buffers, the kernel's cache, the volume)."""
    t = slow_twin
    t.pg.stop()
    t.vol.remount(latency=f"{int(LATENCY_S * 1000)}ms", concurrency=FETCHES_AT_ONCE)
    t.pg.start()
    return t


def least_seconds(vol) -> float:
    """The least time the volume needs to deliver every chunk (its latency, its fetches at once)."""
    return vol.status()["total_chunks"] * LATENCY_S / FETCHES_AT_ONCE


def warm_calls(history) -> list:
    """Timestamps of every call of the Warm function (inline or distributed)."""
    return [e["timestamp"] for e in history
            if e.get("stateEnteredEventDetails", {}).get("name") in ("WarmItem", "DistributedWarmItem")]


def wait_mid_read(t, arn: str, within: float = 3.0, timeout: float = 300):
    """Returns once a Warm call that began less than `within` seconds ago has a session reading a range
    (in pg_prewarm, as the server shows it): a restart or an outage made now cuts a statement midway,
    with most of the call's window still to come. Fails with what was seen if that never happens."""
    started, seen = time.time(), None
    while time.time() < started + timeout:
        reading = int(t.pg.psql("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'pghydrate %' "
                                "AND state = 'active' AND query LIKE '%pg_prewarm%' AND query NOT LIKE '%pg_depend%'"))
        # The history (children included) only once a session reads: it is the costlier look.
        calls = warm_calls(t.history(arn)) if reading else None
        now = datetime.datetime.now(datetime.timezone.utc)
        seen = (calls and len(calls), reading, t.vol.status()["fetched_chunks"])
        if calls and (now - max(calls)).total_seconds() < within:
            return
        time.sleep(0.1)
    raise AssertionError(f"no Warm call was reading within {within} s of its start in {timeout} s "
                         f"(warm calls, sessions in pg_prewarm, chunks fetched): {seen}")


def assert_every_block_read_once(t, d, history):
    assert d["status"] == "SUCCEEDED", (d.get("error"), t.report_of(history))
    inst = json.loads(d["output"])["instances"][0]
    # Exactly: every planned byte warmed once (a range counted twice would push warmed past total).
    assert inst["coverage"] == 1.0 and inst["warmed_bytes"] == inst["total_bytes"] > 100 << 20, inst
    # The volume's own account: every chunk of the table was fetched.
    time.sleep(0.1)  # its status file is rewritten every 20 ms
    assert t.vol.status()["hydrated"] == 1.0, t.vol.status()


def test_a_tiny_deadline_on_a_large_table_continues_until_exactly_full_coverage(cold):
    t = cold
    least = least_seconds(t.vol)
    t.register_instance("slow-db", script=[{"status": "available"}] * 10)
    d, history = t.run({"instance": "slow-db", "include_databases": ["big"], "maintenance": "none"}, timeout=900)
    assert_every_block_read_once(t, d, history)
    # The volume cannot deliver the table in less than `least` seconds, and a call reads for at most
    # WINDOW: the item had to continue in that many calls at least.
    calls = warm_calls(history)
    assert len(calls) >= math.ceil(least / WINDOW) >= 3, (len(calls), least)
    # The deadline cut 64 MiB statements mid-range, and they still ended (halved, in later calls).
    assert "deadline cut a range" in t.log_text()
    assert unbuffered_forks(t.pg, "big") == []
    print(f"measured: {len(calls)} Warm calls of {WINDOW} s for a table the volume delivers in {least:.0f} s at least")


def test_the_database_restarted_during_the_warm_phase_still_ends_with_full_coverage(cold):
    t = cold
    t.register_instance("restart-db", script=[{"status": "available"}] * 10)
    arn = t.start_execution({"instance": "restart-db", "include_databases": ["big"], "maintenance": "none"})
    wait_mid_read(t, arn)
    lost_before = t.log_text().count("session lost")
    t.pg.restart()
    restarted = datetime.datetime.now(datetime.timezone.utc)
    d, history = t.wait(arn, timeout=900)
    assert_every_block_read_once(t, d, history)
    # The restart came early in the reading (at most 3 s into a call that cannot read it all): calls
    # before it and after it.
    calls = warm_calls(history)
    assert any(c < restarted for c in calls) and any(c > restarted for c in calls), calls
    assert t.log_text().count("session lost") > lost_before, "the restart should have cut sessions mid-range"


def test_a_database_down_longer_than_the_reconnect_window_fails_the_call_and_the_retry_finishes(cold):
    """PostgreSQL stops for 12 s in the middle of a Warm call's reading, four times the function's
    reconnect window (3 s here, 120 s by default). The call that lost it keeps its ranges pending and
    fails with ConnectionFailed; the state machine's Retry calls again with backoff, and once the server
    is back the item is read to the end: every byte once, coverage 1.0."""
    t = cold
    t.register_instance("outage-db", script=[{"status": "available"}] * 10)
    arn = t.start_execution({"instance": "outage-db", "include_databases": ["big"], "maintenance": "none"})
    wait_mid_read(t, arn)
    t.pg.stop("immediate")
    try:
        time.sleep(4 * RECONNECT)  # the outage: its length is the scenario
    finally:
        t.pg.start()
    d, history = t.wait(arn, timeout=900)
    assert_every_block_read_once(t, d, history)
    failed = [e for e in history if e["type"].endswith("Failed") and "ConnectionFailed" in json.dumps(e, default=str)]
    assert failed, "a Warm call should have failed with ConnectionFailed while the server was down"
    assert "unreachable for the whole reconnect window" in json.dumps(history, default=str)

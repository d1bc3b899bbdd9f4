"""A server of tenant databases, through the twin (real state machine, real Lambda binaries, real
PostgreSQL): 2,000 databases, of which the run includes 30 by pattern. The plan summary lists a bounded
number of databases and counts them all; maintenance walks the included databases by name, one at a time,
with nothing but a cursor in the state. One entry per database in the state (as before) was over
Step Functions' 256 KiB: on AWS the execution fails with States.DataLimitExceeded, which no Catch takes.
Disk: about 7 MiB per database (template0), 14 GiB in all, removed with the twin.
"""
import json
import os
import subprocess

import pytest

from test_scale import unbuffered_forks
from test_scenarios import largest_payload
from twin import PASSWORD, Twin

TENANTS = 2000
INCLUDED = 30


def tenant(i: int) -> str:
    # Tenant databases are often named after an account id: long names, as here, make each entry longer.
    return f"tenant_{i:05d}_acct_7f3e9c2a_4b1d_4e8f_9a6c_{i:012d}"


@pytest.fixture(scope="module")
def twin():
    # Shared buffers hold the included databases whole, so that pg_buffercache shows every block read.
    # Calls of at most 120 s (every function, Plan too: planning 30 cold databases one after another
    # took longer than 30 s here).
    with Twin.start(lambda_timeout=120, margin=10, mode="buffer", pg_conf={"shared_buffers": "1GB"}) as t:
        t.pg.psql("CREATE EXTENSION pg_buffercache", db="template1")
        # One psql reading the statements (CREATE DATABASE runs outside a transaction block); FILE_COPY
        # copies template1's files instead of writing them to the WAL.
        script = "".join(f'CREATE DATABASE "{tenant(i)}" STRATEGY FILE_COPY;\n' for i in range(TENANTS))
        subprocess.run([str(t.pg.bin / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1",
                        "-p", str(t.pg.port), "-U", "postgres", "-d", "postgres"], input=script, text=True,
                       check=True, capture_output=True, env=dict(os.environ, PGPASSWORD=PASSWORD))
        for i in range(INCLUDED + 1):
            t.pg.psql("CREATE TABLE orders (id int PRIMARY KEY, note text);"
                      "INSERT INTO orders SELECT g, md5(g::text) FROM generate_series(1, 2000) g", db=tenant(i))
        yield t


def test_a_server_of_2000_tenant_databases_hydrates_the_included_ones_within_the_state_limit(twin):
    # What the plan summary carried before: one entry per database on the server.
    reason = "not matched by the include patterns (or excluded by default)"
    unbounded = len(json.dumps([{"name": tenant(i), "outcome": "excluded", "reason": reason}
                                for i in range(TENANTS)]))
    assert unbounded > 256 * 1024, f"{unbounded} bytes: the scenario would not have failed before"

    twin.pg.restart()  # cold
    twin.register_instance("tenants-db", script=[{"status": "available"}] * 10)
    patterns = ["tenant_0000*", "tenant_0001*", "tenant_0002*"]  # tenants 0-29
    d, history = twin.run({"instance": "tenants-db", "include_databases": patterns, "maintenance": "analyze"},
                          timeout=1800)
    assert d["status"] == "SUCCEEDED", (d.get("error"), d.get("cause"), twin.report_of(history))
    out = json.loads(d["output"])
    inst = out["instances"][0]
    assert out["status"] == "complete" and out["coverage"] == 1.0, inst
    assert inst["databases"]["planned"] == INCLUDED, inst["databases"]
    assert inst["databases"]["excluded"] >= TENANTS - INCLUDED, inst["databases"]
    size, where = largest_payload(history)
    assert size < 128 * 1024, (size, where)

    # Every block of every included database read; the first excluded tenant untouched.
    for i in range(INCLUDED):
        assert unbuffered_forks(twin.pg, tenant(i)) == [], f"{tenant(i)}: a fork was not read"
    assert unbuffered_forks(twin.pg, tenant(INCLUDED)) != [], "an excluded database was read"

    # Maintenance reached every included database and no other.
    maintained = inst["maintenance"]
    assert maintained["skipped_count"] == 0, maintained
    calls = [e for e in history if e["type"] == "TaskStateEntered"
             and e["stateEnteredEventDetails"]["name"] == "Maintain"]
    analyzed = [i for i in range(INCLUDED + 1) if twin.pg.psql(
        "SELECT count(*) FROM pg_stat_user_tables WHERE relname = 'orders' AND last_analyze IS NOT NULL",
        db=tenant(i)) == "1"]
    assert analyzed == list(range(INCLUDED)), analyzed
    assert maintained["done"] == INCLUDED, maintained
    print(f"\nmeasured: {TENANTS:,} databases, {INCLUDED} included: {inst['total_bytes'] / 2**20:.1f} MiB read; "
          f"{len(calls)} Maintain calls; largest payload {size:,} bytes ({where}); the unbounded database list "
          f"alone was {unbounded:,} bytes")

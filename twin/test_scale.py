"""The workflow at the relation counts customers have, through the twin (real state machine, real Lambda
binaries, real PostgreSQL): every block read, and every state of every execution (children included)
far below Step Functions' 256 KiB.

- 20,000 relations: 5,000 tables, each with a primary key and a TOASTable text column (heap, TOAST table,
  TOAST index, primary key index), three rows each.
- 100,000 relations: 100,000 tables without columns, whose only blocks are the catalogs that describe
  them (pg_class, pg_attribute, pg_type, pg_depend: about 244 MiB).
Both run in `make test` and `make e2e` (about 1 minute each here).
"""
import json
import time

import pytest

from test_scenarios import largest_payload
from twin import Twin

@pytest.fixture(scope="module")
def twin():
    # Shared buffers hold the whole database, so that pg_buffercache shows every block read.
    with Twin.start(lambda_timeout=60, margin=10, mode="buffer", pg_conf={"shared_buffers": "1GB"}) as t:
        yield t


def create_tables(pg, db: str, count: int, ddl: str, fill: str = "", batch: int = 1000):
    """`count` tables from `ddl` (a format() pattern for the table's number), committed `batch` at a time:
    one transaction would need a lock per table, far past max_locks_per_transaction."""
    pg.psql(f"CREATE DATABASE {db}")
    for start in range(1, count + 1, batch):
        end = min(start + batch - 1, count)
        pg.psql(f"""DO $$ BEGIN FOR i IN {start}..{end} LOOP
                      EXECUTE format('{ddl}', i);
                      {f"EXECUTE format('{fill}', i);" if fill else ""}
                    END LOOP; END $$""", db=db)
    pg.psql("CREATE EXTENSION pg_buffercache", db=db)
    pg.psql("VACUUM", db=db)


def unbuffered_forks(pg, db: str) -> list:
    """Forks of `db` with blocks that are not all in shared buffers: one pass over pg_buffercache (the
    per-fork subquery of test_scenarios would scan it once per fork)."""
    rows = pg.psql(
        """WITH buffered AS (
               SELECT relfilenode, relforknumber, count(DISTINCT relblocknumber) AS blocks FROM public.pg_buffercache
                WHERE reldatabase IN (0, (SELECT oid FROM pg_database WHERE datname = current_database()))
                GROUP BY 1, 2)
           SELECT c.oid::regclass || ' ' || f.fork FROM pg_class c
             CROSS JOIN (VALUES ('main', 0), ('fsm', 1), ('vm', 2), ('init', 3)) f(fork, num)
             LEFT JOIN buffered b ON b.relfilenode = pg_relation_filenode(c.oid) AND b.relforknumber = f.num
            WHERE c.relkind IN ('r', 'i', 't', 'm', 'S') AND c.relpersistence <> 't'
              AND pg_relation_size(c.oid, f.fork) > 0
              AND coalesce(b.blocks, 0) < pg_relation_size(c.oid, f.fork) / current_setting('block_size')::int""",
        db=db)
    return [r for r in rows.splitlines() if r]


def relations(pg, db: str) -> int:
    return int(pg.psql("SELECT count(*) FROM pg_class WHERE relkind IN ('r', 'i', 't', 'm', 'S', 'p', 'I')", db=db))


def hydrate_at_scale(twin, db: str, instance: str, timeout: float):
    twin.pg.restart()  # cold
    twin.register_instance(instance, script=[{"status": "available"}] * 10)
    started = time.time()
    d, history = twin.run({"instance": instance, "include_databases": [db], "maintenance": "none"}, timeout=timeout)
    took = time.time() - started
    assert d["status"] == "SUCCEEDED", (d.get("error"), d.get("cause"), twin.report_of(history))
    out = json.loads(d["output"])
    inst = out["instances"][0]
    assert out["coverage"] == 1.0 and inst["warmed_bytes"] == inst["total_bytes"] > 0, inst
    assert unbuffered_forks(twin.pg, db) == [], "a fork was not read"
    size, where = largest_payload(history)
    assert size < 128 * 1024, (size, where)
    parent = twin.history(d["executionArn"], children=False)
    print(f"\nmeasured: {relations(twin.pg, db):,} relations in {db}: {inst['total_bytes'] / 2**20:.1f} MiB read in "
          f"{took:.0f} s; history {len(parent)} events in the parent, {len(history)} with children; "
          f"largest payload {size:,} bytes ({where})")


def test_twenty_thousand_relations_hydrate(twin):
    create_tables(twin.pg, "rel20k", 5000, "CREATE TABLE t%s (id int PRIMARY KEY, body text)",
                  "INSERT INTO t%s SELECT g, repeat(md5(g::text), 300) FROM generate_series(1, 3) g", batch=500)
    assert relations(twin.pg, "rel20k") >= 20_000
    hydrate_at_scale(twin, "rel20k", "rel20k-db", timeout=1800)


def test_a_hundred_thousand_relations_hydrate(twin):
    create_tables(twin.pg, "rel100k", 100_000, "CREATE TABLE t%s ()", batch=2000)
    assert relations(twin.pg, "rel100k") >= 100_000
    hydrate_at_scale(twin, "rel100k", "rel100k-db", timeout=3600)

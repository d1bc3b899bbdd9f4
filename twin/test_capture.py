"""The scheduled hot-set capture (infra/template.yaml CaptureFunction, on when CaptureInstances is set):
the schedule's event starts one asynchronous call per listed instance, of the real capture binary; each
captures what the real PostgreSQL's buffers hold into each database, or skips with why (not available, a
hydration run holds its lease); a database a hostile user prepared is refused and fails the call, the
others still captured; an instance not listed is refused. A restore of the captured server then reads
the hot set first through the real state machine. Run with `make e2e` (part of `make test`)."""
import datetime
import json
import time

import botocore.exceptions
import pytest

from twin import ACCOUNT, PASSWORD, Twin

# The Plan call's lock timeout here: planning waits for a locked relation up to three of them (90 s,
# within the Plan call's 110 s), the time the restore test's head start has to end.
LOCK_TIMEOUT = 30

SCHEDULED = {"version": "0", "id": "7bf73129-1428-4cd3-a780-95db273d1602", "detail-type": "Scheduled Event",
             "source": "aws.events", "account": ACCOUNT, "time": "2026-12-05T17:00:00Z", "region": "us-east-1",
             "resources": [f"arn:aws:events:us-east-1:{ACCOUNT}:rule/pghydrate-CaptureFunctionScheduled"],
             "detail": {}}


@pytest.fixture(scope="module")
def twin():
    # Minimum uptime 0: the twin's server has just started (the minimum itself is tested in
    # tests/tests/hotset.rs, against a restarted server).
    with Twin.start(lambda_timeout=120, margin=10, mode="buffer",
                    env={"PGHYDRATE_CAPTURE_INSTANCES": "db-source,db-stopped,db-leased",
                         "PGHYDRATE_CAPTURE_MIN_UPTIME_MINUTES": "0", "PGHYDRATE_LOCK_TIMEOUT_SECONDS": str(LOCK_TIMEOUT)}) as t:
        t.pg.load_sample("app", 1)
        t.pg.psql("CREATE EXTENSION pg_buffercache")
        yield t
        assert t.places_containing(PASSWORD) == []


def capture_of(pg, db: str):
    """(captured_at, ranges) of the database's stored capture, or None."""
    has = pg.psql("SELECT count(*) FROM pg_namespace WHERE nspname = 'pghydrate'", db=db)
    if has == "0":
        return None
    row = pg.psql("SELECT (SELECT captured_at FROM pghydrate.capture), (SELECT count(*) FROM pghydrate.hot_set)", db=db)
    at, ranges = row.split("|")
    return at, int(ranges)


HEAD_START_ENDED = "head start ended with planning"


def source_instance(twin) -> str:
    """The captured instance, db-source, available: registered by whichever test needs it first."""
    try:
        twin.client("rds").describe_db_instances(DBInstanceIdentifier="db-source")
        exists = True
    except botocore.exceptions.ClientError:
        exists = False
    twin.register_instance("db-source", script=[{"status": "available"}], create=not exists)
    return "db-source"


def wait_async(twin, count: int, timeout: float = 400) -> list:
    end = time.time() + timeout
    while time.time() < end:
        calls = twin.async_invocations()
        if len(calls) >= count and all(c["status"] != "running" for c in calls):
            return calls
        time.sleep(0.5)
    raise TimeoutError(twin.async_invocations())


def test_the_schedule_captures_each_listed_instance_in_a_call_of_its_own(twin):
    pg = twin.pg
    pg.psql("SELECT count(*) FROM customers; SELECT count(*) FROM documents", db="app")
    source_instance(twin)
    twin.register_instance("db-stopped", script=[{"status": "stopped"}])
    twin.register_instance("db-leased", script=[{"status": "available"}])
    # A hydration run holds db-leased (its execution just started: not yet visible to DescribeExecution).
    since = datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")
    twin.client("s3").put_object(Bucket="pghydrate-twin-state", Key="leases/db-leased.json", Body=json.dumps({
        "execution": "restore-42", "since": since,
        "execution_arn": f"arn:aws:states:us-east-1:{ACCOUNT}:execution:pghydrate-twin-hydrate:restore-42"}).encode())
    assert capture_of(pg, "app") is None

    error, out = twin.invoke("capture", SCHEDULED)
    assert error is None, out
    # The list arrived whole (commas and all) and each instance got a call of its own.
    assert out == {"dispatched": ["db-source", "db-stopped", "db-leased"]}, out
    calls = {c["payload"]["instance"]: c for c in wait_async(twin, 3)}
    assert set(calls) == {"db-source", "db-stopped", "db-leased"}, calls
    assert all(c["function"] == "capture" for c in calls.values()), calls

    source = calls["db-source"]
    assert source["status"] == "succeeded", source
    assert source["response"]["outcome"] == "captured", source
    captured = {d["database"]: d for d in source["response"]["report"]["databases"]}
    assert "app" in captured and captured["app"]["ranges"] > 0, captured
    at, ranges = capture_of(pg, "app")
    assert ranges == captured["app"]["ranges"], (ranges, captured["app"])

    stopped = calls["db-stopped"]
    assert stopped["status"] == "succeeded" and stopped["response"]["outcome"] == "skipped", stopped
    assert "stopped" in stopped["response"]["reason"], stopped
    leased = calls["db-leased"]
    assert leased["status"] == "succeeded" and leased["response"]["outcome"] == "skipped", leased
    assert "hydration run restore-42" in leased["response"]["reason"], leased
    # Skipped before connecting: no capture ran for them.
    assert "report" not in stopped["response"] and "report" not in leased["response"], (stopped, leased)


def test_an_instance_not_listed_is_refused(twin):
    twin.register_instance("db-other", script=[{"status": "available"}])
    before = twin.describes().get("describes", {}).get("db-other", 0)
    error, out = twin.invoke("capture", {"instance": "db-other"})
    assert error == "Unhandled" and out["errorType"] == "InvalidInput", out
    assert "not one of the instances" in out["errorMessage"], out
    assert twin.describes().get("describes", {}).get("db-other", 0) == before, "refused before any AWS call"


def test_a_database_a_hostile_user_prepared_fails_the_call_and_the_others_are_captured(twin):
    pg = twin.pg
    pg.psql("CREATE ROLE mallory LOGIN PASSWORD 'mallory'")
    try:
        pg.psql("CREATE DATABASE tenant OWNER mallory")
        # Her schema pghydrate, with a table where capture would write: capture must not write into it.
        pg.psql("SET ROLE mallory; CREATE SCHEMA pghydrate; CREATE TABLE pghydrate.hot_set (x int);"
                "CREATE TABLE big AS SELECT g AS id FROM generate_series(1, 200000) g", db="tenant")
        pg.psql("SELECT count(*) FROM big", db="tenant")
        before = capture_of(pg, "app")
        error, out = twin.invoke("capture", {"instance": source_instance(twin)})
        assert error == "Unhandled" and out["errorType"] == "CaptureIncomplete", out
        assert "tenant" in out["errorMessage"] and "belongs to mallory" in out["errorMessage"], out
        assert "1 of" in out["errorMessage"], out
        after = capture_of(pg, "app")
        assert after is not None and (before is None or after[0] > before[0]), (before, after)
        assert pg.psql("SELECT count(*) FROM pghydrate.hot_set", db="tenant") == "0"
        assert pg.psql("SELECT relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                       "WHERE nspname = 'pghydrate'", db="tenant") == "hot_set"
    finally:
        pg.psql("DROP DATABASE IF EXISTS tenant WITH (FORCE)")
        pg.psql("DROP ROLE mallory")


def plan_summaries(history) -> list:
    out = []
    for e in history:
        d = e.get("taskSucceededEventDetails")
        if not d:
            continue
        payload = json.loads(d["output"]).get("Payload")
        if isinstance(payload, dict) and isinstance(payload.get("summary"), dict) and "hot_bytes" in payload["summary"]:
            out.append(payload["summary"])
    return out


def test_a_restore_of_the_captured_server_reads_the_hot_set_first(twin):
    # A capture of its own (the schedule's test may not have run, or may have failed).
    twin.pg.psql("SELECT count(*) FROM customers; SELECT count(*) FROM documents", db="app")
    error, out = twin.invoke("capture", {"instance": source_instance(twin)})
    assert error is None and out["outcome"] == "captured", out
    twin.pg.restart()  # an empty cache, as after a restore
    twin.register_instance("db-restored", script=[
        {"status": "available"},
        {"status": "available", "storage": "Initializing", "progress": 40},
        {"status": "available"},
    ])
    # A migration holds a table until the head start has ended: the Plan call waits for it (up to three
    # lock timeouts), and meanwhile reads the hot set (its head start), which waits for no lock.
    # Released by the test once the head start has ended, not after a guessed time.
    twin.pg.psql("CREATE TABLE IF NOT EXISTS migrating (id int)", db="app")
    ended_before = twin.log_text().count(HEAD_START_ENDED)
    with twin.pg.holding_lock("migrating", db="app"):
        arn = twin.start_execution({"instance": "db-restored", "include_databases": ["app"]})
        started = time.time()
        while twin.log_text().count(HEAD_START_ENDED) == ended_before:
            d = twin.client("stepfunctions").describe_execution(executionArn=arn)
            assert d["status"] == "RUNNING", (d["status"], d.get("error"), d.get("cause"))
            assert time.time() < started + 3 * LOCK_TIMEOUT, "no head start ended while planning waited: " + "; ".join(
                line for line in twin.log_text().splitlines() if "head start" in line)
            time.sleep(0.2)
    desc, history = twin.wait(arn)
    assert desc["status"] == "SUCCEEDED", desc
    summaries = plan_summaries(history)
    assert len(summaries) == 1, summaries
    s = summaries[0]
    assert s["hot_set_databases"] == 1 and s["hot_bytes"] > 0, s
    assert [h["database"] for h in s["hot_set"]] == ["app"], s["hot_set"]
    # The Plan call read the whole hot set while it planned; no item read it again, and the report
    # counts what it read: every byte, once.
    head = s.get("head_start")
    assert head and head["warmed_bytes"] > 0 and head["hot_bytes_left"] == 0, s
    report = twin.report_of(history)
    i = report["instances"][0]
    assert i["coverage"] == 1.0 and i["head_start"] == head, report
    assert i["warmed_bytes"] == i["total_bytes"] - i["vanished_bytes"], report

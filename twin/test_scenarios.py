"""End-to-end scenarios on the local twin: the real state machine definition, executed by moto's ASL
interpreter, drives the real Lambda binaries (cargo lambda watch) against a real PostgreSQL.
Run with `make e2e` (part of `make test`)."""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from twin import PASSWORD, ROOT, Twin

FIXTURES = ROOT / "tests" / "fixtures" / "events"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.fixture(scope="module")
def twin():
    # Calls of at most 20 s (margin 5 s): every warm item that needs longer continues in a new call. A
    # Warm call gives up on a lost database after 3 s (ConnectionFailed, retried by the state machine).
    with Twin.start(lambda_timeout=20, margin=5, mode="buffer", env={"PGHYDRATE_RECONNECT_SECONDS": "3"}) as t:
        t.pg.load_sample("app", 1)
        t.pg.psql("CREATE EXTENSION pg_buffercache", db="app")
        t.pg.psql("CREATE EXTENSION pg_buffercache")
        yield t
        # After every scenario of the module: the database password is in no output of the twin.
        assert t.places_containing(PASSWORD) == []


def history_text(history) -> str:
    return json.dumps(history, default=str)


def unbuffered_forks(pg, db: str, options: str = "") -> list:
    """Forks of `db` with storage whose blocks are not all in shared_buffers (pg_buffercache)."""
    rows = pg.psql(
        """SELECT c.oid::regclass || ' ' || f.fork FROM pg_class c
             CROSS JOIN (VALUES ('main', 0), ('fsm', 1), ('vm', 2), ('init', 3)) f(fork, num)
            WHERE c.relkind IN ('r', 'i', 't', 'm', 'S') AND c.relpersistence <> 't'
              AND pg_relation_size(c.oid, f.fork) > 0
              AND (SELECT count(DISTINCT relblocknumber) FROM public.pg_buffercache b
                    WHERE b.relfilenode = pg_relation_filenode(c.oid) AND b.relforknumber = f.num
                      AND b.reldatabase IN (0, (SELECT oid FROM pg_database WHERE datname = current_database())))
                  < pg_relation_size(c.oid, f.fork) / current_setting('block_size')::int""",
        db=db,
        options=options,
    )
    return [r for r in rows.splitlines() if r]


def test_snapshot_restore_event_hydrates_every_block_and_waits_for_storage(twin):
    twin.pg.restart()  # empty shared_buffers
    twin.register_instance("orders-restored", script=[
        {"status": "creating"}, {"status": "backing-up"}, {"status": "available"},
        {"status": "available", "storage": "Initializing", "progress": 12},
        {"status": "available", "storage": "Initializing", "progress": 57},
        {"status": "available", "storage": "Initializing", "progress": 93},
        {"status": "available"},
    ])
    d, history = twin.run(fixture("snapshot-restore-0043"))
    assert d["status"] == "SUCCEEDED", (d.get("error"), twin.report_of(history))
    out = json.loads(d["output"])
    assert out["status"] == "complete" and out["trigger"] == "snapshot_restore"
    inst = out["instances"][0]
    assert inst["coverage"] == 1.0 and inst["warmed_bytes"] == inst["total_bytes"] > 0, inst
    assert inst["storage"]["state"] == "initialized"
    # It waited through every scripted state: 3 readiness checks and 4 storage checks.
    assert twin.describes()["scripts_left"]["orders-restored"] == 0
    for db in ("app", "postgres"):
        assert unbuffered_forks(twin.pg, db) == [], db


def test_manual_start_with_overrides_and_a_malformed_one(twin):
    twin.register_instance("manual-db")
    d, _ = twin.run({"instance": "manual-db", "sessions": 2, "mode": "read", "maintenance": "none",
                     "include_databases": ["app"], "exclude": ["public.documents"],
                     "credentials": {"type": "secret", "arn": twin.secret_arn}})
    assert d["status"] == "SUCCEEDED", (d.get("error"), twin.report_of(history) if "history" in dir() else None)
    out = json.loads(d["output"])
    inst = out["instances"][0]
    assert inst["coverage"] == 1.0
    assert inst["maintenance"] in (None, {"done": 0, "skipped": [], "skipped_count": 0}), inst["maintenance"]
    d, history = twin.run({"instance": "manual-db", "sesions": 4})
    assert d["status"] == "FAILED" and d["error"] == "InvalidInput", d
    assert "sesions: unknown field" in d["cause"]


def test_multi_az_conversion_only_polls_storage(twin):
    twin.register_instance("multiaz-db", script=[
        {"status": "available"},
        {"status": "available", "storage": "Initializing", "progress": 30},
        {"status": "available"},
    ])
    event = fixture("multi-az-conversion-0025")
    event["detail"]["SourceArn"] = event["detail"]["SourceArn"].replace("orders-restored", "multiaz-db")
    d, history = twin.run(event)
    assert d["status"] == "SUCCEEDED", (d.get("error"), twin.report_of(history) if "history" in dir() else None)
    inst = json.loads(d["output"])["instances"][0]
    assert inst["outcome"] == "storage_only" and inst["storage"]["state"] == "initialized"
    names = {e.get("stateEnteredEventDetails", {}).get("name") for e in history}
    assert "PollStorage" in names
    assert "Plan" not in names and "WarmInline" not in names, "no database session for a Multi-AZ conversion"


def test_not_postgres_ends_cleanly_and_a_wrong_password_fails_named_without_leaking(twin):
    twin.register_instance("mysql-db", engine="mysql")
    d, _ = twin.run({"instance": "mysql-db"})
    assert d["status"] == "SUCCEEDED", (d.get("error"), twin.report_of(history) if "history" in dir() else None)
    assert "not PostgreSQL" in json.loads(d["output"])["reason"]

    bad = twin.client("secretsmanager").create_secret(
        Name="pghydrate-twin-start-wrong-password", SecretString=json.dumps({"username": "postgres", "password": "Wr0ng-Passw0rd"}))["ARN"]
    twin.register_instance("badpw-db")
    d, history = twin.run({"instance": "badpw-db", "credentials": {"type": "secret", "arn": bad}})
    assert d["status"] == "FAILED" and d["error"] == "HydrationIncomplete", d
    text = history_text(history) + twin.log_text()
    assert "AuthenticationFailed" in text
    for secret in ("Wr0ng-Passw0rd", PASSWORD):
        assert secret not in text, "a password appears in the execution history or the logs"


def leases(twin) -> list:
    s3 = twin.client("s3")
    return [o["Key"] for o in s3.list_objects_v2(Bucket="pghydrate-twin-state", Prefix="leases/").get("Contents", [])]


def test_the_same_restore_event_delivered_twice_hydrates_once(twin):
    # ListExecutions lags behind StartExecution here as on AWS (moto_ext.LIST_LAG): the two executions
    # must find each other through the instance's lease, a conditional write in the state bucket.
    twin.register_instance("twice-db", script=[{"status": "available"}] * 50)
    event = fixture("snapshot-restore-0043")
    event["detail"]["SourceArn"] = event["detail"]["SourceArn"].replace("orders-restored", "twice-db")
    results = twin.run_many([event, event, event])
    outputs = [json.loads(d["output"]) for d, _ in results if d["status"] == "SUCCEEDED"]
    assert len(outputs) == 3, [d["status"] for d, _ in results]
    hydrated = [o for o in outputs if o.get("status") == "complete"]
    skipped = [o for o in outputs if o.get("status") == "skipped"]
    assert len(hydrated) == 1 and len(skipped) == 2, outputs
    assert all("twice-db is already being hydrated by execution " + hydrated[0]["execution"] in o["reason"]
               for o in skipped), skipped
    assert "leases/twice-db.json" not in leases(twin), "the lease is given back when the instance's branch ends"
    d, _ = twin.run(event)
    assert json.loads(d["output"])["status"] == "complete", "a later restore of the same instance runs"


def test_a_blue_green_run_and_a_pipelines_run_for_its_green_instance_hydrate_it_once(twin):
    rds = twin.client("rds")
    twin.register_instance("bgp-blue")
    blue_arn = rds.describe_db_instances(DBInstanceIdentifier="bgp-blue")["DBInstances"][0]["DBInstanceArn"]
    bgd = rds.create_blue_green_deployment(BlueGreenDeploymentName="bgp-upgrade", Source=blue_arn)["BlueGreenDeployment"]
    green = bgd["Target"].rsplit(":", 1)[-1]
    twin.register_instance(green, create=False, script=[{"status": "available"}] * 50)
    event = fixture("blue-green-created-0244")
    event["detail"]["SourceArn"] = event["resources"][0] = (
        f"arn:aws:rds:us-east-1:123456789012:deployment:{bgd['BlueGreenDeploymentIdentifier']}")
    # The 0244 event's run names the deployment, the pipeline's names the green instance.
    results = twin.run_many([event, {"instance": green}])
    outputs = [json.loads(d["output"]) for d, _ in results]
    statuses = sorted(o["status"] for o in outputs)
    assert statuses == ["complete", "skipped"], outputs
    skipped = next(o for o in outputs if o["status"] == "skipped")
    assert f"{green} is already being hydrated" in skipped["reason"], skipped


def test_a_lease_left_by_an_execution_that_ended_is_taken_over(twin):
    sfn = twin.client("stepfunctions")
    twin.register_instance("stale-db", script=[{"status": "available"}] * 50)
    # An execution that ended (here: refused input) without giving its lease back, as an aborted run would.
    ended = twin.start_execution({"instance": "stale-db", "sesions": 1})
    twin.wait(ended)
    assert sfn.describe_execution(executionArn=ended)["status"] != "RUNNING"
    twin.client("s3").put_object(Bucket="pghydrate-twin-state", Key="leases/stale-db.json", Body=json.dumps(
        {"execution": ended.rsplit(":", 1)[-1], "execution_arn": ended, "since": "2026-01-01T00:00:00Z"}))
    d, _ = twin.run({"instance": "stale-db"})
    out = json.loads(d["output"])
    assert out["status"] == "complete", out
    assert "took over a lease its execution left behind" in twin.log_text()
    assert "leases/stale-db.json" not in leases(twin)


def cli(twin) -> tuple:
    """The pghydrate binary (debug build) and an environment that points it at the twin."""
    binary = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target")) / "debug" / "pghydrate"
    env = dict(os.environ, AWS_ENDPOINT_URL=twin.endpoint, AWS_ACCESS_KEY_ID="twin", AWS_SECRET_ACCESS_KEY="twin",
               AWS_REGION="us-east-1", PGHYDRATE_STATE_MACHINE_ARN=twin.state_machine)
    return binary, env


def test_pghydrate_start_wait_follows_the_execution_with_run_exit_codes(twin):
    binary, env = cli(twin)
    twin.register_instance("cli-db", script=[{"status": "available"}] * 20)
    done = subprocess.run([str(binary), "start", "--instance", "cli-db", "--wait", "--poll-interval", "1s",
                           "--include-database", "app", "--maintenance", "none"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["status"] == "complete" and summary["instances"][0]["coverage"] == 1.0

    bad = twin.client("secretsmanager").create_secret(
        Name="pghydrate-twin-start-cli-wrong", SecretString=json.dumps({"username": "postgres", "password": "N0t-the-pw"}))["ARN"]
    failed = subprocess.run([str(binary), "start", "--instance", "cli-db", "--wait", "--poll-interval", "1s",
                             "--secret-arn", bad], env=env, capture_output=True, text=True, timeout=600)
    assert failed.returncode == 4, (failed.returncode, failed.stderr)
    assert "HydrationIncomplete" in failed.stderr and "N0t-the-pw" not in failed.stderr + failed.stdout

    invalid = subprocess.run([str(binary), "start", "--instance", "1bad", "--wait"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert invalid.returncode == 2 and "instance:" in invalid.stderr

    missing = subprocess.run([str(binary), "start", "--instance", "no-such-db", "--wait", "--poll-interval", "1s"],
                             env=env, capture_output=True, text=True, timeout=120)
    assert missing.returncode == 2 and "InstanceNotFound" in missing.stderr, (missing.returncode, missing.stderr)


def test_a_start_while_another_run_hydrates_the_instance_follows_that_run_and_exits_with_its_outcome(twin):
    """A pipeline's `pghydrate start --wait` usually loses to the run EventBridge started for the same
    restore. It must not exit 0 ("every byte read") on a run that read nothing: it follows the run that
    holds the instance, and exits with that run's outcome."""
    binary, env = cli(twin)
    # The first run waits for the instance to become available until the second start has resolved.
    twin.register_instance("two-starts-db", script=[{"status": "creating"}] * 600)
    first = twin.start_execution({"instance": "two-starts-db", "include_databases": ["app"], "maintenance": "none"})
    end = time.time() + 120
    while "leases/two-starts-db.json" not in leases(twin):
        assert time.time() < end, "the first run never took the instance's lease"
        time.sleep(0.5)
    second = subprocess.Popen([str(binary), "start", "--instance", "two-starts-db", "--wait", "--poll-interval", "1s"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = []
        while not any("following that run" in line for line in seen):
            line = second.stderr.readline()
            assert line and time.time() < end + 120, ("the second start never followed the first", seen)
            seen.append(line)
        assert first in seen[-1], seen
        twin.register_instance("two-starts-db", create=False, script=[{"status": "available"}] * 40)
        out, err = second.communicate(timeout=600)
    finally:
        second.kill()
    assert second.returncode == 0, (second.returncode, seen, err)
    summary = json.loads(out)
    assert summary["status"] == "complete" and summary["execution"] == first.rsplit(":", 1)[-1], summary
    d, _ = twin.wait(first)
    assert json.loads(d["output"]) == summary, "both starts report the one outcome"


def test_blue_green_event_hydrates_the_green_instance(twin):
    rds = twin.client("rds")
    twin.register_instance("bg-blue")
    blue_arn = rds.describe_db_instances(DBInstanceIdentifier="bg-blue")["DBInstances"][0]["DBInstanceArn"]
    bgd = rds.create_blue_green_deployment(BlueGreenDeploymentName="orders-upgrade", Source=blue_arn)["BlueGreenDeployment"]
    green = bgd["Target"].rsplit(":", 1)[-1]
    assert green != "bg-blue"
    twin.register_instance(green, create=False, script=[{"status": "available"}] * 10)
    event = fixture("blue-green-created-0244")
    event["detail"]["SourceArn"] = event["resources"][0] = (
        f"arn:aws:rds:us-east-1:123456789012:deployment:{bgd['BlueGreenDeploymentIdentifier']}")
    d, history = twin.run(event)
    assert d["status"] == "SUCCEEDED", (d.get("error"), twin.report_of(history))
    out = json.loads(d["output"])
    assert out["trigger"] == "blue_green_created"
    assert [i["instance"] for i in out["instances"]] == [green], "the green instance, not the blue one"
    assert out["instances"][0]["coverage"] == 1.0


def test_a_blue_green_deployment_with_three_green_instances_hydrates_each_in_a_history_of_its_own(twin):
    rds = twin.client("rds")
    twin.register_instance("bg3-blue")
    for n in (1, 2):
        rds.create_db_instance_read_replica(DBInstanceIdentifier=f"bg3-replica{n}",
                                            SourceDBInstanceIdentifier="bg3-blue")
    blue_arn = rds.describe_db_instances(DBInstanceIdentifier="bg3-blue")["DBInstances"][0]["DBInstanceArn"]
    bgd = rds.create_blue_green_deployment(BlueGreenDeploymentName="bg3", Source=blue_arn)["BlueGreenDeployment"]
    greens = sorted(d["TargetMember"].rsplit(":", 1)[-1] for d in rds.describe_blue_green_deployments(
        BlueGreenDeploymentIdentifier=bgd["BlueGreenDeploymentIdentifier"])["BlueGreenDeployments"][0]["SwitchoverDetails"])
    assert len(greens) == 3, greens
    for g in greens:  # each waits for its storage: Initializing, then done
        twin.register_instance(g, create=False, script=[{"status": "available"}] * 4 + [
            {"status": "available", "storage": "Initializing", "progress": p} for p in (10, 60)] + [{"status": "available"}] * 40)
    event = fixture("blue-green-created-0244")
    event["detail"]["SourceArn"] = event["resources"][0] = (
        f"arn:aws:rds:us-east-1:123456789012:deployment:{bgd['BlueGreenDeploymentIdentifier']}")
    arn = twin.start_execution(event)
    d, history = twin.wait(arn)
    assert d["status"] == "SUCCEEDED", (d.get("error"), twin.report_of(history))
    out = json.loads(d["output"])
    assert sorted(i["instance"] for i in out["instances"]) == greens
    assert all(i["coverage"] == 1.0 and i["storage"]["state"] == "initialized" for i in out["instances"]), out
    # Each instance's polls, warm calls and maintenance are in a child execution of its own; the parent's
    # history does not grow with the number of instances or with how long each waits.
    parent = twin.history(arn, children=False)
    assert not [e for e in parent if (e.get("stateEnteredEventDetails") or {}).get("name") == "PollStorage"]
    children = {e["child"] for e in history[len(parent):] if e.get("mapRunArn") and
                (e.get("stateEnteredEventDetails") or {}).get("name") == "PollStorage"}
    assert len(children) == 3, children
    print(f"\nthree green instances: parent history {len(parent)} events, with children {len(history)}")


def test_a_plan_over_the_inline_limit_goes_through_s3_and_a_distributed_map():
    # Tiny work items (one 64-block range each) make a 24 MiB table's plan far larger than 40 items.
    with Twin.start(lambda_timeout=20, margin=5, env={"PGHYDRATE_RANGE_BLOCKS": "64", "PGHYDRATE_ITEM_RANGES": "1"}) as t:
        t.pg.psql("CREATE DATABASE app")
        t.pg.psql("CREATE TABLE t AS SELECT g AS id, md5(g::text) AS v FROM generate_series(1, 350000) g", db="app")
        t.register_instance("big-plan", script=[{"status": "available"}] * 10)
        d, history = t.run({"instance": "big-plan", "include_databases": ["app"], "maintenance": "none"})
        assert d["status"] == "SUCCEEDED", (d.get("error"), t.report_of(history))
        names = [e.get("stateEnteredEventDetails", {}).get("name") for e in history]
        assert "WarmDistributed" in names and "WarmInline" not in names
        keys = [o["Key"] for o in t.client("s3").list_objects_v2(Bucket="pghydrate-twin-state").get("Contents", [])]
        assert any(k.endswith("/big-plan/items.json") for k in keys), keys
        items = json.loads(t.client("s3").get_object(Bucket="pghydrate-twin-state",
                                                     Key=next(k for k in keys if k.endswith("items.json")))["Body"].read())
        assert len(items) > 40
        inst = json.loads(d["output"])["instances"][0]
        assert inst["coverage"] == 1.0 and inst["warmed_bytes"] == inst["total_bytes"] > 0, inst
        # The results as the definition asks (COMPACT, JSON Lines): one child output per line, no Input.
        results = next(k for k in keys if k.endswith("/SUCCEEDED_0.json"))
        lines = t.client("s3").get_object(Bucket="pghydrate-twin-state", Key=results)["Body"].read().splitlines()
        assert len(lines) == len(items)
        assert all("warmed_bytes" in json.loads(line) and "Input" not in json.loads(line) for line in lines)


def largest_payload(history) -> tuple:
    """(bytes, where) of the largest input, output or parameters string in an execution's history."""
    best = (0, "")
    for e in history:
        for key, details in e.items():
            if key.endswith("EventDetails") and isinstance(details, dict):
                for field in ("input", "output", "parameters"):
                    v = details.get(field)
                    if isinstance(v, str) and len(v.encode()) > best[0]:
                        best = (len(v.encode()), f"{e['type']} {details.get('name', '')} {field}")
    return best


def test_a_thousand_tables_hydrate_with_every_state_far_below_256_kib(twin):
    """The database of the issue that found the payload limit: 1,000 small tables, each with a primary
    key and a TOASTed text column (about 5,000 forks). Every state of the execution stays far below
    256 KiB, every block is read, and every table is analyzed."""
    twin.pg.psql("CREATE DATABASE many")
    twin.pg.psql("""DO $$ BEGIN FOR i IN 1..1000 LOOP
                      EXECUTE format('CREATE TABLE t%s (id int PRIMARY KEY, body text)', i);
                      EXECUTE format('INSERT INTO t%s SELECT g, repeat(md5(g::text), 300) FROM generate_series(1, 3) g', i);
                    END LOOP; END $$; CREATE EXTENSION pg_buffercache""", db="many")
    twin.pg.psql("VACUUM", db="many")
    twin.pg.restart()
    twin.register_instance("many-tables", script=[{"status": "available"}] * 10)
    d, history = twin.run({"instance": "many-tables", "include_databases": ["many"]}, timeout=900)
    assert d["status"] == "SUCCEEDED", (d.get("error"), d.get("cause"), twin.report_of(history))
    out = json.loads(d["output"])
    inst = out["instances"][0]
    assert out["coverage"] == 1.0 and inst["coverage"] == 1.0 and inst["warmed_bytes"] == inst["total_bytes"] > 0, inst
    assert inst["maintenance"]["done"] >= 1000 and inst["maintenance"]["skipped_count"] == 0, inst["maintenance"]
    assert unbuffered_forks(twin.pg, "many") == []
    size, where = largest_payload(history)
    assert size < 128 * 1024, (size, where)
    print(f"measured: 1,000 tables: {len(history)} history events; largest payload {size} bytes ({where})")


def test_storage_optimization_is_usable_and_a_restore_error_ends_the_wait_at_once(twin):
    # A restore that changes storage goes on to storage-optimization, which can last a day: the instance
    # is usable, and is hydrated while it optimizes.
    twin.register_instance("optimizing-db", script=[{"status": "storage-optimization"}] * 40)
    d, history = twin.run({"instance": "optimizing-db", "include_databases": ["app"], "maintenance": "none"})
    assert d["status"] == "SUCCEEDED", (d.get("error"), twin.report_of(history))
    assert json.loads(d["output"])["instances"][0]["coverage"] == 1.0
    # A failed restore does not keep the run waiting for hours.
    twin.register_instance("restore-error-db", script=[{"status": "creating"}] * 2 + [{"status": "restore-error"}] * 40)
    d, history = twin.run({"instance": "restore-error-db"}, timeout=120)
    assert d["status"] == "FAILED" and d["error"] == "HydrationIncomplete", d
    inst = twin.report_of(history)["instances"][0]
    assert inst["outcome"] == "failed" and "restore-error" in json.dumps(inst["error"]), inst
    assert twin.describes()["describes"]["restore-error-db"] <= 6, "it kept polling a failed restore"


def test_an_inactive_or_throttled_function_is_retried_not_fatal(twin):
    """Plan, Warm and Maintain run in a VPC and are invoked rarely: an idle one goes Inactive, and its
    next invokes fail with ResourceNotReadyException until it is active again. Lambda also throttles.
    A call killed at its timeout is retried too. The run retries them all and completes."""
    twin.register_instance("idle-functions", script=[{"status": "available"}] * 10)
    twin.lambda_fault("plan", "inactive", count=2)
    twin.lambda_fault("warm", "throttled", count=1)
    twin.lambda_fault("describe", "timedout", count=1)
    twin.lambda_fault("maintain", "inactive", count=1)
    d, history = twin.run({"instance": "idle-functions", "include_databases": ["app"]})
    assert d["status"] == "SUCCEEDED", (d.get("error"), d.get("cause"), twin.report_of(history))
    assert json.loads(d["output"])["coverage"] == 1.0
    text = history_text(history)
    assert "Lambda.ResourceNotReadyException" in text and "Lambda.TooManyRequestsException" in text
    assert "Sandbox.Timedout" in text, "a call killed at its timeout is retried"


def test_a_function_killed_without_an_error_type_is_retried_twice_not_six_times(twin):
    """Out of memory or past its timeout, Lambda kills the function and Step Functions names the error
    Lambda.Unknown: a call that needed all of its 15 minutes once will need them again, so it is retried
    as Sandbox.Timedout is (twice), not as Lambda's transient service errors are (six times)."""
    twin.register_instance("oom-plan", script=[{"status": "available"}] * 10)
    twin.lambda_fault("plan", "unknown", count=10)
    d, history = twin.run({"instance": "oom-plan", "include_databases": ["app"], "maintenance": "none"})
    assert d["status"] == "FAILED" and d["error"] == "HydrationIncomplete", d
    failed = [e["taskFailedEventDetails"] for e in history if e["type"] == "TaskFailed"]
    assert [f["error"] for f in failed] == ["Lambda.Unknown"] * 3, failed
    assert twin.report_of(history)["instances"][0]["error"]["Error"] == "Lambda.Unknown"


def test_a_hostile_catalog_runs_nothing_through_the_lambdas():
    """An unprivileged role has planted, in public of every database, an overload of every function,
    aggregate and operator name in the project's SQL (tests/hostile_catalog.py), and the login role's
    own settings put public first. A whole workflow run (Plan, Warm, Maintain with VACUUM ANALYZE)
    through the real Lambdas: nothing planted runs, nobody's role changes, every block is read."""
    sys.path.insert(0, str(ROOT / "tests"))
    import hostile_catalog

    pinned = "-c search_path=pg_catalog,pg_temp"  # the test's own checks must not walk into the traps
    with Twin.start(lambda_timeout=20, margin=5, mode="buffer") as t:
        t.pg.load_sample("app", 1)
        t.pg.psql("CREATE ROLE mallory LOGIN PASSWORD 'mallory-pw';"
                  "ALTER ROLE postgres SET search_path = public, pg_catalog")
        planted = 0
        for db in ("postgres", "app"):
            t.pg.psql("CREATE EXTENSION pg_buffercache", db=db)
            counts = t.pg.psql(hostile_catalog.sql("mallory"), db=db).splitlines()[-1].split("|")
            planted += sum(int(n) for n in counts[:3])
        assert planted > 1000, planted
        t.pg.restart()  # empty shared_buffers
        t.register_instance("hostile-db", script=[{"status": "available"}] * 10)
        d, history = t.run({"instance": "hostile-db", "maintenance": "vacuum-analyze"})
        assert d["status"] == "SUCCEEDED", (d.get("error"), t.report_of(history))
        inst = json.loads(d["output"])["instances"][0]
        assert inst["coverage"] == 1.0 and inst["warmed_bytes"] == inst["total_bytes"] > 0, inst
        assert inst["maintenance"]["done"] > 0 and inst["maintenance"]["skipped"] == [], inst["maintenance"]
        for db in ("postgres", "app"):
            assert t.pg.psql(hostile_catalog.runs_sql(), db=db, options=pinned) == "0|", db
            assert unbuffered_forks(t.pg, db, options=pinned) == [], db
        assert t.pg.psql("SELECT rolsuper FROM pg_roles WHERE rolname = 'mallory'", options=pinned) == "f"
        print(f"measured: {planted} objects planted in 2 databases; ran 0 times through the Lambdas")


@pytest.mark.parametrize("name,kind", [
    ("snapshot-restore-0008", "snapshot_restore"),
    ("point-in-time-restore-0019", "point_in_time_restore"),
    ("instance-created-0005", "instance_created"),
    ("replica-ready-0046", "replica_ready"),
])
def test_every_other_trigger_event_starts_a_hydration(twin, name, kind):
    ident = f"trig-{name.split('-')[-1]}"
    # As RDS reports a restored volume, or a new replica's: initializing, then no storage operation.
    twin.register_instance(ident, script=[{"status": "available", "storage": "Initializing", "progress": 4}] * 3
                           + [{"status": "available"}] * 10)
    event = fixture(name)
    event["detail"]["SourceArn"] = event["detail"]["SourceArn"].replace("orders-restored", ident)
    d, history = twin.run(event)
    assert d["status"] == "SUCCEEDED", (d.get("error"), twin.report_of(history))
    out = json.loads(d["output"])
    assert out["trigger"] == kind and out["instances"][0]["instance"] == ident
    assert out["instances"][0]["coverage"] == 1.0


def test_a_replica_event_on_a_replica_whose_storage_is_initialized_reads_nothing_and_says_why(twin):
    """RDS sends RDS-EVENT-0046 also "as a monitoring message confirming that replication is functioning
    properly" (after a reboot of the source): that must not start a full read of a production replica."""
    twin.register_instance("healthy-replica", script=[{"status": "available"}] * 10)
    event = fixture("replica-ready-0046")
    event["detail"]["SourceArn"] = event["detail"]["SourceArn"].replace("orders-restored", "healthy-replica")
    d, history = twin.run(event)
    assert d["status"] == "SUCCEEDED", (d.get("error"), d.get("cause"))
    reason = json.loads(d["output"])["reason"]
    assert "RDS-EVENT-0046" in reason and "not initializing" in reason and "healthy-replica" in reason, reason
    names = {e.get("stateEnteredEventDetails", {}).get("name") for e in history}
    assert "WaitReady" not in names and "Plan" not in names, "nothing ran for a healthy replica"


def test_an_instance_deleted_while_waiting_ends_with_a_named_error(twin):
    twin.register_instance("doomed-db", script=[{"status": "creating"}, {"status": "deleting"}])
    d, history = twin.run({"instance": "doomed-db"})
    assert d["status"] == "FAILED" and d["error"] == "HydrationIncomplete", d
    inst = twin.report_of(history)["instances"][0]
    assert inst["outcome"] == "failed" and inst["error"]["Error"] == "InstanceNotUsable", inst
    assert "deleting" in inst["error"]["Cause"]
    # Deleted while its storage was polled: the cause is what that poll saw, not the readiness check's.
    twin.register_instance("doomed-later-db", script=[{"status": "available", "storage": "Initializing", "progress": 5}] * 2
                           + [{"status": "deleting"}] * 5)
    d, history = twin.run({"instance": "doomed-later-db", "poll_only": True})
    assert d["status"] == "FAILED" and d["error"] == "HydrationIncomplete", d
    inst = twin.report_of(history)["instances"][0]
    assert inst["error"]["Error"] == "InstanceNotUsable" and "deleting" in inst["error"]["Cause"], inst


def test_the_templates_eventbridge_rules_start_one_run_per_restore_event_and_none_for_others(twin):
    assert sorted(twin.create_rules_from_template()) == ["GreenEnvironmentCreated", "InstanceRestored"]
    twin.register_instance("eb-db", script=[{"status": "available"}] * 10)
    restore, failover = (json.loads(json.dumps(fixture(f)).replace("orders-restored", "eb-db"))
                         for f in ("snapshot-restore-0043", "failover-0049"))
    before = len(twin.deliveries())
    twin.put_event(failover)
    twin.put_event(restore)
    end = time.time() + 30
    while len(twin.deliveries()) == before and time.time() < end:
        time.sleep(0.2)
    time.sleep(2)  # any further (wrong) delivery would have arrived by now
    new = twin.deliveries()[before:]
    assert len(new) == 1 and new[0]["rule"] == "InstanceRestored" and "executionArn" in new[0], new
    d, history = twin.wait(new[0]["executionArn"])
    assert d["status"] == "SUCCEEDED", (d.get("error"), d.get("cause"))
    out = json.loads(d["output"])
    assert out["trigger"] == "snapshot_restore" and out["instances"][0]["instance"] == "eb-db"
    assert out["instances"][0]["coverage"] == 1.0


def test_twin_up_prints_commands_that_work_and_twin_down_stops_everything():
    from twin import HOME

    up = subprocess.run(["bash", str(ROOT / "twin" / "up.sh"), "--up"], capture_output=True, text=True, timeout=600)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        commands = [line.strip() for line in up.stdout.splitlines() if line.startswith("  ")]
        event_cmd = next(c for c in commands if " event " in c).split("#")[0].split()
        listing = next(c for c in commands if c.split("#")[0].rstrip().endswith(" executions")).split("#")[0].split()
        subprocess.run(event_cmd, check=True, capture_output=True, timeout=60)
        end = time.time() + 300
        while True:
            out = subprocess.run(listing, check=True, capture_output=True, text=True, timeout=60).stdout
            if "SUCCEEDED" in out or "FAILED" in out or time.time() > end:
                break
            time.sleep(1)
        assert out.count("SUCCEEDED") == 1, out
        pid = int((HOME / "twin-up" / "pid").read_text())
    finally:
        down = subprocess.run(["bash", str(ROOT / "twin" / "up.sh"), "--down"], capture_output=True, text=True,
                              timeout=120)
    assert down.returncode == 0 and "twin stopped" in down.stdout, down.stdout + down.stderr
    try:
        os.kill(pid, 0)
        raise AssertionError("the twin's process is still running")
    except ProcessLookupError:
        pass
    assert not (HOME / "twin-up" / "ready").exists()


def test_an_instance_that_does_not_exist_fails_named_and_a_secret_that_is_not_json_too(twin):
    d, history = twin.run({"instance": "no-such-db", "maintenance": "none"})
    assert d["status"] == "FAILED" and d["error"] == "InstanceNotFound", (d["error"], d.get("cause"))
    assert "no-such-db" in d["cause"]
    names = {e.get("stateEnteredEventDetails", {}).get("name") for e in history}
    assert "Plan" not in names and "WaitReady" not in names, "nothing started"

    not_json = twin.client("secretsmanager").create_secret(Name="pghydrate-twin-start-not-json", SecretString="user=postgres pw=Xy-9-secret")["ARN"]
    twin.register_instance("notjson-db")
    d, history = twin.run({"instance": "notjson-db", "credentials": {"type": "secret", "arn": not_json}})
    assert d["status"] == "FAILED" and d["error"] == "HydrationIncomplete", d
    inst = twin.report_of(history)["instances"][0]
    assert "not JSON" in inst["error"]["Cause"], inst
    assert twin.places_containing("Xy-9-secret") == []


def test_a_start_naming_a_secret_the_stack_does_not_list_is_refused_by_its_role(twin):
    """The functions may read SecretArn and StartSecretArns, no other secret (infra/template.yaml), under
    their own roles: a start that names another team's secret fails with AccessDenied for
    secretsmanager:GetSecretValue, the function's role named, and the secret's value is never read."""
    other = twin.client("secretsmanager").create_secret(
        Name="another-teams-db", SecretString=json.dumps({"username": "postgres", "password": "0ther-Team-pw"}))["ARN"]
    twin.register_instance("other-secret-db")
    d, history = twin.run({"instance": "other-secret-db", "credentials": {"type": "secret", "arn": other},
                           "maintenance": "none"})
    assert d["status"] == "FAILED" and d["error"] == "HydrationIncomplete", d
    cause = twin.report_of(history)["instances"][0]["error"]["Cause"]
    assert "not authorized to perform: secretsmanager:GetSecretValue" in cause and "PlanFunctionRole" in cause, cause
    denied = twin.denials(take=True)
    assert denied and {(x["function"], x["action"], x["resource"]) for x in denied} == {
        ("plan", "secretsmanager:GetSecretValue", other)}, denied
    assert twin.places_containing("0ther-Team-pw") == []

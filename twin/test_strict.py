"""The twin is as strict as AWS documents Step Functions and Lambda to be: each rule that moto_ext adds
(see its docstring) is shown failing a small state machine, or a direct Lambda call, that breaks it."""
import json
import time
from pathlib import Path

import boto3
import pytest
from botocore.config import Config
from botocore.exceptions import ClientError

from twin import ACCOUNT, LIST_LAG, Twin, function_memory_mb


@pytest.fixture(scope="module")
def twin():
    with Twin.start(lambda_timeout=20, margin=5) as t:
        yield t


def run_definition(twin, name: str, definition: dict, execution_input: dict | None = None, timeout: float = 300):
    sfn = twin.client("stepfunctions")
    arn = sfn.create_state_machine(name=name, definition=json.dumps(definition),
                                   roleArn=f"arn:aws:iam::{ACCOUNT}:role/pghydrate-twin")["stateMachineArn"]
    ex = sfn.start_execution(stateMachineArn=arn, input=json.dumps(execution_input or {}))["executionArn"]
    return twin.wait(ex, timeout)


PIECE = "x" * (100 * 1024)  # 100 KiB: under the limit alone, over it three times over


def test_an_oversized_state_fails_the_execution_even_under_catch_all(twin):
    big = {"Type": "Pass", "Parameters": {"a.$": "$.s", "b.$": "$.s", "c.$": "$.s"}, "End": True}
    d, history = run_definition(twin, "strict-output", {
        "StartAt": "Wrap",
        "States": {
            "Wrap": {"Type": "Parallel", "Branches": [{"StartAt": "Big", "States": {"Big": big}}],
                     "Catch": [{"ErrorEquals": ["States.ALL"], "Next": "Caught"}], "End": True},
            "Caught": {"Type": "Succeed"},
        },
    }, {"s": PIECE})
    assert d["status"] == "FAILED" and d.get("error") == "States.DataLimitExceeded", (d.get("error"), d.get("cause"))
    assert "Caught" not in json.dumps(history, default=str)


def test_an_oversized_state_input_fails_too(twin):
    # Each piece is under the limit; the Map's item selector puts two of them into one iteration's input.
    d, _ = run_definition(twin, "strict-input", {
        "StartAt": "Each",
        "States": {
            "Each": {"Type": "Map", "ItemsPath": "$.items",
                     "ItemSelector": {"a.$": "$.s", "b.$": "$.s", "c.$": "$.s"},
                     "ItemProcessor": {"ProcessorConfig": {"Mode": "INLINE"},
                                       "StartAt": "Noop", "States": {"Noop": {"Type": "Pass", "End": True}}},
                     "Catch": [{"ErrorEquals": ["States.ALL"], "Next": "Caught"}], "End": True},
            "Caught": {"Type": "Succeed"},
        },
    }, {"s": PIECE, "items": [1]})
    assert d["status"] == "FAILED" and d.get("error") == "States.DataLimitExceeded", (d.get("error"), d.get("cause"))


def test_the_history_stops_at_25000_events(twin):
    d, history = run_definition(twin, "strict-history", {
        "StartAt": "Count",
        "States": {
            "Count": {"Type": "Pass", "Parameters": {"n.$": "States.MathAdd($.n, 1)"}, "Next": "Again"},
            "Again": {"Type": "Choice", "Choices": [{"Variable": "$.n", "NumericLessThan": 100000, "Next": "Count"}],
                      "Default": "Done"},
            "Done": {"Type": "Succeed"},
        },
    }, {"n": 0}, timeout=600)
    assert d["status"] == "FAILED" and d.get("error") == "States.Runtime", d
    assert 24_990 <= len(history) <= 25_010, len(history)


def lambda_task(twin, name: str, catch: str) -> dict:
    return {
        "StartAt": "Call",
        "States": {
            "Call": {"Type": "Task", "Resource": "arn:aws:states:::lambda:invoke",
                     "Parameters": {"FunctionName": "describe",
                                    "Payload": {"phase": "ready", "instance": "nobody", "started": "2026-01-01T00:00:00Z",
                                                "limit_minutes": 1}},
                     "Catch": [{"ErrorEquals": [catch], "Next": "Named"}, {"ErrorEquals": ["States.ALL"], "Next": "Other"}],
                     "End": True},
            "Named": {"Type": "Succeed"},
            "Other": {"Type": "Fail", "Error": "NotNamedAsOnAws"},
        },
    }


@pytest.mark.parametrize("fault,name", [("inactive", "Lambda.ResourceNotReadyException"),
                                        ("throttled", "Lambda.TooManyRequestsException")])
def test_lambda_api_errors_are_named_as_on_aws(twin, fault, name):
    twin.lambda_fault("describe", fault, count=1)
    d, history = run_definition(twin, f"strict-{fault}", lambda_task(twin, name, name))
    assert d["status"] == "SUCCEEDED", [e for e in history if "Failed" in e["type"]]


def test_a_lambda_request_over_6_mb_is_refused(twin):
    lam = boto3.client("lambda", region_name="us-east-1", endpoint_url=f"http://127.0.0.1:{twin.shim_port}",
                       aws_access_key_id="x", aws_secret_access_key="x",
                       config=Config(retries={"total_max_attempts": 1}))
    with pytest.raises(ClientError) as e:
        lam.invoke(FunctionName="describe", Payload=json.dumps({"pad": "x" * (6 * 1024 * 1024)}).encode())
    assert e.value.response["Error"]["Code"] == "RequestEntityTooLargeException"


def test_an_asynchronous_invoke_answers_at_once_without_the_result(twin):
    """InvocationType Event: 202 and no payload, whatever the function does (here it fails: the request is
    not one it accepts, which only the recorded outcome shows); an event over 256 KiB is refused."""
    lam = boto3.client("lambda", region_name="us-east-1", endpoint_url=f"http://127.0.0.1:{twin.shim_port}",
                       aws_access_key_id="x", aws_secret_access_key="x",
                       config=Config(retries={"total_max_attempts": 1}))
    r = lam.invoke(FunctionName="describe", InvocationType="Event", Payload=json.dumps({"strict": "async"}).encode())
    assert r["StatusCode"] == 202 and "FunctionError" not in r and r["Payload"].read() == b"", r
    deadline = time.time() + 120
    while time.time() < deadline:
        mine = [c for c in twin.async_invocations() if c["payload"] == {"strict": "async"}]
        if mine and mine[0]["status"] != "running":
            break
        time.sleep(0.2)
    assert mine and mine[0]["status"] == "failed", mine
    with pytest.raises(ClientError) as e:
        lam.invoke(FunctionName="describe", InvocationType="Event",
                   Payload=json.dumps({"pad": "x" * (256 * 1024)}).encode())
    assert e.value.response["Error"]["Code"] == "RequestEntityTooLargeException"


def test_a_function_process_gets_its_template_memory_and_no_more(twin):
    """Each process the emulator runs a function in is held to the MemorySize infra/template.yaml gives
    that function (Lambda kills an invoke past it), by a memory cgroup of its own."""
    lam = boto3.client("lambda", region_name="us-east-1", endpoint_url=f"http://127.0.0.1:{twin.shim_port}",
                       aws_access_key_id="x", aws_secret_access_key="x")
    lam.invoke(FunctionName="describe", Payload=json.dumps(
        {"phase": "ready", "instance": "nobody", "started": "2026-01-01T00:00:00Z", "limit_minutes": 1}).encode())
    want = function_memory_mb()
    assert want["describe"] == 256 and want["plan"] == 1024, want
    deadline = time.time() + 5
    while time.time() < deadline and not twin.sandboxes.placed.get("describe"):
        time.sleep(0.05)
    placed = {pid: groups for pid, groups in twin.sandboxes.groups.items()
              if Path(f"/proc/{pid}/comm").exists() and Path(f"/proc/{pid}/comm").read_text().strip() == "describe"}
    assert placed, f"no describe process in a sandbox: {twin.sandboxes.groups}"
    for pid, groups in placed.items():
        mem = next(g for g in groups if "/memory/" in str(g))
        assert int((mem / "memory.limit_in_bytes").read_text()) == 256 * 2**20
        assert f":memory:/{mem.name}" in Path(f"/proc/{pid}/cgroup").read_text()


def test_list_executions_lags_behind_start_execution(twin):
    import time
    sfn = twin.client("stepfunctions")
    arn = twin.start_execution({"instance": "no-such-db-for-the-lag-test"})
    listed = lambda: [e["executionArn"] for e in sfn.list_executions(stateMachineArn=twin.state_machine,
                                                                      maxResults=1000)["executions"]]
    assert arn not in listed(), "a just-started execution is listed at once: the twin is kinder than AWS"
    time.sleep(LIST_LAG + 0.5)
    assert arn in listed()
    twin.wait(arn)


def distributed(writer_config=None) -> dict:
    writer = {"Resource": "arn:aws:states:::s3:putObject", "Parameters": {"Bucket": "pghydrate-twin-state",
                                                                           "Prefix": f"strict/{writer_config}"}}
    if writer_config:
        writer["WriterConfig"] = writer_config
    return {"StartAt": "M", "States": {"M": {
        "Type": "Map", "ItemsPath": "$.items", "ItemSelector": {"item.$": "$$.Map.Item.Value", "big": PIECE[:1000]},
        "ItemProcessor": {"ProcessorConfig": {"Mode": "DISTRIBUTED", "ExecutionType": "STANDARD"}, "StartAt": "P",
                          "States": {"P": {"Type": "Pass", "Parameters": {"out.$": "$.item"}, "End": True}}},
        "ResultWriter": writer, "End": True}}}


def result_files(twin, output: str) -> dict:
    s3 = twin.client("s3")
    details = json.loads(output)["ResultWriterDetails"]
    manifest = json.loads(s3.get_object(Bucket=details["Bucket"], Key=details["Key"])["Body"].read())
    return {f["Key"].rsplit("/", 1)[-1]: s3.get_object(Bucket=details["Bucket"], Key=f["Key"])["Body"].read().decode()
            for files in manifest["ResultFiles"].values() for f in files}


def test_distributed_map_results_are_written_in_aws_format(twin):
    # Without WriterConfig, AWS writes each child's metadata with its Input and Output (JSON strings):
    # a reader that loads the file whole holds every child's input too.
    d, _ = run_definition(twin, "strict-results-none", distributed(), {"items": [1, 2, 3]})
    assert d["status"] == "SUCCEEDED", d
    entries = json.loads(result_files(twin, d["output"])["SUCCEEDED_0.json"])
    assert [json.loads(e["Output"]) for e in entries] == [{"out": 1}, {"out": 2}, {"out": 3}]
    assert all(json.loads(e["Input"])["big"] == PIECE[:1000] and e["Status"] == "SUCCEEDED" for e in entries)
    # COMPACT and JSON Lines, as the hydration definition asks: the outputs only, one per line.
    d, _ = run_definition(twin, "strict-results-compact",
                          distributed({"Transformation": "COMPACT", "OutputType": "JSONL"}), {"items": [1, 2, 3]})
    assert d["status"] == "SUCCEEDED", d
    text = result_files(twin, d["output"])["SUCCEEDED_0.json"]
    assert [json.loads(line) for line in text.splitlines()] == [{"out": 1}, {"out": 2}, {"out": 3}]


def test_an_inline_map_runs_at_most_40_iterations_at_once(twin):
    definition = {"StartAt": "M", "States": {"M": {
        "Type": "Map", "ItemsPath": "$.items", "MaxConcurrency": 0,
        "ItemProcessor": {"ProcessorConfig": {"Mode": "INLINE"}, "StartAt": "W",
                          "States": {"W": {"Type": "Wait", "Seconds": 2, "End": True}}},
        "End": True}}}
    d, history = run_definition(twin, "strict-inline-40", definition, {"items": list(range(50))})
    assert d["status"] == "SUCCEEDED", d
    types = [e["type"] for e in history]
    first_done = types.index("MapIterationSucceeded")
    assert types[:first_done].count("MapIterationStarted") == 40, "more than 40 iterations ran at once"
    assert types.count("MapIterationSucceeded") == 50

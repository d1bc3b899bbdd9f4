"""pghydrate's extension of moto 5.2.5 for the local twin, started by twin/server.py.

What moto lacks that the workflow needs, and nothing else:
- DBInstance endpoint: the twin points an emulated instance at the real local PostgreSQL (address, port).
- StorageOperationStatus / StorageOperationPercentProgress (moto never reports them), and scripted
  DBInstanceStatus changes: each DescribeDBInstances of an instance consumes the next step of its script,
  so "Initializing 10%, 55%, then absent" or "creating, then available" happen call by call.
- Lambda tasks: moto's Step Functions interpreter invokes Lambda through its own (docker-based) Lambda;
  here its Lambda client points at the shim in front of `cargo lambda watch` (the real binaries).
- A Distributed Map's ResultWriter: moto writes an empty manifest and drops the results (its own TODO),
  and its parser refuses WriterConfig. Here the results are written as Step Functions documents them:
  without WriterConfig (Transformation NONE, OutputType JSON) each child's metadata, Input and Output as
  a JSON array; COMPACT or FLATTEN, its Output only; JSONL, one per line; failed children, always in the
  NONE shape, in FAILED_0.json; all listed in manifest.json.
- EventBridge targets that are state machines: moto delivers only to logs, SQS and buses; here a rule's
  Step Functions target starts an execution with the event as input (asynchronously, as EventBridge does).
- StartExecution without a name: AWS names the execution with a UUID; moto leaves it null (and so
  $$.Execution.Name). EventBridge and the console start executions without a name.
- A control API for tests (POST /instance, POST /lambda-fault, GET /describes, GET /deliveries), on its own
  port.
Blue/Green deployments (Create/DescribeBlueGreenDeployments) are moto's own, with one addition: as on
AWS, the green environment has a green copy of each of the blue instance's read replicas, and
SwitchoverDetails lists every blue/green pair (moto makes the primary's only).

And where moto is kinder than AWS, the twin is made as strict as AWS documents (each rule has a test in
twin/test_strict.py):
- 256 KiB (UTF-8) on every state's input, not only on outputs and task results (moto checks those).
- States.ALL catches neither States.DataLimitExceeded nor States.Runtime (AWS: "terminal errors that
  can't be caught by States.ALL"): an oversized state fails the execution, Catch or not.
- 25,000 events per execution history: the state that would go past it fails the execution
  (States.Runtime).
- A Lambda API error is named Lambda.<ExceptionName> (moto names every one "Exception"), and a function
  error without an errorType Lambda.Unknown, so that Retry and Catch see what they would see on AWS.
- An inline Map runs at most 40 iterations at once, whatever its MaxConcurrency (moto ran them all).
- ListExecutions is eventually consistent (AWS: "results are best effort and may not reflect very
  recent updates"): an execution appears in it LIST_LAG seconds after it started, so that nothing that
  relies on it to see a simultaneous start can pass here.
- S3 conditional writes (If-None-Match: *, If-Match) are atomic, as S3 documents; moto checks and then
  writes, so two simultaneous writers could both succeed.
- Lambda itself, in the shim: a request or response over 6 MB (RequestEntityTooLargeException;
  Function.ResponseSizeTooLarge), and on request an inactive function (ResourceNotReadyException) or
  throttling (TooManyRequestsException) for the next N invokes (POST /lambda-fault); a function that
  runs past its timeout (PGHYDRATE_TWIN_LAMBDA_TIMEOUT seconds) fails as Sandbox.Timedout, as Lambda's
  does (the twin stops waiting for it; unlike Lambda, it cannot freeze the process, which runs on), and
  the fault "timedout" makes the next N invokes fail so at once.
- IAM, for the functions (twin/iam.py): each function signs with credentials of its own role
  (twin/lambda-runner.sh), and every request it makes, to moto or to the Lambda shim, is allowed only if
  that role's policies in infra/template.yaml allow its action on its resource; otherwise it gets
  AccessDenied as the service words it, naming the action, and GET /denials lists it. S3 answers a
  missing key with 403 AccessDenied, not 404 NoSuchKey, to a caller that may not s3:ListBucket the
  bucket (S3 GetObject API reference). A request the twin cannot name is denied too. The tests' own
  calls and the Step Functions interpreter's are not checked (the state machine's role is not modelled).
- Asynchronous invokes (X-Amz-Invocation-Type: Event), in the shim: 202 at once with no result, the
  function run in the background, its event over 256 KiB refused; GET /async-invocations lists each
  with its outcome (the scheduled capture starts one per instance this way).
"""
import io
import json
import os
import threading
import uuid
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import boto3
import moto
from botocore.config import Config
from xml.sax.saxutils import escape as xml_escape

if moto.__version__ != "5.2.5":
    raise SystemExit(f"moto_ext patches moto 5.2.5, found {moto.__version__}")

from moto.backends import get_backend
from moto.rds.models import DBInstance
from moto.rds.responses import RDSResponse
import moto.stepfunctions.parser.asl.component.state.exec.state_task.lambda_eval_utils as lambda_eval_utils

import iam  # noqa: E402  (twin/, on the path: server.py)

LOCK = threading.Lock()
# IAM (POST /iam): access key id -> {"function", "role", "statements"}; every denial so far.
ROLES: dict = {}
DENIALS: list = []
# A function's deployed name (its ARN's last part) -> its binary, the name `cargo lambda watch` serves it by.
FUNCTION_OF_NAME: dict = {}
# function name -> [fault, invokes left]: "inactive", "throttled"
LAMBDA_FAULTS: dict = {}
LAMBDA_TIMEOUT = float(os.environ.get("PGHYDRATE_TWIN_LAMBDA_TIMEOUT", "3600"))
LAMBDA_PAYLOAD_LIMIT = 6 * 1024 * 1024  # bytes, request and response (synchronous invoke)
ASYNC_PAYLOAD_LIMIT = 256 * 1024  # bytes, an asynchronous invoke's event (the classic limit; AWS allows 1 MB since 2025)
# Every asynchronous invoke: {"function", "payload", "status": running|succeeded|failed, "response"}.
ASYNC_INVOCATIONS: list = []
STATE_LIMIT = 256 * 1024
HISTORY_LIMIT = 25_000
# instance id -> {"address", "port", "script": [{"status": ..., "storage": ..., "progress": ...}], "now": {...}}
INSTANCES: dict = {}
DESCRIBES: dict = {}
LIST_LAG = float(os.environ.get("PGHYDRATE_TWIN_LIST_LAG_SECONDS", "3"))


def _now(db):
    return INSTANCES.get(db.db_instance_identifier, {}).get("now", {})


_orig_address = DBInstance.address
DBInstance.address = property(lambda self: INSTANCES.get(self.db_instance_identifier, {}).get("address") or _orig_address.fget(self))
DBInstance.storage_operation_status = property(lambda self: _now(self).get("storage"))
DBInstance.storage_operation_percent_progress = property(lambda self: _now(self).get("progress"))

_orig_describe = RDSResponse.describe_db_instances


def _describe(self):
    ident = self.params.get("DBInstanceIdentifier")
    with LOCK:
        if ident:
            DESCRIBES[ident] = DESCRIBES.get(ident, 0) + 1
        entry = INSTANCES.get(ident)
        if entry is not None:
            if entry["script"]:
                entry["now"] = entry["script"].pop(0)
            status = entry["now"].get("status")
            if status:
                for account in get_backend("rds").values():
                    for region in account.values():
                        db = region.databases.get(ident)
                        if db is not None:
                            if status == "deleted":
                                del region.databases[ident]
                            else:
                                db.status = status
    return _orig_describe(self)


RDSResponse.describe_db_instances = _describe

from moto.stepfunctions.parser.asl.component.state.exec.state_map.result_writer.resource_eval import resource_eval_s3


# WriterConfig per ResultWriter, by its static (Bucket, Prefix): moto's parser does not know the field, so it
# is taken out of the definition before parsing and applied when the results are written.
WRITER_CONFIGS: dict = {}
# Map Run ARN -> {child index: the child's input (after ItemSelector)}
CHILD_INPUTS: dict = {}

from moto.stepfunctions.parser.asl.parse.asl_parser import AmazonStateLanguageParser
from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.itemprocessor.distributed_item_processor_worker import (
    DistributedItemProcessorWorker,
)

_orig_parse = AmazonStateLanguageParser.parse


def _take_writer_configs(node):
    if isinstance(node, dict):
        writer = node.get("ResultWriter")
        if isinstance(writer, dict) and "WriterConfig" in writer:
            config = writer.pop("WriterConfig")
            params = writer.get("Parameters") or {}
            WRITER_CONFIGS[(params.get("Bucket"), params.get("Prefix", ""))] = config
        for v in node.values():
            _take_writer_configs(v)
    elif isinstance(node, list):
        for v in node:
            _take_writer_configs(v)


def _parse(definition: str):
    try:
        tree = json.loads(definition)
    except ValueError:
        return _orig_parse(definition)
    _take_writer_configs(tree)
    return _orig_parse(json.dumps(tree))


AmazonStateLanguageParser.parse = staticmethod(_parse)

_orig_distributed_eval_input = DistributedItemProcessorWorker._eval_input


def _distributed_eval_input(self, env_frame):
    _orig_distributed_eval_input(self, env_frame)
    index = env_frame.states.context_object.context_object_data["Map"]["Item"]["Index"]
    with LOCK:
        CHILD_INPUTS.setdefault(self._map_run_record.map_run_arn, {})[index] = env_frame.states.get_input()


DistributedItemProcessorWorker._eval_input = _distributed_eval_input

# Each child execution of a Distributed Map has a history of its own, as on AWS: its own 25,000 events,
# kept apart from the parent's (moto gives all children of a Map Run one history and drops it). Tests
# read them with GET /map-run?arn=<Map Run ARN> (Twin.history follows them).
from moto.stepfunctions.parser.asl.eval.event.event_manager import EventManager

CHILD_HISTORIES: dict = {}  # Map Run ARN -> [(child index, EventManager)]
_orig_distributed_eval_job = DistributedItemProcessorWorker._eval_job


def _distributed_eval_job(self, env, job):
    manager = EventManager()
    env.event_manager = manager
    with LOCK:
        CHILD_HISTORIES.setdefault(self._map_run_record.map_run_arn, []).append((job.job_index, manager))
    return _orig_distributed_eval_job(self, env, job)


DistributedItemProcessorWorker._eval_job = _distributed_eval_job


# The Map Run each thread started last. moto's pool of Map Runs is shared by every frame of an execution,
# and its ResultWriter takes the last one added: with Distributed Maps running in several child
# executions at once (PerInstance, then WarmDistributed in each), that is another instance's. A Map
# state adds its run and writes its results in the same thread; its children run in other threads.
MAP_RUN_OF_THREAD = threading.local()

from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.itemprocessor.map_run_record import (
    MapRunRecordPoolManager,
)

_orig_pool_add = MapRunRecordPoolManager.add


def _pool_add(self, map_run_record):
    MAP_RUN_OF_THREAD.run = map_run_record
    return _orig_pool_add(self, map_run_record)


MapRunRecordPoolManager.add = _pool_add


def _put_results(env, resource_runtime_part, state_credentials):
    import datetime
    parameters = env.stack.pop()
    results = env.stack.pop()
    s3 = resource_eval_s3.ResourceEvalS3._get_s3_client(resource_runtime_part, state_credentials)
    run = getattr(MAP_RUN_OF_THREAD, "run", None) or env.map_run_record_pool_manager.get_all().pop()
    uuid = run.map_run_arn.split(":")[-1]
    config = WRITER_CONFIGS.get((parameters.get("Bucket"), parameters.get("Prefix", "")), {})
    transformation = config.get("Transformation", "NONE")
    lines = config.get("OutputType", "JSON") == "JSONL"
    prefix = parameters.get("Prefix", "")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    with LOCK:
        inputs = CHILD_INPUTS.pop(run.map_run_arn, {})
    now = datetime.datetime.now(datetime.timezone.utc).isoformat()
    # The Map Run's children: <state machine>/<map label>:<uuid>, as Step Functions names them.
    machine = run.map_run_arn.split(":")[6].split("/")[0]
    arn_prefix = ":".join(run.map_run_arn.split(":")[:5]) + f":execution:{machine}/" + run.map_run_arn.split(":")[6].split("/")[-1]

    def full(i, output, status):
        entry = {"ExecutionArn": f"{arn_prefix}:{i:08d}", "Input": json.dumps(inputs.get(i)),
                 "InputDetails": {"Included": True}, "Name": f"{i:08d}", "RedriveCount": 0,
                 "RedriveStatus": "NOT_REDRIVABLE", "StartDate": now, "StateMachineArn": run.map_run_arn,
                 "Status": status, "StopDate": now}
        if status == "SUCCEEDED":
            entry["Output"] = json.dumps(output)
            entry["OutputDetails"] = {"Included": True}
        else:
            entry["Error"] = "States.TaskFailed"
            entry["Cause"] = "the child execution failed (the twin keeps no cause)"
        return entry

    files = {"SUCCEEDED": [], "FAILED": []}
    for i, output in enumerate(results or []):
        if output is None:
            files["FAILED"].append(full(i, None, "FAILED"))
        elif transformation == "NONE":
            files["SUCCEEDED"].append(full(i, output, "SUCCEEDED"))
        elif transformation == "FLATTEN" and isinstance(output, list):
            files["SUCCEEDED"].extend(output)
        else:
            files["SUCCEEDED"].append(output)
    listed = {"FAILED": [], "PENDING": [], "SUCCEEDED": []}
    for status, entries in files.items():
        if not entries and status != "SUCCEEDED":
            continue
        if lines:
            body = "".join(json.dumps(e) + "\n" for e in entries).encode()
        else:
            body = json.dumps(entries).encode()
        key = f"{prefix}{uuid}/{status}_0.json"
        s3.put_object(Bucket=parameters["Bucket"], Key=key, Body=body)
        listed[status].append({"Key": key, "Size": len(body)})
    manifest = {"DestinationBucket": parameters["Bucket"], "MapRunArn": run.map_run_arn, "ResultFiles": listed}
    key = f"{prefix}{uuid}/manifest.json"
    s3.put_object(Bucket=parameters["Bucket"], Key=key, Body=json.dumps(manifest).encode())
    env.stack.append({"MapRunArn": run.map_run_arn, "ResultWriterDetails": {"Bucket": parameters["Bucket"], "Key": key}})


resource_eval_s3.ResourceEvalS3._handle_put_object = staticmethod(_put_results)

# --- Step Functions as strict as AWS documents it -----------------------------------------------------
from moto.stepfunctions.parser.asl.component.common.error_name.custom_error_name import CustomErrorName
from moto.stepfunctions.parser.asl.component.common.error_name.error_equals_decl import ErrorEqualsDecl
from moto.stepfunctions.parser.asl.component.common.error_name.failure_event import FailureEvent, FailureEventException
from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name import StatesErrorName
from moto.stepfunctions.parser.asl.component.common.error_name.states_error_name_type import StatesErrorNameType
from moto.stepfunctions.parser.asl.component.state.state import CommonStateField
from moto.stepfunctions.parser.asl.component.state.exec.state_task.state_task_lambda import StateTaskLambda
from moto.stepfunctions.parser.asl.eval.event.event_detail import EventDetails
from moto.stepfunctions.parser.asl.utils.encoding import to_json_str
from moto.stepfunctions.parser.api import ExecutionFailedEventDetails, HistoryEventType
from botocore.exceptions import ClientError

UNCATCHABLE_BY_ALL = {StatesErrorNameType.StatesStatesDataLimitExceeded, StatesErrorNameType.StatesRuntime}
_orig_error_equals = ErrorEqualsDecl._eval_body


def _error_equals(self, env):
    error_name = env.stack[-1]
    if (ErrorEqualsDecl._STATE_ALL_ERROR in self.error_names and isinstance(error_name, StatesErrorName)
            and error_name.typ in UNCATCHABLE_BY_ALL):
        env.stack.pop()
        env.stack.append(False)  # States.ALL stands alone in ErrorEquals: nothing else here can name it
        return
    return _orig_error_equals(self, env)


ErrorEqualsDecl._eval_body = _error_equals


def _fail(env, typ, cause):
    raise FailureEventException(failure_event=FailureEvent(
        env=env, error_name=StatesErrorName(typ=typ), event_type=HistoryEventType.TaskFailed,
        event_details=EventDetails(executionFailedEventDetails=ExecutionFailedEventDetails(error=typ.to_name(), cause=cause))))


_orig_state_body = CommonStateField._eval_body


def _state_body(self, env):
    events = env.event_manager._event_id_gen._next_id - 1
    if events >= HISTORY_LIMIT:
        _fail(env, StatesErrorNameType.StatesRuntime,
              f"The execution history reached its limit of {HISTORY_LIMIT} events at state '{self.name}'.")
    size = len(to_json_str(env.states.get_input()).encode())
    if size > STATE_LIMIT:
        _fail(env, StatesErrorNameType.StatesStatesDataLimitExceeded,
              f"The input of state '{self.name}' is {size} bytes, over the {STATE_LIMIT}-byte limit.")
    return _orig_state_body(self, env)


CommonStateField._eval_body = _state_body


def _error_name(error_name=None):
    """A branch's or an iteration's error, carried up as what it is: moto rebuilds it as a custom error
    name, which refuses "States." names and turns every States.* error into States.Runtime."""
    if error_name and error_name.startswith("States."):
        try:
            return StatesErrorName.from_name(error_name)
        except Exception:
            pass
    return CustomErrorName(error_name)


import moto.stepfunctions.parser.asl.component.state.exec.state_parallel.branches_decl as _branches_decl
import moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.iteration_worker as _iteration_worker

_branches_decl.CustomErrorName = _error_name
_iteration_worker.CustomErrorName = _error_name

_orig_lambda_from_error = StateTaskLambda._from_error


def _lambda_from_error(self, env, ex):
    if isinstance(ex, ClientError):
        name = f"Lambda.{ex.response['Error'].get('Code') or 'Unknown'}"
        failure = _orig_lambda_from_error(self, env, ex)
        failure.error_name = CustomErrorName(name)
        details = failure.event_details.get("lambdaFunctionFailedEventDetails")
        if details is not None:
            details["error"] = name
        return failure
    return _orig_lambda_from_error(self, env, ex)


StateTaskLambda._from_error = _lambda_from_error

from moto.stepfunctions.parser.asl.component.state.exec.state_task.service.state_task_service_lambda import (  # noqa: E402
    StateTaskServiceLambda,
)

_orig_service_lambda_from_error = StateTaskServiceLambda._from_error


def _service_lambda_from_error(self, env, ex):
    """A function error whose payload has no errorType is Lambda.Unknown, as Step Functions names it
    ("Unhandled errors in Lambda are reported as Lambda.Unknown ... out-of-memory errors and function
    timeouts"); moto names it "Exception"."""
    failure = _orig_service_lambda_from_error(self, env, ex)
    if isinstance(ex, lambda_eval_utils.LambdaFunctionErrorException):
        try:
            typed = "errorType" in json.loads(ex.payload)
        except (ValueError, TypeError):
            typed = False
        if not typed:
            failure.error_name = CustomErrorName("Lambda.Unknown")
            details = failure.event_details.get("taskFailedEventDetails")
            if details is not None:
                details["error"] = "Lambda.Unknown"
    return failure


StateTaskServiceLambda._from_error = _service_lambda_from_error

LAMBDA_URL = os.environ.get("PGHYDRATE_TWIN_LAMBDA_URL", "http://127.0.0.1:9002")


def _lambda_client(region, state_credentials=None):
    return boto3.client(
        "lambda",
        region_name=region,
        endpoint_url=LAMBDA_URL,
        aws_access_key_id="ak",
        aws_secret_access_key="sk",
        config=Config(parameter_validation=False, retries={"total_max_attempts": 1}, read_timeout=3600, connect_timeout=10),
    )


_orig_boto_client_for = lambda_eval_utils.boto_client_for


def _boto_client_for(region, service, state_credentials=None):
    if service == "lambda":
        return _lambda_client(region, state_credentials)
    return _orig_boto_client_for(region=region, service=service, state_credentials=state_credentials)


lambda_eval_utils.boto_client_for = _boto_client_for


import uuid

from moto.stepfunctions.parser.models import StepFunctionsParserBackend

_orig_start_execution = StepFunctionsParserBackend.start_execution


def _start_execution_named(self, state_machine_arn, name=None, execution_input=None, trace_header=None):
    return _orig_start_execution(self, state_machine_arn, name or str(uuid.uuid4()), execution_input, trace_header)


StepFunctionsParserBackend.start_execution = _start_execution_named

from moto.events.models import Rule
from moto.utilities.arns import parse_arn

DELIVERIES: list = []  # {"rule", "target", "executionArn" | "error"} per EventBridge -> Step Functions delivery
_orig_send_to_targets = Rule.send_to_targets


def _start_execution(rule: str, target: dict, body: str):
    sfn = boto3.client("stepfunctions", region_name=target["Arn"].split(":")[3],
                       endpoint_url=f"http://127.0.0.1:{os.environ['MOTO_PORT']}",
                       aws_access_key_id="events", aws_secret_access_key="events")
    record = {"rule": rule, "target": target["Arn"]}
    try:
        record["executionArn"] = sfn.start_execution(stateMachineArn=target["Arn"], input=body)["executionArn"]
    except Exception as e:  # recorded for the test to see, as EventBridge's failed-invocation metric would
        record["error"] = str(e)
    with LOCK:
        DELIVERIES.append(record)


def _send_to_targets(self, original_event, transform_input=True):
    if not self.event_pattern.matches_event(original_event):
        return
    states = [t for t in self.targets if parse_arn(t["Arn"]).service == "states"]
    for target in states:
        if "InputTransformer" in target or "InputPath" in target:
            raise NotImplementedError("moto_ext: Step Functions targets take the whole event or a constant Input")
        event = {k: v for k, v in original_event.items() if k != "ingestion-time"}
        when = event.get("time")
        if not isinstance(when, str):  # moto keeps a timestamp; EventBridge sends RFC 3339
            import datetime
            when = when if isinstance(when, datetime.datetime) else datetime.datetime.fromtimestamp(float(when), datetime.timezone.utc)
            event["time"] = when.strftime("%Y-%m-%dT%H:%M:%SZ")
        body = target.get("Input") or json.dumps(event)
        threading.Thread(target=_start_execution, args=(self.name, target, body), daemon=True).start()
    others = [t for t in self.targets if t not in states]
    if others:
        saved, self.targets = self.targets, others
        try:
            _orig_send_to_targets(self, original_event, transform_input)
        finally:
            self.targets = saved


Rule.send_to_targets = _send_to_targets


def _secret_arn(secret_id: str) -> str:
    """A secret's ARN from its name or ARN, as Secrets Manager authorizes it (the full ARN, suffix included)."""
    if secret_id.startswith("arn:"):
        return secret_id
    for account in get_backend("secretsmanager").values():
        for backend in account.values():
            for arn, secret in backend.secrets.items():
                if getattr(secret, "name", None) == secret_id:
                    return getattr(secret, "arn", arn)
    return f"arn:aws:secretsmanager:{iam.REGION}:{iam.ACCOUNT}:secret:{secret_id}"


def authorize(headers: dict, method: str, host: str, path: str, query: dict, body: bytes | None) -> tuple:
    """(denial message or None, the caller's role or None, the request's (action, resource, context) or
    None). Requests that are not a function's go on unchecked (the tests', the interpreter's)."""
    key, service = iam.caller_of(headers.get("authorization", ""))
    with LOCK:
        role = ROLES.get(key)
        configured = bool(ROLES)
    if role is None:
        if key and key.startswith("ASIATWIN") and not configured:
            return "the twin's IAM is not configured (POST /iam) for this function's credentials", None, None
        return None, None, None
    named = iam.request_of(service, method, host, path, query, headers, body or b"", _secret_arn)
    if named is None:
        message = (f"the twin cannot name the permission {method} {path} ({service}) needs: add it to "
                   f"twin/iam.py request_of")
        action, resource = f"{service}:?", path
    else:
        action, resource, context = named
        decision = iam.decide(role["statements"], action, resource, context)
        if decision == "allow":
            return None, role, named
        message = iam.denial_message(role["role"], role["function"], action, resource, decision)
    with LOCK:
        DENIALS.append({"function": role["function"], "action": action, "resource": resource, "message": message})
    print(f"twin IAM: denied: {message}", flush=True)
    return message, role, named


def may_list(role: dict, bucket: str) -> bool:
    return iam.decide(role["statements"], "s3:ListBucket", f"arn:aws:s3:::{bucket}", {}) == "allow"


def _aws_error(service: str, message: str) -> tuple:
    """(status, headers, body) of AccessDenied as `service` answers it."""
    rid = str(uuid.uuid4())
    if service == "s3":
        body = (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>AccessDenied</Code>"
                f"<Message>{xml_escape(message)}</Message><RequestId>{rid}</RequestId></Error>")
        return 403, [("Content-Type", "application/xml"), ("x-amz-request-id", rid)], body.encode()
    if service == "rds":
        body = (f"<ErrorResponse xmlns=\"http://rds.amazonaws.com/doc/2014-10-31/\"><Error><Type>Sender</Type>"
                f"<Code>AccessDenied</Code><Message>{xml_escape(message)}</Message></Error>"
                f"<RequestId>{rid}</RequestId></ErrorResponse>")
        return 403, [("Content-Type", "text/xml"), ("x-amzn-RequestId", rid)], body.encode()
    body = json.dumps({"__type": "AccessDeniedException", "message": message, "Message": message}).encode()
    return 400 if service in ("secretsmanager", "states") else 403, [
        ("Content-Type", "application/x-amz-json-1.1"), ("x-amzn-ErrorType", "AccessDeniedException"),
        ("x-amzn-RequestId", rid)], body


from moto.moto_server.werkzeug_app import DomainDispatcherApplication  # noqa: E402

_orig_dispatch = DomainDispatcherApplication.__call__


def _gated_dispatch(self, environ, start_response):
    """moto's WSGI entry, behind the IAM gate (functions' requests only)."""
    headers = {k[5:].replace("_", "-").lower(): v for k, v in environ.items() if k.startswith("HTTP_")}
    if not headers.get("authorization", "").count("ASIATWIN"):
        return _orig_dispatch(self, environ, start_response)
    _, service = iam.caller_of(headers["authorization"])
    body = None
    if service != "s3":  # S3 bodies may be streamed (aws-chunked): S3's permissions never need them
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        environ["wsgi.input"] = io.BytesIO(body)
    query = dict(urllib.parse.parse_qsl(environ.get("QUERY_STRING", ""), keep_blank_values=True))
    method, path, host = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "/"), headers.get("host", "")
    denied, role, named = authorize(headers, method, host.split(":")[0], path, query, body)
    if denied:
        status, hdrs, out = _aws_error(service, denied)
        start_response(f"{status} Denied", hdrs + [("Content-Length", str(len(out)))])
        return [out]
    if not (named and named[0] == "s3:GetObject"):
        return _orig_dispatch(self, environ, start_response)
    # GetObject of a key that does not exist: 404 only to a caller that may list the bucket.
    captured = {}

    def capture(status, hdrs, exc_info=None):
        captured.update(status=status, headers=hdrs)
        return lambda data: None

    out = b"".join(_orig_dispatch(self, environ, capture))
    bucket = named[1].split(":::", 1)[1].split("/", 1)[0]
    if captured["status"].startswith("404") and (b"NoSuchKey" in out or method == "HEAD") and not may_list(role, bucket):
        message = (f"Access Denied (the key does not exist, and {role['role']} may not s3:ListBucket "
                   f"arn:aws:s3:::{bucket}: S3 answers 403, not 404)")
        with LOCK:
            DENIALS.append({"function": role["function"], "action": "s3:ListBucket",
                            "resource": f"arn:aws:s3:::{bucket}", "message": message})
        print(f"twin IAM: {role['function']}: {message}", flush=True)
        status, hdrs, out = _aws_error("s3", "Access Denied")
        start_response(f"{status} Forbidden", hdrs + [("Content-Length", str(len(out)))])
        return [out] if method != "HEAD" else [b""]
    start_response(captured["status"], captured["headers"])
    return [out]


DomainDispatcherApplication.__call__ = _gated_dispatch


class Control(BaseHTTPRequestHandler):
    """POST /instance {"id", "address", "port", "script": [...]}; POST /iam {"stack", "params", "refs",
    "attrs"}; GET /describes; GET /deliveries; GET /denials (?take=1: and forget them)."""

    def log_message(self, *args):
        pass

    def _reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path == "/instance":
            with LOCK:
                INSTANCES[body["id"]] = {
                    "address": body.get("address"),
                    "script": list(body.get("script", [])),
                    "now": {},
                }
                if "port" in body:
                    for account in get_backend("rds").values():
                        for region in account.values():
                            db = region.databases.get(body["id"])
                            if db is not None:
                                db.port = body["port"]
            return self._reply(200, {"ok": True})
        if self.path == "/iam":
            stack = iam.Stack(iam.load_template(), body["stack"], body["params"], body["refs"],
                              {tuple(k.split(".", 1)): v for k, v in body["attrs"].items()})
            roles = iam.role_statements(stack)
            with LOCK:
                ROLES.clear()
                for function, role in roles.items():
                    ROLES[iam.function_key(function)] = dict(role, function=function)
                    FUNCTION_OF_NAME[role["name"]] = function
            return self._reply(200, {"roles": {f: {"role": r["role"], "name": r["name"]} for f, r in roles.items()}})
        if self.path == "/lambda-fault":
            with LOCK:
                LAMBDA_FAULTS[body["function"]] = [body["fault"], int(body.get("count", 1))]
            return self._reply(200, {"ok": True})
        return self._reply(404, {"error": self.path})

    def do_GET(self):
        if self.path.startswith("/map-run?"):
            from urllib.parse import parse_qs, urlparse
            arn = parse_qs(urlparse(self.path).query)["arn"][0]
            with LOCK:
                children = sorted(CHILD_HISTORIES.get(arn, []), key=lambda c: c[0])
            body = [{"index": i, "events": m.get_event_history()} for i, m in children]
            data = json.dumps({"children": body}, default=str).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        if self.path == "/describes":
            with LOCK:
                return self._reply(200, {"describes": DESCRIBES, "scripts_left": {k: len(v["script"]) for k, v in INSTANCES.items()}})
        if self.path == "/async-invocations":
            with LOCK:
                return self._reply(200, {"invocations": [dict(r) for r in ASYNC_INVOCATIONS]})
        if self.path == "/deliveries":
            with LOCK:
                return self._reply(200, {"deliveries": list(DELIVERIES)})
        if self.path in ("/denials", "/denials?take=1"):
            with LOCK:
                out = list(DENIALS)
                if self.path.endswith("take=1"):
                    DENIALS.clear()
            return self._reply(200, {"denials": out})
        return self._reply(404, {"error": self.path})


class LambdaShim(BaseHTTPRequestHandler):
    """Lambda Invoke API in front of `cargo lambda watch`: ARNs become bare names, and a function error
    (watch: HTTP 500 with errorType) becomes what real Lambda returns (200 + X-Amz-Function-Error)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _error(self, status: int, code: str, message: str):
        body = json.dumps({"Type": "User", "message": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("x-amzn-ErrorType", code)
        self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _reply(self, body: bytes, function_error):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("X-Amz-Executed-Version", "$LATEST")
        if function_error:
            self.send_header("X-Amz-Function-Error", function_error)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        parts = self.path.split("/")
        # /2015-03-31/functions/{name}/invocations
        name = urllib.request.unquote(parts[3]).split(":function:")[-1].split(":")[0]
        payload = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        headers = {k.lower(): v for k, v in self.headers.items()}
        denied, _, _ = authorize(headers, "POST", "127.0.0.1", self.path.split("?")[0], {}, payload)
        if denied:
            return self._error(403, "AccessDeniedException", denied)
        name = FUNCTION_OF_NAME.get(name, name)
        with LOCK:
            fault = LAMBDA_FAULTS.get(name)
            if fault and fault[1] > 0:
                fault[1] -= 1
            else:
                fault = None
        if fault and fault[0] == "inactive":
            return self._error(502, "ResourceNotReadyException",
                               f"The function {name} is inactive and is being restored (the twin's fault injection).")
        if fault and fault[0] == "throttled":
            return self._error(429, "TooManyRequestsException", "Rate Exceeded. (the twin's fault injection)")
        timed_out = json.dumps({"errorType": "Sandbox.Timedout",
                                "errorMessage": f"RequestId: twin Error: Task timed out after {LAMBDA_TIMEOUT:.2f} seconds"}).encode()
        if fault and fault[0] == "timedout":
            return self._reply(timed_out, "Unhandled")
        if fault and fault[0] == "unknown":  # killed with no error type: an out-of-memory kill
            return self._reply(json.dumps({"errorMessage": "RequestId: twin Error: Runtime exited with error: "
                                                           "signal: killed (the twin's fault injection)"}).encode(), "Unhandled")
        if self.headers.get("X-Amz-Invocation-Type") == "Event":
            # Asynchronous: Lambda queues the event and answers 202 at once; the caller never sees the
            # function's result or error (tests read them from GET /async-invocations).
            if len(payload) > ASYNC_PAYLOAD_LIMIT:
                return self._error(413, "RequestEntityTooLargeException",
                                   f"Request must be smaller than {ASYNC_PAYLOAD_LIMIT} bytes for the InvokeFunction "
                                   "operation (asynchronous invocation)")
            record = {"function": name, "payload": json.loads(payload or b"null"), "status": "running"}
            with LOCK:
                ASYNC_INVOCATIONS.append(record)

            def run():
                body, error = self._forward(name, payload, timed_out)
                with LOCK:
                    record["status"] = "failed" if error else "succeeded"
                    record["response"] = json.loads(body or b"null")

            threading.Thread(target=run, daemon=True).start()
            self.send_response(202)
            self.send_header("x-amzn-RequestId", str(uuid.uuid4()))
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if len(payload) > LAMBDA_PAYLOAD_LIMIT:
            return self._error(413, "RequestEntityTooLargeException",
                               f"Request must be smaller than {LAMBDA_PAYLOAD_LIMIT} bytes for the InvokeFunction operation")
        self._reply(*self._forward(name, payload, timed_out))

    @staticmethod
    def _forward(name: str, payload: bytes, timed_out: bytes):
        """The function's answer from the emulator: (body, function error or None)."""
        target = f"{os.environ['PGHYDRATE_TWIN_WATCH_URL']}/2015-03-31/functions/{name}/invocations"
        req = urllib.request.Request(target, data=payload, method="POST", headers={"Content-Type": "application/json"})
        function_error = None
        try:
            with urllib.request.urlopen(req, timeout=LAMBDA_TIMEOUT) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            body = e.read()
            function_error = "Unhandled"
        except (TimeoutError, urllib.error.URLError) as e:
            if not isinstance(e, TimeoutError) and not isinstance(getattr(e, "reason", None), TimeoutError):
                raise
            return timed_out, "Unhandled"
        if len(body) > LAMBDA_PAYLOAD_LIMIT:
            body = json.dumps({"errorType": "Function.ResponseSizeTooLarge",
                               "errorMessage": f"Response payload size ({len(body)} bytes) exceeded maximum allowed "
                                               f"payload size ({LAMBDA_PAYLOAD_LIMIT} bytes)."}).encode()
            function_error = "Unhandled"
        return body, function_error


def serve_side_ports(control_port: int, shim_port: int):
    for port, handler in ((control_port, Control), (shim_port, LambdaShim)):
        server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()


import datetime

from moto.stepfunctions.models import StepFunctionBackend, PAGINATION_MODEL
from moto.utilities.paginator import paginate

_list_executions_unpaginated = StepFunctionBackend.list_executions.__wrapped__


@paginate(pagination_model=PAGINATION_MODEL)
def list_executions(self, state_machine_arn, status_filter=None):  # the name paginate's model is keyed by
    now = datetime.datetime.now(datetime.timezone.utc)

    def age(e):
        started = e.start_date
        if started.tzinfo is None:
            started = started.replace(tzinfo=datetime.timezone.utc)
        return (now - started).total_seconds()

    return [e for e in _list_executions_unpaginated(self, state_machine_arn, status_filter) if age(e) >= LIST_LAG]


StepFunctionBackend.list_executions = list_executions

from moto.s3.responses import S3Response

S3_CONDITIONAL = threading.Lock()
_orig_put_object = S3Response.put_object
_orig_delete_object = S3Response.delete_object


def _put_object_atomic(self):
    if self.headers.get("If-None-Match") or self.headers.get("If-Match"):
        with S3_CONDITIONAL:
            return _orig_put_object(self)
    return _orig_put_object(self)


def _delete_object_atomic(self):
    if self.headers.get("If-Match"):
        with S3_CONDITIONAL:
            return _orig_delete_object(self)
    return _orig_delete_object(self)


S3Response.put_object = _put_object_atomic
S3Response.delete_object = _delete_object_atomic


from moto.rds.models import BlueGreenDeployment, SwitchoverDetails

_orig_bg_init = BlueGreenDeployment.__init__
_orig_bg_set_status = BlueGreenDeployment.set_status


def _bg_init(self, backend, blue_green_deployment_name, source, tags=None, **kwargs):
    _orig_bg_init(self, backend, blue_green_deployment_name, source, tags, **kwargs)
    blue = self._get_valid_instance_or_raise(source)
    members = [(source, self.target)]
    for replica_id in list(getattr(blue, "read_replica_db_instance_identifiers", [])):
        replica = backend.find_db_from_id(replica_id)
        self.source = replica.db_instance_arn
        try:
            members.append((replica.db_instance_arn,
                            self._create_green_instance(None, None, None, None, None, None, None, None)))
        finally:
            self.source = source
    self.members = members
    self.set_status(self.SupportedStates[self.status])


def _bg_set_status(self, value):
    _orig_bg_set_status(self, value)
    if getattr(self, "members", None):
        self.switchover_details = [SwitchoverDetails(s, t, self.status) for s, t in self.members]


BlueGreenDeployment.__init__ = _bg_init
BlueGreenDeployment.set_status = _bg_set_status


from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.inline_iteration_component import (
    InlineIterationComponent,
)
from moto.stepfunctions.parser.asl.component.state.exec.state_map.iteration.distributed_iteration_component import (
    DistributedIterationComponent,
)

INLINE_MAP_CONCURRENCY = 40
_orig_inline_eval_body = InlineIterationComponent._eval_body


def _inline_eval_body(self, env):
    if not isinstance(self, DistributedIterationComponent):
        eval_input = env.stack[-1]
        if not eval_input.max_concurrency or eval_input.max_concurrency > INLINE_MAP_CONCURRENCY:
            eval_input.max_concurrency = INLINE_MAP_CONCURRENCY
    return _orig_inline_eval_body(self, env)


InlineIterationComponent._eval_body = _inline_eval_body

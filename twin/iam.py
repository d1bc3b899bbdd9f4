"""IAM for the twin: each function's role as infra/template.yaml writes it, and the decision AWS makes on a
request signed with that role's credentials.

- `Stack` resolves the template's intrinsic functions (Ref, Fn::Sub, Fn::If, Fn::Join, Fn::GetAtt and the
  conditions) for the twin's stack: its name, region, account, parameters and state bucket.
- `role_statements` gives each function's policy statements (its `Policies`, resolved), keyed by the
  function's binary name.
- `decide` evaluates statements as IAM documents it for identity-based policies: an explicit Deny wins,
  else an Allow is needed; Action and Resource match with the wildcards * and ?; a condition on a key the
  request does not carry does not match (AWS: "the condition returns false").
- `request_of` names the action and resource of a request as the service authorizes it (the calls the
  functions make; a request the twin cannot name is denied, so that a new call needs a rule here first).

What it does not model: resource-based policies (bucket, key, secret policies), permission boundaries,
SCPs, session policies; the managed policies SAM attaches (logs, X-Ray, the VPC's network interfaces),
which cover no call the functions make."""
import json
import re
import urllib.parse
from pathlib import Path

import yaml

REGION = "us-east-1"
ACCOUNT = "123456789012"
PARTITION = "aws"
NO_VALUE = object()


class TaggedLoader(yaml.SafeLoader):
    """Keeps CloudFormation's short forms as their long forms: !Sub x is {"Fn::Sub": x}, !Ref x {"Ref": x}."""


def _tagged(loader, suffix, node):
    if isinstance(node, yaml.ScalarNode):
        value = loader.construct_scalar(node)
    elif isinstance(node, yaml.SequenceNode):
        value = loader.construct_sequence(node, deep=True)
    else:
        value = loader.construct_mapping(node, deep=True)
    if suffix in ("Ref", "Condition"):
        return {suffix: value}
    if suffix == "GetAtt" and isinstance(value, str):
        value = value.split(".", 1)
    return {f"Fn::{suffix}": value}


TaggedLoader.add_multi_constructor("!", _tagged)


def load_template() -> dict:
    path = Path(__file__).resolve().parent.parent / "infra" / "template.yaml"
    return yaml.load(path.read_text(), Loader=TaggedLoader)


class Stack:
    """The template as deployed with `params` under `name`; `refs` and `attrs` give resources' Ref and
    Fn::GetAtt values (the twin's bucket, its function names)."""

    def __init__(self, template: dict, name: str, params: dict, refs: dict, attrs: dict):
        self.template, self.name, self.refs, self.attrs = template, name, refs, attrs
        self.params = {}
        for key, spec in template.get("Parameters", {}).items():
            value = params.get(key, spec.get("Default"))
            if value is None:
                raise ValueError(f"parameter {key} has no default and the twin gives it no value")
            if spec.get("Type") == "CommaDelimitedList" and isinstance(value, str):
                value = value.split(",")
            self.params[key] = value
        unknown = set(params) - set(self.params)
        if unknown:
            raise ValueError(f"the template has no parameters {sorted(unknown)}")

    def ref(self, name: str):
        pseudo = {"AWS::StackName": self.name, "AWS::Region": REGION, "AWS::AccountId": ACCOUNT,
                  "AWS::Partition": PARTITION, "AWS::NoValue": NO_VALUE, "AWS::URLSuffix": "amazonaws.com"}
        for table in (pseudo, self.params, self.refs):
            if name in table:
                return table[name]
        raise KeyError(f"Ref {name}: not a parameter, pseudo parameter or resource the twin knows")

    def condition(self, name: str) -> bool:
        return bool(self.value(self.template["Conditions"][name]))

    def _sub(self, arg):
        text, local = (arg, {}) if isinstance(arg, str) else (arg[0], self.value(arg[1]))

        def one(m):
            var = m.group(1)
            if var in local:
                return str(local[var])
            if "." in var:
                resource, attr = var.split(".", 1)
                return str(self.attrs[(resource, attr)])
            value = self.ref(var)
            return ",".join(value) if isinstance(value, list) else str(value)

        return re.sub(r"\$\{([^}!]+)\}", one, text)

    def value(self, node):
        """`node` with every intrinsic function resolved; AWS::NoValue drops a list item or key."""
        if isinstance(node, list):
            return [v for v in (self.value(n) for n in node) if v is not NO_VALUE]
        if not isinstance(node, dict):
            return node
        if len(node) == 1:
            (key, arg), = node.items()
            fn = {
                "Ref": lambda a: self.ref(a),
                "Condition": lambda a: self.condition(a),
                "Fn::Sub": self._sub,
                "Fn::GetAtt": lambda a: self.attrs[tuple(a)],
                "Fn::If": lambda a: self.value(a[1] if self.condition(a[0]) else a[2]),
                "Fn::Join": lambda a: a[0].join(str(v) for v in self.value(a[1])),
                "Fn::Equals": lambda a: self.value(a[0]) == self.value(a[1]),
                "Fn::Not": lambda a: not self.value(a[0]),
                "Fn::And": lambda a: all(self.value(v) for v in a),
                "Fn::Or": lambda a: any(self.value(v) for v in a),
            }.get(key)
            if fn:
                return fn(arg)
            if key.startswith("Fn::"):
                raise ValueError(f"{key}: an intrinsic function the twin does not resolve")
        out = {k: self.value(v) for k, v in node.items()}
        return {k: v for k, v in out.items() if v is not NO_VALUE}


def functions(template: dict) -> dict:
    """binary -> logical id of each function in the template (BuildProperties.Binary)."""
    return {res["Metadata"]["BuildProperties"]["Binary"]: logical
            for logical, res in template["Resources"].items() if res.get("Type") == "AWS::Serverless::Function"}


def function_name(stack: Stack, logical: str) -> str:
    """The deployed function's name: its FunctionName, or as CloudFormation generates one (stack-logical-
    suffix; the twin's suffix is TWIN)."""
    named = stack.template["Resources"][logical]["Properties"].get("FunctionName")
    return stack.value(named) if named else f"{stack.name}-{logical}-TWIN"


def role_statements(stack: Stack) -> dict:
    """Each function's role, keyed by its binary: {"role", "name", "statements"}, the statements as SAM
    creates them from `Policies`. A policy that is not a document (a SAM policy template, a managed policy
    ARN) is refused: the twin could not evaluate it."""
    out = {}
    for binary, logical in functions(stack.template).items():
        res = stack.template["Resources"][logical]
        statements = []
        for policy in stack.value(res["Properties"].get("Policies", [])):
            if not isinstance(policy, dict) or "Statement" not in policy:
                raise ValueError(f"{logical}: a policy the twin cannot evaluate: {policy!r}")
            statements += policy["Statement"]
        out[binary] = {"role": f"{stack.name}-{logical}Role", "name": function_name(stack, logical),
                       "statements": statements}
    return out


def _list(v):
    return v if isinstance(v, list) else [v]


def _glob(pattern: str, value: str, case: bool) -> bool:
    regex = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern)
    return re.fullmatch(regex, value, 0 if case else re.IGNORECASE) is not None


OPERATORS = {
    "StringEquals": lambda want, got: got == want,
    "StringNotEquals": lambda want, got: got != want,
    "StringLike": lambda want, got: _glob(want, got, True),
    "StringNotLike": lambda want, got: not _glob(want, got, True),
    "ArnEquals": lambda want, got: got == want,
    "ArnLike": lambda want, got: _glob(want, got, True),
}


def _condition_holds(condition: dict, context: dict) -> bool:
    for operator, keys in condition.items():
        base, if_exists = (operator[:-8], True) if operator.endswith("IfExists") else (operator, False)
        test = OPERATORS.get(base)
        if test is None:
            raise ValueError(f"condition operator {operator}: one the twin does not evaluate")
        for key, wanted in keys.items():
            got = context.get(key.lower())
            if got is None:
                if not if_exists:
                    return False
                continue
            wanted = _list(wanted)
            negated = base.startswith("StringNot")
            ok = all(test(w, got) for w in wanted) if negated else any(test(w, got) for w in wanted)
            if not ok:
                return False
    return True


def _statement_matches(st: dict, action: str, resource: str, context: dict) -> bool:
    if "Action" in st and not any(_glob(a, action, False) for a in _list(st["Action"])):
        return False
    if "NotAction" in st and any(_glob(a, action, False) for a in _list(st["NotAction"])):
        return False
    if "Resource" in st and not any(_glob(r, resource, True) for r in _list(st["Resource"])):
        return False
    if "NotResource" in st and any(_glob(r, resource, True) for r in _list(st["NotResource"])):
        return False
    return _condition_holds(st.get("Condition", {}), context)


def decide(statements: list, action: str, resource: str, context: dict | None = None) -> str:
    """"allow", "deny" (an explicit Deny) or "implicit" (no Allow), as IAM decides for one policy set."""
    context = {k.lower(): v for k, v in (context or {}).items()}
    matching = [st for st in statements if _statement_matches(st, action, resource, context)]
    if any(st["Effect"] == "Deny" for st in matching):
        return "deny"
    return "allow" if any(st["Effect"] == "Allow" for st in matching) else "implicit"


def denial_message(role: str, function: str, action: str, resource: str, decision: str) -> str:
    """As AWS words it (the caller is the function's assumed role session)."""
    why = ("with an explicit deny in an identity-based policy" if decision == "deny"
           else f"because no identity-based policy allows the {action} action")
    return (f"User: arn:{PARTITION}:sts::{ACCOUNT}:assumed-role/{role}/{function} is not authorized to "
            f"perform: {action} on resource: {resource} {why}")


def _rds(params: dict) -> tuple:
    action = params.get("Action", "")
    arn = f"arn:{PARTITION}:rds:{REGION}:{ACCOUNT}"
    if action == "DescribeDBInstances":
        return f"rds:{action}", f"{arn}:db:{params.get('DBInstanceIdentifier', '*')}"
    if action == "DescribeBlueGreenDeployments":
        return f"rds:{action}", f"{arn}:deployment:{params.get('BlueGreenDeploymentIdentifier', '*')}"
    return None


def _json_target(target: str, body: dict, secret_arn) -> tuple:
    prefix, _, op = target.partition(".")
    if prefix == "secretsmanager" and op == "GetSecretValue":
        return f"secretsmanager:{op}", secret_arn(body.get("SecretId", ""))
    if prefix == "AWSStepFunctions" and op in ("DescribeExecution", "StopExecution", "GetExecutionHistory"):
        return f"states:{op}", body.get("executionArn", "")
    if prefix == "AWSStepFunctions" and op in ("StartExecution", "ListExecutions", "DescribeStateMachine"):
        return f"states:{op}", body.get("stateMachineArn", "")
    return None


def _s3(method: str, host: str, path: str, query: dict, headers: dict) -> tuple:
    """(action, resource, context) of an S3 REST request, path-style or virtual-hosted."""
    bucket_in_host = not re.match(r"^(127\.0\.0\.1|localhost|s3[.-])", host)
    parts = urllib.parse.unquote(path).lstrip("/").split("/", 1)
    if bucket_in_host:
        bucket, key = host.split(".", 1)[0], "/".join(p for p in parts if p)
    else:
        bucket, key = parts[0], parts[1] if len(parts) > 1 else ""
    if not key:
        if method == "GET" and ("list-type" in query or not query):
            return "s3:ListBucket", f"arn:{PARTITION}:s3:::{bucket}", {"s3:prefix": query.get("prefix", "")}
        return None
    obj = f"arn:{PARTITION}:s3:::{bucket}/{key}"
    if method in ("GET", "HEAD") and not query.keys() - {"partNumber", "versionId", "x-id"}:
        return "s3:GetObject", obj, {}
    if method == "PUT" and not query.keys() - {"x-id"} and "x-amz-copy-source" not in headers:
        return "s3:PutObject", obj, {}
    if method == "DELETE" and not query.keys() - {"x-id"}:
        return "s3:DeleteObject", obj, {}
    return None


def request_of(service: str, method: str, host: str, path: str, query: dict, headers: dict, body: bytes,
               secret_arn) -> tuple | None:
    """(action, resource, context) of a request to `service` (its SigV4 credential scope), or None when
    the twin cannot name them. `secret_arn(id)` turns a secret's name or ARN into its ARN."""
    if service == "s3":
        return _s3(method, host, path, query, headers)
    if service == "rds":
        form = dict(urllib.parse.parse_qsl(body.decode())) if body else query
        named = _rds(form)
        return named and (*named, {})
    if service in ("secretsmanager", "states"):
        named = _json_target(headers.get("x-amz-target", ""), json.loads(body or b"{}"), secret_arn)
        return named and (*named, {})
    if service == "lambda":
        m = re.match(r"^/2015-03-31/functions/([^/]+)/invocations$", path)
        if m and method == "POST":
            name = urllib.parse.unquote(m.group(1))
            arn = name if name.startswith("arn:") else f"arn:{PARTITION}:lambda:{REGION}:{ACCOUNT}:function:{name}"
            return "lambda:InvokeFunction", ":".join(arn.split(":")[:7]), {}
    return None


def caller_of(authorization: str) -> str | None:
    """The access key id of a SigV4 Authorization header, and the service of its credential scope."""
    m = re.search(r"Credential=([^/]+)/[^/]+/[^/]+/([^/]+)/aws4_request", authorization or "")
    return (m.group(1), m.group(2)) if m else (None, None)


def function_key(function: str) -> str:
    """The access key id the twin gives a function's role session (twin/lambda-runner.sh sets it)."""
    return "ASIATWIN" + function.upper()

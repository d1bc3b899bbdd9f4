"""Least privilege in infra/template.yaml: no IAM statement grants a wildcard action, and every wildcard
in a resource is one of the listed exceptions, each with the reason it cannot be narrower."""
import re

from twin import load_template


# Resource wildcards that are required, with the reason. Matched against the end of the resource ARN.
RESOURCE_EXCEPTIONS = {
    r":db:\*$": "the instance to hydrate is any restored instance, known only when its event arrives",
    r":deployment:\*$": "the Blue/Green deployment is known only when its event arrives",
    r":execution:\$\{AWS::StackName\}-hydrate:\*$": "execution names are made per run; scoped to this state machine",
    r":execution:\$\{AWS::StackName\}-hydrate/\*$": "a Distributed Map's child executions are named <state machine>/<map run>:<id>, made per run",
    r":secret:rds!\*$": "RDS-managed master user secrets are named rds!db-<id>, per instance, known at run time",
    r"\$\{StateBucket.Arn\}/runs/\*$": "the workflow's own state objects, under its prefix in its own bucket",
    r"\$\{StateBucket.Arn\}/leases/\*$": "one lease per instance, named after the instance known only at run time",
    r":dbuser:\*/\$\{IamDatabaseUser\}$": "the DbiResourceId of the instance is known only at run time; the user is fixed",
}
# APIs without resource-level permissions (AWS documents "*" as their only resource).
STAR_RESOURCE_ACTIONS = {
    "logs:CreateLogDelivery", "logs:GetLogDelivery", "logs:UpdateLogDelivery", "logs:DeleteLogDelivery",
    "logs:ListLogDeliveries", "logs:PutResourcePolicy", "logs:DescribeResourcePolicies", "logs:DescribeLogGroups",
    "xray:PutTraceSegments", "xray:PutTelemetryRecords", "xray:GetSamplingRules", "xray:GetSamplingTargets",
}


def statements():
    """(resource name, statement) for every IAM statement of every resource."""
    template = load_template()
    for name, res in template["Resources"].items():
        props = res.get("Properties", {})
        policies = list(props.get("Policies") or [])
        if "PolicyDocument" in props:
            policies.append(props["PolicyDocument"])
        for policy in policies:
            for p in [policy] + list((policy.get("Fn::If") or [None, None, None])[1:]) if isinstance(policy, dict) else []:
                if isinstance(p, dict):
                    for st in p.get("Statement", []):
                        yield name, st


def resources_of(st) -> list:
    r = st.get("Resource", [])
    if isinstance(r, dict) and "Fn::If" in r:
        return [x for x in r["Fn::If"][1:] if isinstance(x, str)]
    return r if isinstance(r, list) else [r]


def test_the_template_has_statements_to_check():
    found = list(statements())
    assert len(found) >= 15, found
    assert any("secretsmanager:GetSecretValue" in st["Action"] for _, st in found)


def problems_in(named_statements) -> list:
    problems = []
    for name, st in named_statements:
        if st.get("Effect") != "Allow":
            continue
        actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
        for a in actions:
            if "*" in a:
                problems.append(f"{name}: wildcard action {a}")
        for r in resources_of(st):
            if not isinstance(r, str) or "*" not in r:
                continue
            if r == "*":
                extra = set(actions) - STAR_RESOURCE_ACTIONS
                if extra:
                    problems.append(f"{name}: Resource \"*\" for {sorted(extra)}")
            elif not any(re.search(p, r) for p in RESOURCE_EXCEPTIONS):
                problems.append(f"{name}: wildcard resource {r}")
    return problems


def test_no_wildcard_action_and_no_unlisted_wildcard_resource():
    assert problems_in(statements()) == []


def test_a_broadened_statement_would_be_caught():
    broadened = [
        ("A", {"Effect": "Allow", "Action": ["rds:*"], "Resource": "arn:aws:rds:us-east-1:1:db:x"}),
        ("B", {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": "*"}),
        ("C", {"Effect": "Allow", "Action": ["s3:GetObject"], "Resource": "arn:aws:s3:::other-bucket/*"}),
        ("D", {"Effect": "Allow", "Action": "secretsmanager:GetSecretValue",
               "Resource": {"Fn::If": ["HasSecret", "arn:aws:secretsmanager:us-east-1:1:secret:*", "x"]}}),
    ]
    assert [p.split(":")[0] for p in problems_in(broadened)] == ["A", "B", "C", "D"]


def service_principal_statements(template) -> list:
    """(resource, statement) of every resource policy statement that grants an AWS service."""
    out = []
    for name, res in template["Resources"].items():
        props = res.get("Properties", {})
        for doc in (props.get("PolicyDocument"), props.get("KeyPolicy")):
            for st in (doc or {}).get("Statement", []):
                if isinstance(st.get("Principal"), dict) and "Service" in st["Principal"]:
                    out.append((name, st))
    return out


def test_a_service_may_publish_to_the_topic_only_for_this_stack():
    """A resource policy that lets a service principal act (EventBridge publishing to the completion
    topic) names the source it acts for (aws:SourceArn), or any rule in any account could use it. The KMS
    key is exempt: its key policy is read with the topic's, which carries the condition."""
    template = load_template()
    granted = [(n, st) for n, st in service_principal_statements(template) if n != "CompletionTopicKey"]
    assert granted, "the topic policy grants EventBridge"
    for name, st in granted:
        conditions = st.get("Condition", {})
        keys = {k for op in conditions.values() for k in op}
        assert "aws:SourceArn" in keys or "aws:SourceAccount" in keys, (name, st)

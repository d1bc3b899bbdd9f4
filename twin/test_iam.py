"""The twin's IAM evaluator (twin/iam.py) on its own: the template's roles as the twin deploys them, and
the decisions IAM documents. The twin tests rely on it to refuse what AWS refuses; these show it does."""
import pytest

import iam

ARN_SECRET = "arn:aws:secretsmanager:us-east-1:123456789012:secret:pghydrate-twin-db-AbCdEf"
BUCKET = "arn:aws:s3:::pghydrate-twin-state"


def stack(**params):
    given = {"SecretArn": ARN_SECRET, "SubnetIds": "subnet-1", "SecurityGroupIds": "sg-1", "CaptureInstances": "db",
             "CaBundleLayerArn": "layer", **params}
    return iam.Stack(iam.load_template(), "pghydrate-twin", given, {"StateBucket": "pghydrate-twin-state"},
                     {("StateBucket", "Arn"): BUCKET})


def test_each_function_gets_the_statements_of_its_own_role_resolved():
    roles = iam.role_statements(stack())
    assert set(roles) == {"resolve", "describe", "plan", "warm", "maintain", "report", "capture"}
    assert roles["capture"]["name"] == "pghydrate-twin-capture", "FunctionName: ${AWS::StackName}-capture"
    plan = roles["plan"]["statements"]
    assert iam.decide(plan, "secretsmanager:GetSecretValue", ARN_SECRET) == "allow"
    assert iam.decide(plan, "secretsmanager:GetSecretValue", ARN_SECRET + "x") == "implicit"
    assert iam.decide(roles["describe"]["statements"], "secretsmanager:GetSecretValue", ARN_SECRET) == "implicit"
    # No SecretArn: the instances' RDS-managed master secrets (rds!...), and only those.
    managed = iam.role_statements(stack(SecretArn=""))["warm"]["statements"]
    rds_secret = "arn:aws:secretsmanager:us-east-1:123456789012:secret:rds!db-1234-AbCdEf"
    assert iam.decide(managed, "secretsmanager:GetSecretValue", rds_secret) == "allow"
    assert iam.decide(managed, "secretsmanager:GetSecretValue", ARN_SECRET) == "implicit"
    # Parameters that add statements (Fn::If on a condition) add them, and only then.
    kms = "arn:aws:kms:us-east-1:123456789012:key/1"
    assert iam.decide(plan, "kms:Decrypt", kms) == "implicit"
    keyed = iam.role_statements(stack(SecretKmsKeyArn=kms))["plan"]["statements"]
    via = {"kms:ViaService": "secretsmanager.us-east-1.amazonaws.com"}
    assert iam.decide(keyed, "kms:Decrypt", kms, via) == "allow"
    assert iam.decide(keyed, "kms:Decrypt", kms) == "implicit", "a condition on a key the request lacks fails"


def test_wildcards_case_and_an_explicit_deny_decide_as_iam_does():
    statements = [{"Effect": "Allow", "Action": "s3:Get*", "Resource": f"{BUCKET}/runs/*"},
                  {"Effect": "Deny", "Action": "s3:GetObject", "Resource": f"{BUCKET}/runs/secret?.json"}]
    assert iam.decide(statements, "S3:GETOBJECT", f"{BUCKET}/runs/a/plan.json") == "allow", "actions ignore case"
    assert iam.decide(statements, "s3:GetObject", f"{BUCKET}/RUNS/a") == "implicit", "resources do not"
    assert iam.decide(statements, "s3:GetObject", f"{BUCKET}/runs/secret1.json") == "deny"
    assert iam.decide(statements, "s3:PutObject", f"{BUCKET}/runs/a") == "implicit"
    with pytest.raises(ValueError, match="NumericLessThan"):
        iam.decide([{"Effect": "Allow", "Action": "*", "Resource": "*",
                     "Condition": {"NumericLessThan": {"a": "1"}}}], "s3:GetObject", "x")


def test_requests_are_named_as_the_services_authorize_them():
    name = lambda *a, **k: iam.request_of(*a, **k, secret_arn=lambda s: s)  # noqa: E731
    assert name("s3", "GET", "127.0.0.1", "/pghydrate-twin-state/leases/db%201.json", {"x-id": "GetObject"}, {}, b"") == (
        "s3:GetObject", f"{BUCKET}/leases/db 1.json", {})
    assert name("s3", "HEAD", "pghydrate-twin-state.s3.localhost", "/runs/a", {}, {}, b"") == (
        "s3:GetObject", f"{BUCKET}/runs/a", {}), "virtual-hosted style"
    assert name("s3", "GET", "127.0.0.1", "/pghydrate-twin-state", {"list-type": "2", "prefix": "leases/"}, {}, b"") == (
        "s3:ListBucket", BUCKET, {"s3:prefix": "leases/"})
    assert name("s3", "PUT", "127.0.0.1", "/b/k", {}, {"x-amz-copy-source": "b/j"}, b"") is None, "a copy needs two"
    assert name("rds", "POST", "127.0.0.1", "/", {}, {}, b"Action=DescribeDBInstances&DBInstanceIdentifier=db-1") == (
        "rds:DescribeDBInstances", "arn:aws:rds:us-east-1:123456789012:db:db-1", {})
    assert name("states", "POST", "127.0.0.1", "/", {}, {"x-amz-target": "AWSStepFunctions.DescribeExecution"},
                b'{"executionArn": "arn:x"}') == ("states:DescribeExecution", "arn:x", {})
    assert name("lambda", "POST", "127.0.0.1", "/2015-03-31/functions/arn%3Aaws%3Alambda%3Aus-east-1%3A1%3Afunction%3Af%3A7/invocations",
                {}, {}, b"") == ("lambda:InvokeFunction", "arn:aws:lambda:us-east-1:1:function:f", {}), "qualifier dropped"
    assert name("sts", "POST", "127.0.0.1", "/", {}, {}, b"Action=AssumeRole") is None

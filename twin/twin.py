"""The local twin of pghydrate's AWS side: a real PostgreSQL, moto (RDS, Secrets Manager, S3, Step Functions
executing the real ASL definition, extended by moto_ext.py), and the real Lambda binaries behind
`cargo lambda watch`. Everything it starts, it stops.

    with Twin.start() as twin:
        twin.register_instance("orders-restored", script=[...])
        out = twin.run({"instance": "orders-restored"})
"""
import datetime
import json
import os
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import boto3
import botocore.config
import yaml

ROOT = Path(__file__).resolve().parent.parent
HOME = Path(os.environ.get("PGHYDRATE_HOME", "/var/tmp/pghydrate"))
# Seconds before ListExecutions shows a started execution (moto_ext reads the same variable).
LIST_LAG = float(os.environ.get("PGHYDRATE_TWIN_LIST_LAG_SECONDS", "3"))
PG_BIN = HOME / "pg" / os.environ.get("PGHYDRATE_TWIN_PG", "15") / "bin"
RUN_AS = "pghydrate"
REGION = "us-east-1"
ACCOUNT = "123456789012"
PASSWORD = "Tw1n-S3cret-pw"
# The stack the twin stands for: its name is in the function names and ARNs the template's policies name.
STACK = "pghydrate-twin"
# The template's StartSecretArns as the twin deploys it: the secrets a start may name besides SecretArn.
START_SECRETS = f"arn:aws:secretsmanager:{REGION}:{ACCOUNT}:secret:pghydrate-twin-start-*"
# The state machine's functions (its ${XFunctionArn} placeholders), and every function the template builds.
WORKFLOW_FUNCTIONS = ["resolve", "describe", "plan", "warm", "maintain", "report"]
FUNCTIONS = WORKFLOW_FUNCTIONS + ["capture"]
TEMPLATE = ROOT / "infra" / "template.yaml"
# Lambda gives a function CPU in proportion to its memory: 1,769 MB is one vCPU (AWS Lambda developer
# guide, "Configuring Lambda function memory").
LAMBDA_MB_PER_VCPU = 1769


def host_triple() -> str:
    out = subprocess.run(["rustc", "-vV"], check=True, capture_output=True, text=True).stdout
    return next(line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("host: "))


class CfnLoader(yaml.SafeLoader):
    """Loads a CloudFormation template: intrinsic functions (!Ref, !Sub, ...) become plain values."""


def _cfn_tag(loader, suffix, node):
    if isinstance(node, yaml.ScalarNode):
        return loader.construct_scalar(node)
    if isinstance(node, yaml.SequenceNode):
        return {f"Fn::{suffix}": loader.construct_sequence(node, deep=True)}
    return loader.construct_mapping(node, deep=True)


CfnLoader.add_multi_constructor("!", _cfn_tag)


def load_template() -> dict:
    return yaml.load(TEMPLATE.read_text(), Loader=CfnLoader)


def function_memory_mb() -> dict:
    """Each function's MemorySize (MB) as infra/template.yaml deploys it (its own, or the Globals')."""
    template = load_template()
    default = int(template["Globals"]["Function"]["MemorySize"])
    out = {}
    for res in template["Resources"].values():
        binary = (res.get("Metadata") or {}).get("BuildProperties", {}).get("Binary")
        if res.get("Type") == "AWS::Serverless::Function" and binary:
            out[binary] = int(res["Properties"].get("MemorySize", default))
    missing = set(FUNCTIONS) - set(out)
    assert not missing, f"functions without a template resource: {missing}"
    return out


class Sandboxes(threading.Thread):
    """What Lambda's sandbox gives each function process that the emulator starts (cgroup v1, root):
    at most its MemorySize of memory (past it the kernel kills the process, as Lambda ends the invoke
    with Runtime.OutOfMemory), and with `cpu`, CPU in proportion to memory (256 MB: 14.5% of one
    vCPU), each process in a cgroup of its own, as each sandbox has its own share.

    Processes are found by name among the descendants of `root` (the emulator), every 50 ms: a process
    runs its first ~50 ms unconstrained. The CPU share is off unless asked for: the twin's functions are
    debug builds, many times slower than the release builds Lambda runs, so throttling them too would
    measure neither (scripts/bench-workflow.py runs release builds with it)."""

    def __init__(self, root: int, memory_mb: dict, cpu: bool, tag: str):
        super().__init__(daemon=True)
        self.root, self.memory_mb, self.cpu, self.tag = root, memory_mb, cpu, tag
        self.groups: dict[int, list[Path]] = {}
        self.placed: dict[str, int] = {}
        self.halt = threading.Event()

    def run(self):
        while not self.halt.wait(0.05):
            try:
                self._place_new()
            except OSError:
                pass  # a process that ended while being looked at
            self._release(gone_only=True)

    def _descendants(self) -> dict:
        parent, name = {}, {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    stat = (d / "stat").read_text()
                    parent[int(d.name)] = int(stat[stat.rindex(")") + 2:].split()[1])
                    name[int(d.name)] = stat[stat.index("(") + 1:stat.rindex(")")]
                except (OSError, ValueError):
                    pass
        out = {}
        for pid, comm in name.items():
            p, seen = pid, 0
            while p in parent and p != self.root and seen < 64:
                p, seen = parent[p], seen + 1
            if p == self.root and comm in self.memory_mb:
                out[pid] = comm
        return out

    def _place_new(self):
        for pid, fn in self._descendants().items():
            if pid in self.groups:
                continue
            mb = self.memory_mb[fn]
            groups = []
            mem = Path(f"/sys/fs/cgroup/memory/pghydrate-twin-lambda-{self.tag}-{pid}")
            mem.mkdir(exist_ok=True)
            (mem / "memory.limit_in_bytes").write_text(str(mb * 2**20))
            groups.append(mem)
            if self.cpu:
                cpu = Path(f"/sys/fs/cgroup/cpu/pghydrate-twin-lambda-{self.tag}-{pid}")
                cpu.mkdir(exist_ok=True)
                (cpu / "cpu.cfs_period_us").write_text("100000")
                (cpu / "cpu.cfs_quota_us").write_text(str(int(100000 * mb / LAMBDA_MB_PER_VCPU)))
                groups.append(cpu)
            self.groups[pid] = groups
            for g in groups:
                (g / "cgroup.procs").write_text(str(pid))
            self.placed[fn] = self.placed.get(fn, 0) + 1

    def _release(self, gone_only: bool):
        for pid in list(self.groups):
            if gone_only and Path(f"/proc/{pid}").exists():
                continue
            left = []
            for g in self.groups[pid]:
                try:
                    g.rmdir()
                except FileNotFoundError:
                    pass
                except OSError:
                    left.append(g)  # its process has not quite exited yet
            if left:
                self.groups[pid] = left
            else:
                del self.groups[pid]

    def stop(self):
        self.halt.set()
        self.join(timeout=5)
        for _ in range(100):
            self._release(gone_only=False)
            if not self.groups:
                return
            time.sleep(0.1)
        raise RuntimeError(f"Lambda sandbox cgroups still in use: {self.groups}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_pg(args, check: bool = True, **kw):
    if os.geteuid() == 0:
        args = ["runuser", "-u", RUN_AS, "--"] + args
    return subprocess.run(args, check=check, capture_output=True, text=True, **kw)


class ServerGone(RuntimeError):
    """The process that was to serve a URL exited before it answered (e.g. a port taken meanwhile)."""


def log_tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as e:
        return f"(no log: {e})"


def wait_http(url: str, seconds: float = 60, proc: subprocess.Popen | None = None, log: Path | None = None):
    """Until `url` answers (any HTTP status). With `proc`, fails at once when that process exits, and
    both failures carry the tail of its `log`: a server that never came up says why."""
    start = time.time()
    while time.time() < start + seconds:
        if proc is not None and proc.poll() is not None:
            raise ServerGone(f"{url}: its server exited with {proc.returncode} after {time.time() - start:.1f}s; "
                             f"the end of {log}:\n{log_tail(log) if log else ''}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return  # the server answered
        except Exception:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer in {seconds}s"
                       + (f"; the end of {log}:\n{log_tail(log)}" if log else ""))


def event_entry(event: dict) -> dict:
    """A PutEvents entry for an event as EventBridge delivers it (source, detail-type, resources, detail)."""
    return {"Source": event["source"], "DetailType": event["detail-type"], "Resources": event.get("resources", []),
            "Detail": json.dumps(event["detail"])}


class Postgres:
    """A PostgreSQL cluster on a free loopback port, run by the unprivileged user."""

    def __init__(self, workdir: Path, conf: dict | None = None, major: int | None = None):
        self.bin = HOME / "pg" / str(major) / "bin" if major else PG_BIN
        self.dir = workdir / "pg"
        self.dir.mkdir(parents=True)
        (self.dir / "pw").write_text(PASSWORD)
        if os.geteuid() == 0:
            shutil.chown(self.dir, RUN_AS)
            shutil.chown(self.dir / "pw", RUN_AS)
        self.ca = self._make_certificates()
        as_pg([str(self.bin / "initdb"), "-D", str(self.dir / "data"), "-U", "postgres", "-A", "scram-sha-256",
               "--auth-local=trust", f"--pwfile={self.dir / 'pw'}", "--locale=C", "-E", "UTF8", "--no-sync"])
        with open(self.dir / "data" / "postgresql.auto.conf", "a") as f:
            f.write(f"listen_addresses = '127.0.0.1'\nunix_socket_directories = '{self.dir}'\nfsync = off\n"
                    "shared_buffers = 128MB\nautovacuum = off\n"
                    f"ssl = on\nssl_cert_file = '{self.dir / 'server.pem'}'\nssl_key_file = '{self.dir / 'server.key'}'\n")
            for k, v in (conf or {}).items():
                f.write(f"{k} = '{v}'\n")
        self.port = free_port()
        self.start()

    def _make_certificates(self) -> Path:
        """A CA and a server certificate for 127.0.0.1: the Lambdas connect with their default,
        verify-full, against this CA as their bundle (PGHYDRATE_CA_BUNDLE), as against RDS's."""
        def openssl(*args):
            subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=self.dir)
        openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "30",
                "-subj", "/CN=pghydrate twin CA", "-addext", "basicConstraints=critical,CA:TRUE",
                "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
        (self.dir / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
                                          "extendedKeyUsage=serverAuth\n")
        openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", "server.pem", "-days", "30", "-extfile", "ext.cnf")
        os.chmod(self.dir / "server.key", 0o600)
        if os.geteuid() == 0:
            for f in ("server.key", "server.pem"):
                shutil.chown(self.dir / f, RUN_AS)
        return self.dir / "ca.pem"

    def start(self):
        as_pg([str(self.bin / "pg_ctl"), "-D", str(self.dir / "data"), "-l", str(self.dir / "log"), "-o",
               f"-p {self.port}", "-w", "start"])

    def running(self) -> bool:
        return as_pg([str(self.bin / "pg_ctl"), "-D", str(self.dir / "data"), "status"], check=False).returncode == 0

    def ensure_running(self):
        """Starts the server if a test left it stopped (an outage test that failed midway): the next
        test of a module that shares it finds it up."""
        if not self.running():
            self.start()

    @contextmanager
    def holding_lock(self, table: str, db: str, timeout: float = 60):
        """A session of the test's own holds `table` ACCESS EXCLUSIVE (a migration) from the moment this
        returns, the lock granted, until the block ends, however it ends: the lock lasts exactly as long
        as the test says, not a guessed number of seconds."""
        proc = subprocess.Popen(self._psql_args(db), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=dict(os.environ, PGPASSWORD=PASSWORD))
        try:
            proc.stdin.write(f"BEGIN;\nLOCK TABLE {table} IN ACCESS EXCLUSIVE MODE;\nSELECT 'locked';\n")
            proc.stdin.flush()
            ready, _, _ = select.select([proc.stdout], [], [], timeout)
            line = proc.stdout.readline() if ready else ""
            if line.strip() != "locked":
                proc.kill()
                raise RuntimeError(f"the lock on {table} was not granted within {timeout} s: {line!r}, "
                                   f"psql said {proc.stderr.read().strip()!r}")
            yield
        finally:
            try:
                proc.stdin.write("COMMIT;\n")
                proc.stdin.close()
            except OSError:
                pass  # psql has exited
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def stop(self, mode="fast"):
        as_pg([str(self.bin / "pg_ctl"), "-D", str(self.dir / "data"), "-m", mode, "-w", "stop"], check=False)

    def restart(self):
        self.stop()
        self.start()

    def _psql_args(self, db: str) -> list:
        """psql as the superuser over TCP, stopping at the first error, rows unaligned."""
        return [str(self.bin / "psql"), "-X", "-q", "-At", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1",
                "-p", str(self.port), "-U", "postgres", "-d", db]

    def psql(self, sql: str, db: str = "postgres", options: str = "") -> str:
        env = dict(os.environ, PGPASSWORD=PASSWORD, PGOPTIONS=options)
        out = subprocess.run(self._psql_args(db) + ["-c", sql], capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise RuntimeError(f"psql -d {db} -c {sql[:200]!r}: {out.stderr.strip()}")
        return out.stdout.strip()

    def load_sample(self, db: str, scale: int = 1):
        self.psql(f'CREATE DATABASE "{db}"')
        env = dict(os.environ, PGPASSWORD=PASSWORD, PGOPTIONS=f"-c pghydrate.scale={scale}")
        subprocess.run([str(self.bin / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1", "-p",
                        str(self.port), "-U", "postgres", "-d", db, "-f", str(ROOT / "scripts" / "sample.sql")],
                       check=True, capture_output=True, text=True, env=env)
        self.psql("VACUUM", db=db)


class Twin:
    def __init__(self, workdir: Path, lambda_timeout: int, margin: int, mode: str = "auto", env: dict | None = None,
                 pg_conf: dict | None = None):
        self.workdir = workdir
        self.mode = mode
        self.extra_env = env or {}
        self.lambda_timeout = lambda_timeout
        self.procs: list[subprocess.Popen] = []
        self.pg = Postgres(workdir, pg_conf)
        self.moto_port, self.control_port, self.shim_port, self.watch_port = (free_port() for _ in range(4))
        self.endpoint = f"http://127.0.0.1:{self.moto_port}"
        self.logs = workdir / "logs"
        self.logs.mkdir()
        try:
            self._start_moto()
            self._create_resources()
            self._start_watch(lambda_timeout, margin, self.roles)
        except BaseException:
            self.stop()  # what was started so far: Twin.start has no twin to stop
            raise

    # --- processes ---------------------------------------------------------------------------------------
    def _spawn(self, name, args, env=None, cwd=None):
        log = open(self.logs / f"{name}.log", "w")
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        self.procs.append(p)
        return p

    def _start_moto(self):
        # Lambda's timeout, with 10 s for the emulator's own start of a binary on its first invoke.
        env = dict(os.environ, PGHYDRATE_TWIN_WATCH_URL=f"http://127.0.0.1:{self.watch_port}",
                   PGHYDRATE_TWIN_LAMBDA_TIMEOUT=str(self.lambda_timeout + 10))
        for attempt in range(1, 4):
            log = self.logs / f"moto-{attempt}.log"
            moto = self._spawn(log.stem, [sys.executable, str(ROOT / "twin" / "server.py"), str(self.moto_port),
                                          str(self.control_port), str(self.shim_port)], env=env)
            try:
                wait_http(f"{self.endpoint}/moto-api/", 120, moto, log)
                break
            except ServerGone:
                # Its ports were free when chosen, and may not be when it binds them (another process's
                # outgoing connection takes any free port): three tries with new ones, then the error.
                if attempt == 3 or "Address already in use" not in log.read_text(errors="replace"):
                    raise
                self.moto_port, self.control_port, self.shim_port = (free_port() for _ in range(3))
                self.endpoint = f"http://127.0.0.1:{self.moto_port}"
        req = urllib.request.Request(f"{self.endpoint}/moto-api/config", method="POST",
                                     data=json.dumps({"stepfunctions": {"execute_state_machine": True}}).encode())
        urllib.request.urlopen(req)

    def function_env(self, lambda_timeout: int, margin: int) -> dict:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            # Lambda's own API (the capture function starts its per-instance calls): the shim.
            "AWS_ENDPOINT_URL_LAMBDA": f"http://127.0.0.1:{self.shim_port}",
            "AWS_ACCESS_KEY_ID": "twin",
            "AWS_SECRET_ACCESS_KEY": "twin",
            "AWS_REGION": REGION,
            "RUST_LOG": os.environ.get("PGHYDRATE_TWIN_RUST_LOG", "info"),
            "PGHYDRATE_MODE": self.mode,
            # As the template's SecretArn parameter: the deployment's default credentials.
            "PGHYDRATE_SECRET_ARN": self.secret_arn,
            # TLS: the production default (verify-full), against the twin's CA as the bundle.
            "PGHYDRATE_CA_BUNDLE": str(self.pg.ca),
            "PGHYDRATE_MARGIN_SECONDS": str(margin),
            "PGHYDRATE_STATE_BUCKET": "pghydrate-twin-state",
            "PGHYDRATE_STATE_PREFIX": "runs/",
            "PGHYDRATE_READY_POLL_SECONDS": "1",
            "PGHYDRATE_STORAGE_POLL_SECONDS": "1",
            "PGHYDRATE_READY_LIMIT_MINUTES": "10",
            "PGHYDRATE_STORAGE_LIMIT_MINUTES": "10",
            "PGHYDRATE_CALL_SECONDS": str(lambda_timeout),
            **self.extra_env,
        }

    def _start_watch(self, lambda_timeout: int, margin: int, roles: dict):
        # Concurrent invokes of one function run side by side, each in a process of its own, as in
        # Lambda's sandboxes (cargo lambda watch's default, 1, queued them: a Map of 8 concurrent
        # Warm calls ran one after the other, and measured 8 times the wall time).
        # PGHYDRATE_TWIN_RELEASE=1: release builds, as Lambda runs them (the tests use debug builds,
        # quicker to make); PGHYDRATE_TWIN_LAMBDA_CPU=1: each process gets its function's CPU share.
        args = ["cargo", "lambda", "watch", "-A", "127.0.0.1", "-P", str(self.watch_port), "--ignore-changes",
                "--timeout", "900", "--concurrency", "64"]
        if os.environ.get("PGHYDRATE_TWIN_RELEASE") == "1":
            args.append("--release")
        # An env file, not --env-var: --env-var K=V splits V at its commas (K=a,b is K=a and b=...), and
        # some values are lists (PGHYDRATE_CAPTURE_INSTANCES).
        env_file = self.workdir / "functions.env"
        lines = []
        names = {f"PGHYDRATE_TWIN_NAME_{fn.upper()}": role["name"] for fn, role in roles.items()}
        for k, v in {**self.function_env(lambda_timeout, margin), **names}.items():
            assert "\n" not in v and "'" not in v, f"{k}: a value the env file cannot carry: {v!r}"
            lines.append(f"{k}='{v}'")
        env_file.write_text("\n".join(lines) + "\n")
        args += ["--env-file", str(env_file)]
        env = dict(os.environ)
        env["PATH"] = f"{HOME / 'twinvenv' / 'bin'}:{env['PATH']}"
        # Each function process starts through the runner: its role's credentials (twin/lambda-runner.sh).
        env[f"CARGO_TARGET_{host_triple().upper().replace('-', '_')}_RUNNER"] = str(ROOT / "twin" / "lambda-runner.sh")
        watch = self._spawn("watch", args, env=env, cwd=ROOT)
        self.sandboxes = None
        if os.geteuid() == 0:
            self.sandboxes = Sandboxes(watch.pid, function_memory_mb(),
                                       cpu=os.environ.get("PGHYDRATE_TWIN_LAMBDA_CPU") == "1", tag=str(self.watch_port))
            self.sandboxes.start()
        wait_http(f"http://127.0.0.1:{self.watch_port}/", 120, watch, self.logs / "watch.log")

    def stop(self):
        for p in self.procs:
            try:
                os.killpg(p.pid, 15)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
        if getattr(self, "sandboxes", None):
            self.sandboxes.stop()
        self.pg.stop("immediate")

    # --- AWS resources -----------------------------------------------------------------------------------
    def client(self, service):
        return boto3.client(service, region_name=REGION, endpoint_url=self.endpoint,
                            aws_access_key_id="twin", aws_secret_access_key="twin")

    def _create_resources(self):
        self.client("s3").create_bucket(Bucket="pghydrate-twin-state")
        self.secret_arn = self.client("secretsmanager").create_secret(
            Name="pghydrate-twin-db", SecretString=json.dumps({"username": "postgres", "password": PASSWORD}))["ARN"]
        definition = (ROOT / "statemachine" / "hydrate.asl.json").read_text()
        subs = {f"{fn.capitalize()}FunctionArn": fn for fn in WORKFLOW_FUNCTIONS}
        subs.update(StateBucket="pghydrate-twin-state", StatePrefix="runs/")
        used = set(re.findall(r"\$\{(\w+)\}", definition))
        assert used == set(subs), f"placeholders {used} vs substitutions {set(subs)}"
        for k, v in subs.items():
            definition = definition.replace("${" + k + "}", v)
        self.state_machine = self.client("stepfunctions").create_state_machine(
            name=f"{STACK}-hydrate", definition=definition,
            roleArn=f"arn:aws:iam::{ACCOUNT}:role/pghydrate-twin")["stateMachineArn"]
        self.roles = self.configure_iam()

    def configure_iam(self, **params) -> dict:
        """Each function's role from infra/template.yaml, as the stack STACK deploys it with the twin's
        parameters (`params` override them), enforced from now on (moto_ext.py, twin/iam.py).
        Returns binary -> {"role", "name"}."""
        state = "pghydrate-twin-state"
        body = {
            "stack": STACK,
            "params": {"SecretArn": self.secret_arn, "StartSecretArns": START_SECRETS,
                       "SubnetIds": "subnet-twin", "SecurityGroupIds": "sg-twin",
                       "CaptureInstances": "twin-capture", "CaBundleLayerArn": "twin-ca-layer", **params},
            "refs": {"StateBucket": state},
            "attrs": {"StateBucket.Arn": f"arn:aws:s3:::{state}"},
        }
        req = urllib.request.Request(f"http://127.0.0.1:{self.control_port}/iam", method="POST",
                                     data=json.dumps(body).encode())
        return json.load(urllib.request.urlopen(req))["roles"]

    def denials(self, take: bool = False) -> list:
        """Every request of a function that its role did not allow (moto_ext's IAM gate); `take`: and forget
        them (a test that expects a denial takes it; any other is a failure: conftest.py)."""
        url = f"http://127.0.0.1:{self.control_port}/denials" + ("?take=1" if take else "")
        return json.load(urllib.request.urlopen(url))["denials"]

    def assert_no_denial(self):
        left = self.denials(take=True)
        assert not left, ("a function's role does not allow what its code does (infra/template.yaml): "
                          + "; ".join(d["message"] for d in left))

    def register_instance(self, ident: str, script=(), engine="postgres", create=True):
        """Creates the emulated DB instance (pointing at the real PostgreSQL) and scripts what each
        DescribeDBInstances reports: [{"status": ..., "storage": ..., "progress": ...}, ...]."""
        if create:
            self.client("rds").create_db_instance(
                DBInstanceIdentifier=ident, Engine=engine, DBInstanceClass="db.m5.large", AllocatedStorage=20,
                MasterUsername="postgres", MasterUserPassword=PASSWORD)
        body = {"id": ident, "address": "127.0.0.1", "port": self.pg.port, "script": list(script)}
        req = urllib.request.Request(f"http://127.0.0.1:{self.control_port}/instance", method="POST",
                                     data=json.dumps(body).encode())
        urllib.request.urlopen(req)

    def lambda_fault(self, function: str, fault: str, count: int = 1):
        """The next `count` invokes of `function` fail as on AWS: fault "inactive" (an idle VPC function:
        ResourceNotReadyException), "throttled" (TooManyRequestsException), "timedout" (killed at its
        timeout: Sandbox.Timedout) or "unknown" (killed with no error type, as out of memory: Lambda.Unknown)."""
        req = urllib.request.Request(f"http://127.0.0.1:{self.control_port}/lambda-fault", method="POST",
                                     data=json.dumps({"function": function, "fault": fault, "count": count}).encode())
        urllib.request.urlopen(req)

    def restore(self):
        """Undoes what a test may leave behind on a twin its module shares: a stopped server is started,
        and Lambda faults not yet consumed are disarmed."""
        self.pg.ensure_running()
        for function in FUNCTIONS:
            self.lambda_fault(function, "none", count=0)

    def create_rules_from_template(self) -> list:
        """Creates the EventBridge rules that infra/template.yaml attaches to the state machine (its
        EventBridgeRule events, patterns as written there), each targeting the twin's state machine."""
        template = load_template()
        events = self.client("events")
        names = []
        for res in template["Resources"].values():
            if res["Type"] != "AWS::Serverless::StateMachine":
                continue
            for name, ev in (res["Properties"].get("Events") or {}).items():
                assert ev["Type"] == "EventBridgeRule", ev
                events.put_rule(Name=name, EventPattern=json.dumps(ev["Properties"]["Pattern"]))
                events.put_targets(Rule=name, Targets=[{"Id": "hydrate", "Arn": self.state_machine,
                                                         "RoleArn": f"arn:aws:iam::{ACCOUNT}:role/pghydrate-twin-events"}])
                names.append(name)
        return names

    def put_event(self, event: dict):
        """Delivers an event to the default bus, as RDS does (source, detail-type, resources, detail)."""
        r = self.client("events").put_events(Entries=[event_entry(event)])
        assert r["FailedEntryCount"] == 0, r

    def deliveries(self) -> list:
        """Every EventBridge -> Step Functions delivery so far (moto_ext)."""
        return json.load(urllib.request.urlopen(f"http://127.0.0.1:{self.control_port}/deliveries"))["deliveries"]

    def async_invocations(self) -> list:
        """Every asynchronous Lambda invoke so far, with its outcome (moto_ext's shim)."""
        return json.load(urllib.request.urlopen(f"http://127.0.0.1:{self.control_port}/async-invocations"))["invocations"]

    def invoke(self, function: str, payload) -> tuple:
        """A synchronous invoke through the Lambda API, as a caller on AWS makes it: (function error or
        None, the decoded response)."""
        lam = boto3.client("lambda", region_name=REGION, endpoint_url=f"http://127.0.0.1:{self.shim_port}",
                           aws_access_key_id="twin", aws_secret_access_key="twin",
                           config=botocore.config.Config(read_timeout=900, retries={"max_attempts": 1}))
        r = lam.invoke(FunctionName=f"arn:aws:lambda:{REGION}:{ACCOUNT}:function:{function}",
                       Payload=json.dumps(payload).encode())
        return r.get("FunctionError"), json.loads(r["Payload"].read() or b"null")

    def describes(self) -> dict:
        return json.load(urllib.request.urlopen(f"http://127.0.0.1:{self.control_port}/describes"))

    def start_execution(self, execution_input) -> str:
        self.runs = getattr(self, "runs", 0) + 1
        return self.client("stepfunctions").start_execution(
            stateMachineArn=self.state_machine, name=f"run-{self.runs}-{int(time.time())}",
            input=json.dumps(execution_input))["executionArn"]

    def wait(self, arn: str, timeout: float = 600):
        sfn = self.client("stepfunctions")
        end = time.time() + timeout
        while time.time() < end:
            d = sfn.describe_execution(executionArn=arn)
            if d["status"] != "RUNNING":
                return d, self.history(arn)
            time.sleep(0.5)
        raise TimeoutError(f"execution {arn} still running after {timeout}s")

    def history(self, arn: str, children: bool = True) -> list:
        """The whole execution history (every page), followed by the histories of its Distributed Maps'
        child executions (each event of a child marked with "mapRunArn" and "child"), recursively."""
        sfn, events, token = self.client("stepfunctions"), [], None
        while True:
            page = sfn.get_execution_history(executionArn=arn, maxResults=1000, **({"nextToken": token} if token else {}))
            events += page["events"]
            token = page.get("nextToken")
            if not token:
                break
        return events + self.child_histories(events) if children else events

    def child_histories(self, events: list) -> list:
        out = []
        for e in events:
            run = (e.get("mapRunStartedEventDetails") or {}).get("mapRunArn")
            if not run:
                continue
            url = f"http://127.0.0.1:{self.control_port}/map-run?" + urllib.parse.urlencode({"arn": run})
            for child in json.loads(urllib.request.urlopen(url).read())["children"]:
                marked = [dict(c, mapRunArn=run, child=child["index"]) for c in child["events"]]
                for c in marked:  # as boto3 gives the parent's: datetimes
                    if isinstance(c.get("timestamp"), str):
                        c["timestamp"] = datetime.datetime.fromisoformat(c["timestamp"])
                out += marked + self.child_histories(marked)
        return out

    def run(self, execution_input, timeout: float = 600):
        return self.wait(self.start_execution(execution_input), timeout)

    def run_many(self, inputs, timeout: float = 600):
        """Starts every input at once (as EventBridge does on a repeated delivery), then waits for all."""
        arns = [self.start_execution(i) for i in inputs]
        return [self.wait(a, timeout) for a in arns]

    @staticmethod
    def report_of(history) -> dict:
        """The Report state's output (the summary, also when the execution failed as incomplete)."""
        for e in reversed(history):
            d = e.get("stateExitedEventDetails")
            if d and d.get("name") == "Report":
                return json.loads(d["output"])
        return {}

    def places_containing(self, secret: str) -> list:
        """Every output of the twin that contains `secret`: each execution's input, output and history,
        every object in the state bucket, every log (moto, cargo lambda watch and so the Lambdas)."""
        found = []
        sfn = self.client("stepfunctions")
        time.sleep(LIST_LAG)  # ListExecutions lags behind StartExecution
        for e in sfn.list_executions(stateMachineArn=self.state_machine, maxResults=1000)["executions"]:
            d = sfn.describe_execution(executionArn=e["executionArn"])
            history = self.history(e["executionArn"])
            if secret in json.dumps(d, default=str) + json.dumps(history, default=str):
                found.append(f"execution {e['name']}")
        s3 = self.client("s3")
        for o in s3.list_objects_v2(Bucket="pghydrate-twin-state").get("Contents", []):
            if secret.encode() in s3.get_object(Bucket="pghydrate-twin-state", Key=o["Key"])["Body"].read():
                found.append(f"s3://pghydrate-twin-state/{o['Key']}")
        for log in self.logs.iterdir():
            if secret in log.read_text(errors="replace"):
                found.append(str(log))
        return found

    def log_text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in self.logs.iterdir())

    @classmethod
    @contextmanager
    def start(cls, lambda_timeout: int = 120, margin: int = 10, mode: str = "auto", env: dict | None = None,
              pg_conf: dict | None = None):
        workdir = Path(tempfile.mkdtemp(prefix="twin-", dir=HOME))
        if os.geteuid() == 0:
            shutil.chown(workdir, RUN_AS)
        twin = None
        try:
            twin = cls(workdir, lambda_timeout, margin, mode, env, pg_conf)
            yield twin
            twin.assert_no_denial()
        finally:
            if twin:
                twin.stop()
            # rm, not shutil.rmtree: a 2,000-database server's 11 GB of small files took rmtree 57 s, and
            # 1,623 s with both cores busy (Python's per-file work starved of CPU).
            subprocess.run(["rm", "-rf", "--one-file-system", str(workdir)], check=False)

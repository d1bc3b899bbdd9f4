"""The twin left running for trying things by hand: `make twin-up` / `make twin-down`.

    python session.py up       # foreground: starts the twin, writes $PGHYDRATE_HOME/twin-up/, waits for SIGTERM
    python session.py down     # stops a running twin (SIGTERM to its process; it stops what it started)
    python session.py event FILE.json     # delivers an RDS event through the template's EventBridge rules
    python session.py executions          # lists the state machine's executions and their status
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

from twin import HOME, PASSWORD, ROOT, Twin, event_entry

STATE = HOME / "twin-up"


def up():
    STATE.mkdir(parents=True, exist_ok=True)
    (STATE / "pid").write_text(str(os.getpid()))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    try:
        with Twin.start(lambda_timeout=120, margin=10) as t:
            t.pg.load_sample("app", 1)
            t.register_instance("orders-restored")
            rules = t.create_rules_from_template()
            target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
            env = {
                "AWS_ENDPOINT_URL": t.endpoint, "AWS_ACCESS_KEY_ID": "twin", "AWS_SECRET_ACCESS_KEY": "twin",
                "AWS_REGION": "us-east-1", "PGHYDRATE_STATE_MACHINE_ARN": t.state_machine,
            }
            (STATE / "env").write_text("".join(f"export {k}={v}\n" for k, v in env.items()))
            (STATE / "twin.json").write_text(json.dumps({
                "endpoint": t.endpoint, "control": f"http://127.0.0.1:{t.control_port}",
                "state_machine": t.state_machine, "postgres_port": t.pg.port, "rules": rules,
                "logs": str(t.logs)}))
            py = f"{HOME / 'twinvenv' / 'bin' / 'python'} {ROOT / 'twin' / 'session.py'}"
            (STATE / "commands").write_text(f"""The twin is up: moto {t.endpoint}, PostgreSQL 127.0.0.1:{t.pg.port} (database "app"),
instance "orders-restored", the real state machine, EventBridge rules {", ".join(rules)}.
Logs (moto, cargo lambda watch): {t.logs}

  source {STATE / 'env'}
  {target / 'debug' / 'pghydrate'} start --instance orders-restored --wait      # a manual start, followed
  {py} event {ROOT / 'tests/fixtures/events/snapshot-restore-0043.json'}   # a restore event via EventBridge
  {py} executions                                                       # what ran, and how it ended
  PGPASSWORD='{PASSWORD}' psql -h 127.0.0.1 -p {t.pg.port} -U postgres app
  make twin-down
""")
            (STATE / "ready").write_text("")
            while True:
                time.sleep(3600)
    finally:
        for f in ("ready", "pid", "env", "twin.json", "commands"):
            (STATE / f).unlink(missing_ok=True)


def running() -> dict:
    if not (STATE / "ready").exists():
        raise SystemExit("no twin is up: make twin-up")
    return json.loads((STATE / "twin.json").read_text())


def client(service: str):
    import boto3
    return boto3.client(service, region_name="us-east-1", endpoint_url=running()["endpoint"],
                        aws_access_key_id="twin", aws_secret_access_key="twin")


def main(argv):
    cmd = argv[1] if len(argv) > 1 else ""
    if cmd == "up":
        up()
    elif cmd == "down":
        pid_file = STATE / "pid"
        if not pid_file.exists():
            print("no twin is up")
            return
        pid = int(pid_file.read_text())
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pid_file.unlink(missing_ok=True)
            return
        for _ in range(300):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                print("twin stopped")
                return
            time.sleep(0.1)
        raise SystemExit(f"twin (pid {pid}) did not stop in 30 s")
    elif cmd == "event" and len(argv) == 3:
        event = json.loads(Path(argv[2]).read_text())
        r = client("events").put_events(Entries=[event_entry(event)])
        print(json.dumps(r["Entries"]))
    elif cmd == "executions":
        sfn = client("stepfunctions")
        for e in sfn.list_executions(stateMachineArn=running()["state_machine"])["executions"]:
            print(f"{e['name']:50} {e['status']:10} {e['startDate']:%H:%M:%S}")
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv)

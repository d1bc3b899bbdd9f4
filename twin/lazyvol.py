"""A PostgreSQL whose tablespace lives on a simulated lazy-loaded volume (sim/, pghydrate-lazyvol).

    vol = Volume(workdir, binary)            # backing directory + mount point, owned by the server's user
    vol.mount(latency="0ms")                 # loading: no cold reads yet
    pg = Postgres(workdir, conf)             # from twin.py; CREATE TABLESPACE lazy LOCATION vol.mnt
    ...
    pg.stop(); vol.remount(latency="10ms", concurrency=8); pg.start()   # all cold again
    vol.status()["hydrated"]                 # chunks fetched / chunks in the snapshot

Remounting is the reset: the simulator starts all cold and the kernel's page cache of the mount is gone.

`threads` is the simulator's FUSE worker threads: every request, hot or cold, needs one, and a cold read
holds its thread for the fetch's latency. With more reads in flight than threads, reads of chunks already
fetched queue too: a limit of the simulator, not of a volume (it made the application's p95 relapse in
bench-normal while 48 sessions read; docs/benchmark.md). Benchmarks that run more sessions than 32 beside
an application set it above their sessions.
"""
import json
import os
import shutil
import subprocess
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

RUN_AS = "pghydrate"


class Volume:
    def __init__(self, workdir: Path, binary: Path):
        self.binary = binary
        self.back = workdir / "volume-backing"
        self.mnt = workdir / "volume"
        self.status_file = workdir / "volume-status.json"
        self.log = workdir / "volume.log"
        for d in (self.back, self.mnt):
            d.mkdir(parents=True, exist_ok=True)
            if os.geteuid() == 0:
                shutil.chown(d, RUN_AS, RUN_AS)
        self.proc = None
        self.params = {}

    def mount(self, latency="10ms", concurrency=8, bandwidth_mib=0.0, chunk_bytes=512 * 1024, iops=0.0,
              throughput_mib=0.0, burst_seconds="0s", burst_iops=0.0, burst_throughput_mib=0.0,
              latency_jitter="0ms", seed=1, threads=32):
        if os.geteuid() != 0:
            raise RuntimeError("the lazy volume mounts with mount(2): run as root")
        self.params = dict(latency=latency, concurrency=concurrency, bandwidth_mib=bandwidth_mib, chunk_bytes=chunk_bytes,
                           iops=iops, throughput_mib=throughput_mib, burst_seconds=burst_seconds,
                           burst_iops=burst_iops, burst_throughput_mib=burst_throughput_mib,
                           latency_jitter=latency_jitter, seed=seed, threads=threads)
        self.status_file.unlink(missing_ok=True)
        args = [str(self.binary), str(self.back), str(self.mnt), "--status", str(self.status_file)]
        for k, v in self.params.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        self.proc = subprocess.Popen(args, stdout=open(self.log, "a"), stderr=subprocess.STDOUT, start_new_session=True)
        end = time.time() + 30
        while not self._mounted():
            if self.proc.poll() is not None or time.time() > end:
                raise RuntimeError(f"the lazy volume did not mount: {self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        while not self.status_file.exists():
            time.sleep(0.02)

    def _mounted(self) -> bool:
        return any(line.split()[1] == str(self.mnt) for line in open("/proc/mounts") if "pghydrate-lazyvol" in line)

    def unmount(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._mounted():
            subprocess.run(["umount", "-l", str(self.mnt)], capture_output=True)
        self.proc = None

    def remount(self, **params):
        self.unmount()
        self.mount(**params)

    def status(self) -> dict:
        for _ in range(50):
            try:
                return json.loads(self.status_file.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                time.sleep(0.01)
        raise RuntimeError("no status from the lazy volume")


@contextmanager
def mounted(binary: Path, under: Path, **params):
    """A volume in a directory of its own under `under` (owned by the server's user), mounted with
    `params`; unmounted and removed however the block ends."""
    workdir = Path(tempfile.mkdtemp(prefix="lazyvol-", dir=under))
    if os.geteuid() == 0:
        shutil.chown(workdir, RUN_AS)
    vol = Volume(workdir, binary)
    try:
        vol.mount(**params)
        yield vol
    finally:
        vol.unmount()
        shutil.rmtree(workdir, ignore_errors=True)

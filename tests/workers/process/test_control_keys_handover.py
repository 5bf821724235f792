"""How a local worker gets its control-plane keys (workers/control_keys.py, workers/process/launch.py):
through `LocalCluster`'s real spawn, a child process standing in for the worker takes its keys as
a worker does, while the test reads the child's /proc/PID/environ, which every process of the
serving user can read for the worker's whole life. The keys used to sit there."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

import pdserve
from pdserve.engine.config import EngineConfig
from pdserve.router.process.control_auth import ControlAuth
from pdserve.workers.process import launch, warm_start
from pdserve.workers.process.launch import LaunchConfig, LocalCluster

REPO = str(Path(pdserve.__file__).resolve().parent.parent)  # the code under test, in the child too
# The stand-in worker (tests/workers/keys_probe.py): takes its keys as Worker.__init__ does,
# writes them out, then waits to be ended.
PROBE_ENTRY = "tests.workers.keys_probe:main"
PROBE = f"import sys; sys.path.insert(0, {REPO!r}); from tests.workers.keys_probe import main; main()"


@pytest.fixture(params=["fork", "exec"])
def probe_spawns(request, monkeypatch, tmp_path):
    """LocalCluster's real start, with the worker's entry point swapped for the stand-in: in a fork
    of the warm template (the default), and in a bare interpreter (`PDSERVE_WORKER_START=exec`)."""
    monkeypatch.setenv("PROBE_OUT", str(tmp_path / "keys.txt"))
    monkeypatch.setenv(launch.START_ENV, request.param)
    if request.param == "fork":
        monkeypatch.setattr(warm_start, "ENTRY", PROBE_ENTRY)
        return tmp_path / "keys.txt"
    real = subprocess.Popen

    def popen(cmd, *args, env=None, **kwargs):
        if cmd[1:3] == ["-m", "pdserve.workers.main"]:
            cmd = [cmd[0], "-c", PROBE]
        return real(cmd, *args, env=env, **kwargs)

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    return tmp_path / "keys.txt"


def wait_for(path: Path, proc, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, "the stand-in worker exited"
        assert time.monotonic() < deadline, "the stand-in worker wrote no keys"
        time.sleep(0.05)
    return json.loads(path.read_text())


def pipes_held() -> set[str]:
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the listing's own descriptor, closed by now
            continue
        if target.startswith("pipe:"):
            held.add(f"{fd}:{target}")
    return held


def test_a_local_worker_gets_its_keys_but_its_environment_never_holds_them(probe_spawns, monkeypatch):
    pipes = []  # the keys' pipe of each start, as the launcher made it

    def pipe_for(keys):
        fd = real_pipe_for(keys)
        pipes.append(f"pipe:[{os.fstat(fd).st_ino}]")
        return fd

    real_pipe_for = launch.pipe_for
    monkeypatch.setattr(launch, "pipe_for", pipe_for)
    auth = ControlAuth()
    issued = []

    def issue(worker_id: str, epoch: int):
        issued.append(auth.issue(worker_id, epoch))
        return issued[-1]

    cluster = LocalCluster(LaunchConfig(("decode",), EngineConfig(model="tiny"), pin_cpus=False), "tcp://127.0.0.1:9", issue)
    cluster.start()
    try:
        assert len(pipes) == 1 and not {p.split(":", 1)[1] for p in pipes_held()} & set(pipes)  # the launcher keeps no end of it
        proc = cluster.procs["decode-0"]
        got = wait_for(probe_spawns, proc)
        keys = issued[0]
        assert got["keys"] == b",".join((keys.server_public, keys.client_public, keys.client_secret)).decode()
        assert not got["fd_still_open"]  # read once and closed: TP ranks and later children cannot inherit it
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert keys.client_secret not in environ and keys.client_public not in environ
    finally:
        cluster.stop()

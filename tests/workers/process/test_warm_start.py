"""Local workers are forks of a warm template (workers/process/warm_start.py): each sees the launcher's
environment and standard streams as at its start, its exit status reaches the launcher as
`subprocess` reported it, and nothing outlives a launcher killed with SIGKILL."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import pdserve
from pdserve.workers.process import warm_start
from tests.helpers.processes import exited as _gone

REPO = str(Path(pdserve.__file__).resolve().parent.parent)
PROBE = "tests.workers.warm_probe:main"
pytestmark = pytest.mark.skipif(not warm_start.supported(), reason="no pidfds (Linux < 5.3): the launcher starts bare interpreters")


def _report(path: Path, proc, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the stand-in exited with {proc.returncode}"
        assert time.monotonic() < deadline, "the stand-in wrote nothing"
        time.sleep(0.02)
    return json.loads(path.read_text())


def test_a_fork_sees_the_launchers_environment_and_streams_and_reports_its_exit(monkeypatch, tmp_path, capfd):
    monkeypatch.setattr(warm_start, "ENTRY", PROBE)
    procs = []
    try:
        for flavour in ("one", "two"):  # a changed environment: a template of its own, not the first one's
            monkeypatch.setenv("PROBE_FLAVOUR", flavour)
            monkeypatch.setenv("PROBE_OUT", str(tmp_path / f"{flavour}.json"))
            procs.append(warm_start.start(json.dumps({"worker_id": f"probe-{flavour}"})))
            got = _report(tmp_path / f"{flavour}.json", procs[-1])
            assert got["flavour"] == flavour and got["config"] == json.dumps({"worker_id": f"probe-{flavour}"})
            assert got["torch_loaded"]  # imported once, in the template, before the fork
            assert got["comm"] == f"pd-probe-{flavour}" and got["argv"] == ["pdserve-worker"]
            assert got["stdin"] == "/dev/null" and got["parent"] != os.getpid()  # the template is its parent
        deadline = time.monotonic() + 30
        while "probe" not in capfd.readouterr().err:  # its stderr is the launcher's, as at its start
            assert time.monotonic() < deadline, "the stand-in's stderr never reached the launcher's"
            time.sleep(0.05)
        assert procs[0].poll() is None and procs[0].returncode is None
        with pytest.raises(subprocess.TimeoutExpired):
            procs[0].wait(timeout=0.1)
        procs[0].kill()
        assert procs[0].wait(timeout=30) == -signal.SIGKILL  # as subprocess reports a signal
        procs[1].terminate()
        assert procs[1].wait(timeout=30) == -signal.SIGTERM and procs[1].poll() == -signal.SIGTERM
        procs[1].kill()  # an ended worker: nothing to signal, no error
        monkeypatch.setenv("PROBE_FLAVOUR", "three")  # the first two templates are idle now: they stop
        monkeypatch.setenv("PROBE_OUT", str(tmp_path / "three.json"))
        first_two = list(warm_start._templates.values())
        procs.append(warm_start.start(json.dumps({"worker_id": "probe-three"})))
        assert _report(tmp_path / "three.json", procs[-1])["pytest_test"] == os.environ["PYTEST_CURRENT_TEST"]
        assert len(warm_start._templates) == 1 and all(t._forkserver_pid is None for t in first_two)
    finally:
        for proc in procs:
            proc.kill()


LAUNCHER = f"""
import json, os, sys, time
sys.path.insert(0, {REPO!r})
from pdserve.workers.process import warm_start
warm_start.ENTRY = {PROBE!r}
proc = warm_start.start(json.dumps({{"worker_id": "probe"}}))
print(proc.pid, flush=True)
time.sleep(600)
"""


def test_nothing_outlives_a_launcher_killed_with_sigkill(tmp_path):
    """The worker gives up its hold on the template's life, so the template exits with the
    launcher, and the worker watches the launcher itself (workers/lifeline.py), so it ends even
    while its template is stopped: no orphan keeps the launcher's cores or memory."""
    env = {**os.environ, "PROBE_OUT": str(tmp_path / "probe.json"), "PROBE_LIFE_S": "120"}
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True, env=env)
    try:
        worker = int(launcher.stdout.readline())
        got = _report(tmp_path / "probe.json", launcher)
        template = got["parent"]
        assert not _gone(worker) and not _gone(template)
        os.kill(template, signal.SIGSTOP)  # a template that cannot act: the worker watches the launcher itself
        launcher.kill()
        launcher.wait(30)
        _wait(lambda: _gone(worker), "the worker outlived its launcher")
        os.kill(template, signal.SIGCONT)
        _wait(lambda: _gone(template), "the template outlived its launcher")
    finally:
        launcher.kill()
        if "template" in locals() and not _gone(template):
            os.kill(template, signal.SIGKILL)


def _segment_exists(name: str) -> bool:
    return os.path.exists(f"/dev/shm/{name}")


def _wait(predicate, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_fork_runs_the_c_kernels_on_torchs_threads(monkeypatch, tmp_path):
    """The template only imported modules, so no OpenMP pool was inherited: a fork's C kernels
    split a large call over the threads it set, as its torch products do. Before, each fork took
    itself for the child of a process whose pool was in use and ran every kernel on one thread."""
    from pdserve.model import paged_decode
    monkeypatch.setattr(warm_start, "ENTRY", PROBE)
    monkeypatch.setenv("PROBE_KERNELS", "2")
    monkeypatch.setenv("PROBE_OUT", str(tmp_path / "probe.json"))
    proc = warm_start.start(json.dumps({"worker_id": "probe-kernels"}))
    try:
        got = _report(tmp_path / "probe.json", proc)
    finally:
        proc.kill()
    assert got["openmp_usable"] is True and got["glue_ok"]
    built = paged_decode.openmp()  # this process loaded the kernels itself: it may open regions
    assert got["openmp_built"] is built and got["glue_threads"] == (2 if built else 1)


def test_a_worker_outlasting_its_template_stays_visible_and_killable(monkeypatch, tmp_path):
    """A stopped worker whose template was killed is alive to the launcher until it really ends,
    and the launcher can still end it (a hung worker must not be restarted beside itself)."""
    monkeypatch.setattr(warm_start, "ENTRY", PROBE)
    monkeypatch.setenv("PROBE_OUT", str(tmp_path / "probe.json"))
    proc = warm_start.start(json.dumps({"worker_id": "probe-orphan"}))
    try:
        got = _report(tmp_path / "probe.json", proc)
        template = got["parent"]
        os.kill(proc.pid, signal.SIGSTOP)
        os.kill(template, signal.SIGKILL)
        _wait(lambda: _gone(template), "the template did not end")
        time.sleep(0.5)
        assert proc.poll() is None and not _gone(proc.pid)  # the template's end is not the worker's
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        proc.kill()  # through the worker's own pidfd: the template is not needed
        assert proc.wait(timeout=30) == 255  # ended; its status died with the template
        _wait(lambda: _gone(proc.pid), "the killed worker is still there")
    finally:
        proc.kill()


def test_a_killed_worker_leaves_no_shared_memory_while_the_launcher_lives(monkeypatch, tmp_path):
    """Each forked worker has its own resource tracker, as a bare interpreter has: a worker
    killed with SIGKILL has its segments unlinked then, not at the launcher's exit."""
    monkeypatch.setattr(warm_start, "ENTRY", PROBE)
    monkeypatch.setenv("PROBE_OUT", str(tmp_path / "probe.json"))
    proc = warm_start.start(json.dumps({"worker_id": "probe-shm"}))
    try:
        segment = _report(tmp_path / "probe.json", proc)["segment"]
        assert _segment_exists(segment)
        proc.kill()
        assert proc.wait(timeout=30) == -signal.SIGKILL
        _wait(lambda: not _segment_exists(segment), "the killed worker's segment outlived it")
    finally:
        proc.kill()


def test_ended_workers_hold_no_descriptors_in_the_launcher(monkeypatch, tmp_path):
    """Restarts do not accumulate the launcher's descriptors: an ended worker's handle lets go."""
    import gc

    monkeypatch.setattr(warm_start, "ENTRY", PROBE)

    out = tmp_path / "probe.json"
    monkeypatch.setenv("PROBE_OUT", str(out))  # one environment: one template, as under `pdserve serve`

    def cycle(i: int) -> None:
        out.unlink(missing_ok=True)
        proc = warm_start.start(json.dumps({"worker_id": f"probe-fd{i}"}))
        _report(out, proc)
        proc.kill()
        proc.wait(timeout=30)

    cycle(0)  # the template's own descriptors exist from here on
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for i in range(1, 5):
        cycle(i)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before


def _named(comm: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and Path(f"/proc/{pid}/comm").read_text().strip() == comm and not _gone(int(pid)):
                found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_start_whose_template_died_before_the_pid_leaves_no_orphan(monkeypatch, tmp_path):
    """The template forked the child but died before it reported the pid (simulated: the pid's
    read fails once): the start is tried again on a fresh template, and the first child, never
    given the go-ahead, ends before it runs, so one incarnation runs, not two."""
    monkeypatch.setattr(warm_start, "ENTRY", PROBE)
    monkeypatch.setenv("PROBE_OUT", str(tmp_path / "probe.json"))
    real, calls = warm_start.forkserver.read_signed, []

    def read_signed(fd):
        calls.append(fd)
        if len(calls) == 1:
            real(fd)  # the pid came; the template "died" before we saw it
            raise EOFError("unexpected EOF")
        return real(fd)

    monkeypatch.setattr(warm_start.forkserver, "read_signed", read_signed)
    proc = warm_start.start(json.dumps({"worker_id": "probe-once"}))
    try:
        _report(tmp_path / "probe.json", proc)
        time.sleep(1.0)  # time for an orphan to have started
        assert _named("pd-probe-once") == [proc.pid]
    finally:
        proc.kill()


def test_a_stopped_template_delays_a_start_by_the_timeout_not_forever(monkeypatch, tmp_path):
    monkeypatch.setattr(warm_start, "ENTRY", PROBE)
    monkeypatch.setattr(warm_start, "START_TIMEOUT_S", 3.0)  # the warm template's limit; a fresh one's covers its imports
    monkeypatch.setenv("PROBE_OUT", str(tmp_path / "first.json"))
    first = warm_start.start(json.dumps({"worker_id": "probe-first"}))
    template = _report(tmp_path / "first.json", first)["parent"]
    try:
        os.kill(template, signal.SIGSTOP)
        (tmp_path / "first.json").rename(tmp_path / "seen.json")  # the same environment: the same template
        second = warm_start.start(json.dumps({"worker_id": "probe-second"}))
        got = _report(tmp_path / "first.json", second)
        assert got["parent"] != template and _gone(template)  # the stopped one was ended, a fresh one forked
        assert first.poll() is None  # the first worker lives on without its template
        second.kill()
    finally:
        first.kill()
        with contextlib.suppress(ProcessLookupError):
            os.kill(template, signal.SIGKILL)

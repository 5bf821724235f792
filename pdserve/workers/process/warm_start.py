"""Local worker processes forked from a warm template instead of started from a bare interpreter.

Why: a worker's imports (torch above all) cost 2.2-2.6 s of CPU on a 2-core AVX2 EPYC before it
reads its config, and every start pays them: the cluster's first start, each restart of a killed
or hung worker, each test's cluster. The template is a process that imported the worker's modules
once (`multiprocessing`'s fork server, preloading `pdserve.workers.main`); each worker is a fork
of it, so a replacement is serving in the time its engine takes to build.

Contract (`start(config_json, keys_fd)` -> `WorkerProcess`):
- one template per environment: a worker's environment is the launcher's at its start; its
  template started under the same one (what libraries read at import), but for `VOLATILE` names
  (pytest's per-test variable); a changed environment gets a template of its own, and templates
  left without a live worker then stop;
- the worker's stdout and stderr are the launcher's at its start (passed as descriptors, as
  `subprocess` inherits them), its stdin is /dev/null, its working directory the launcher's;
- its control keys' pipe (workers/control_keys.py) travels as a passed descriptor, never through
  argv or the environment; the launcher closes its own end after the start, as before;
- nothing of the template's request channel stays in the worker: it closes its hold on the
  template's life (the "alive" pipe), so the template exits when the launcher does; the worker
  watches the launcher itself (workers/lifeline.py), so it ends with the launcher, not with the
  template, and it has its own resource tracker (its shared memory goes when it dies);
- a start is all or nothing: the child waits for the launcher's go-ahead, sent once its pid is
  known; a template that dies during a start, or stalls (`START_TIMEOUT_S` once warm,
  `PRELOAD_TIMEOUT_S` while it imports), is ended and the start tried on a fresh one (`start`);
- `WorkerProcess` answers what `subprocess.Popen` answered (pid, poll, wait, terminate, kill,
  returncode: negative for a signal, 255 where the template died first), from the worker's own
  pidfd, with the exit status the template reports.
Nothing here holds torch or CUDA state: the template only imported modules, and CUDA is
initialised in the worker after the fork.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import io
import json
import os
import select
import signal
import subprocess
import threading
import weakref
from multiprocessing import forkserver, popen_forkserver, process, reduction, resource_tracker, spawn
from multiprocessing.connection import wait

from pdserve.workers import lifeline
from pdserve.workers.control_keys import FD_ENV as CONTROL_KEYS_FD_ENV

PRELOAD = ["pdserve.workers.main"]  # what every worker imports before it reads its config
ENTRY = "pdserve.workers.main:main"  # what a forked worker runs (a test swaps in a stand-in)
_STDIO = ("stdout", "stderr")
STATUS_WAIT_S = 1.0  # how long an ended worker's status may take to come from its template
START_TIMEOUT_S = 10.0  # how long a warm template's fork may take (milliseconds when it is well)
PRELOAD_TIMEOUT_S = 300.0  # the same for a fresh template, its imports included (a loaded 2-core machine)
START_ATTEMPTS = 3  # a template that fails a start is ended, and the next attempt runs a fresh one


VOLATILE = frozenset({"PYTEST_CURRENT_TEST"})  # names that change per test, not per deployment


class _Template(forkserver.ForkServer):
    """A fork server of its own (not the module-wide one), with the worker's modules preloaded,
    and the workers forked from it (to know when it is idle)."""

    def __init__(self) -> None:
        super().__init__()
        self.set_forkserver_preload(PRELOAD)
        self.workers: list[WorkerProcess] = []
        self.warm_pid: int | None = None  # the template process that has forked once: its imports are done

    def idle(self) -> bool:
        self.workers = [w for w in self.workers if w.poll() is None]
        return not self.workers

    def discard(self) -> None:
        """End this template (SIGKILL: it may be stopped or half dead) and forget it, so the next
        start runs a fresh one. Its workers live on: they watch the launcher, not it."""
        pid, self._forkserver_pid = self._forkserver_pid, None
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        if self._forkserver_alive_fd is not None:
            os.close(self._forkserver_alive_fd)
        if self._forkserver_address is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._forkserver_address)
        self._forkserver_alive_fd = self._forkserver_address = None


_templates: dict[frozenset, _Template] = {}
_lock = threading.Lock()
_launching = threading.local()


def _key(environ) -> frozenset:
    return frozenset((k, v) for k, v in environ.items() if k not in VOLATILE)


def _template_for(environ) -> _Template:
    """The template started under this environment, or a new one (under `_lock`). Templates of
    other environments that have no live worker stop first: a launcher whose environment keeps
    changing (a test suite) holds one idle template, not one per change."""
    key = _key(environ)
    template = _templates.get(key)
    if template is None:
        for other in [k for k, t in _templates.items() if t.idle()]:
            _templates.pop(other).discard()  # (SIGKILL: closing its pipe would wait on a stopped one)
        template = _templates[key] = _Template()
    return template


class _Popen(popen_forkserver.Popen):
    """multiprocessing's fork-server start, through our template and without the launcher's
    __main__: the worker needs none of the launcher's modules."""

    def _launch(self, process_obj) -> None:
        prep = spawn.get_preparation_data(process_obj._name)
        for key in ("init_main_from_name", "init_main_from_path"):
            prep.pop(key, None)
        prep["sys_argv"] = ["pdserve-worker"]
        self._fds.extend(_launching.fds)  # stdout, stderr[, keys]: the worker's `get_inherited_fds()`
        buf = io.BytesIO()
        popen_forkserver.set_spawning_popen(self)
        try:
            reduction.dump(prep, buf)
            reduction.dump(process_obj, buf)
        finally:
            popen_forkserver.set_spawning_popen(None)
        self.sentinel, w = _launching.template.connect_to_new_process(self._fds)  # (re)starts a dead template
        _parent_w = os.dup(w)  # the worker's sentinel of its launcher (as multiprocessing keeps it)
        self.finalizer = popen_forkserver.util.Finalize(self, popen_forkserver.util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        template = _launching.template
        warm = template.warm_pid == template._forkserver_pid  # this very process forked before (not a relaunch)
        limit = START_TIMEOUT_S if warm else PRELOAD_TIMEOUT_S  # a fresh one imports torch first
        if not wait([self.sentinel], limit):  # a stopped or wedged template: not forever
            raise TimeoutError(f"the worker template did not fork within {limit:g} s")
        self.pid = forkserver.read_signed(self.sentinel)
        template.warm_pid = template._forkserver_pid


class _Process(process.BaseProcess):
    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


class WorkerProcess:
    """The launcher's handle on a forked worker: what it used of `subprocess.Popen`. Its life is
    read from a pidfd of the worker itself, not from the template, so a template that died or
    was stopped neither makes a live worker look dead nor a dead one alive, and signals reach
    the worker whatever became of the template; the template reports the exit status."""

    def __init__(self, proc: _Process):
        self._proc = proc
        self.pid: int = proc.pid
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(self.pid)  # the pid is the template's unreaped child, or just reaped
        weakref.finalize(self, os.close, self._pidfd)

    def _status(self, timeout: float) -> int | None:
        """The exit status the template reports (None: not within `timeout`, or no template)."""
        sentinel = self._proc._popen.sentinel
        if not wait([sentinel], timeout):
            return None
        try:
            return forkserver.read_signed(sentinel)
        except (OSError, EOFError):  # the template is gone: it reports nothing any more
            return None

    def _ended(self, timeout: float | None) -> bool:
        return bool(select.select([self._pidfd], [], [], timeout)[0])

    def poll(self) -> int | None:
        if self.returncode is None and self._ended(0):
            code = self._status(STATUS_WAIT_S)  # the template reaps it at once (SIGCHLD)
            self.returncode = 255 if code is None else code  # 255: ended, status unknown (as multiprocessing says)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._ended(timeout):
            raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout)
        return self.poll()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:  # ended meanwhile
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def run_forked(config_json: str, fd_names: tuple[str, ...], entry: str, environ: dict[str, str],
               launcher_pid: int) -> None:
    """The worker's side of the fork: the launcher's environment at the start (`environ`; the
    template's own differs at most in `VOLATILE` names), its stdout and stderr and its control
    keys' pipe, passed as descriptors in `fd_names` order; then `entry` ("module:function",
    imported by the template already) runs with the config as its argv. The worker watches the
    launcher itself (`lifeline`), not its parent the template, and gets a resource tracker of its
    own, as a bare interpreter would: its shared memory is unlinked when it dies, not when the
    launcher does."""
    fds = dict(zip(fd_names, forkserver._forkserver._inherited_fds or ()))
    go = fds.pop("go")
    if os.read(go, 1) != b"1":  # the launcher never took this start: end before anything
        os._exit(1)
    os.close(go)
    lifeline.watch(launcher_pid)
    tracker = resource_tracker._resource_tracker
    if tracker._fd is not None:
        os.close(tracker._fd)
        tracker._fd = tracker._pid = None
    os.environ.clear()
    os.environ.update(environ)
    from pdserve.model import ckernel  # loaded by the template already; never in the launcher
    ckernel.openmp_fresh()  # the template opened no parallel region: this fork's OpenMP has no stale pool
    module, function = entry.split(":")
    main = getattr(importlib.import_module(module), function)

    for target, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(fds[name], target)
        os.close(fds[name])
    alive = forkserver._forkserver._forkserver_alive_fd
    if alive is not None:  # the template's life is the launcher's alone: it exits with it
        os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None
    if "keys" in fds:
        os.environ[CONTROL_KEYS_FD_ENV] = str(fds["keys"])
    name_process(config_json)
    main([config_json])


def name_process(config_json: str) -> None:
    """`ps -o comm` and `pgrep` show the worker's id ("pd-decode-0"), not the template's command line."""
    try:
        name = f"pd-{json.loads(config_json)['worker_id']}"[:15].encode()
        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name), 0, 0, 0)  # PR_SET_NAME
    except (OSError, KeyError, ValueError, AttributeError):
        pass  # a name is a convenience


def supported() -> bool:
    """Forks of a template need Linux's pidfds (5.3+) to watch and signal their workers."""
    return hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")


def start(config_json: str, keys_fd: int | None = None) -> WorkerProcess:
    """Fork one worker from the template of the current environment (module contract). A
    template that fails a start (died, or stalled past its time limit) is ended and the start
    tried again on a fresh one, `START_ATTEMPTS` in all; then it raises (a crash to the
    supervisor). A forked child runs only on the launcher's go-ahead, sent once its pid is known:
    a child whose start failed (its template died before it reported the pid) ends at once,
    before it reads its keys, so no orphan incarnation holds the worker's keys or identity."""
    names = _STDIO + ("go",) + (("keys",) if keys_fd is not None else ())
    environ = dict(os.environ)
    args = (config_json, names, ENTRY, environ, os.getpid())
    with _lock:  # one launch at a time: the template and the descriptors belong to this start
        template = _template_for(environ)
        for attempt in range(1, START_ATTEMPTS + 1):
            go_r, go_w = os.pipe()
            _launching.template = template
            _launching.fds = [1, 2, go_r] + ([keys_fd] if keys_fd is not None else [])
            proc = _Process(target=run_forked, args=args, name="pdserve-worker")
            try:
                proc.start()
                worker = WorkerProcess(proc)
                os.write(go_w, b"1")
                break
            except (EOFError, OSError):  # the template died or stalled between our request and the pid
                template.discard()
                if attempt == START_ATTEMPTS:
                    raise
            finally:
                os.close(go_w)  # without the byte: the child ends (a failed start's orphan)
                os.close(go_r)
                _launching.template = _launching.fds = None
        process._children.discard(proc)  # not joined at the launcher's exit: the launcher stops its workers
        template.workers = [w for w in template.workers if w.returncode is None] + [worker]  # ended ones go
    return worker

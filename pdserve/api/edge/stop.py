"""The HTTP server's stop signal, told to the supervisor before uvicorn acts on it.

Contract: `StoppingServer(config, on_stop)` is uvicorn's server; when SIGINT or SIGTERM arrives it
calls `on_stop()` first, then stops as uvicorn does (stops accepting, lets open requests end).
uvicorn then re-raises the signal as its `serve()` returns, so the process's exit status is the
signal's; here that is left to the caller, `raise_stop_signals()` once the cluster is stopped.
A second SIGINT or SIGTERM while the cluster stops calls `on_force()` (every worker killed, its
pool unlinked) and ends the process as signalled at once, as a second Ctrl-C does elsewhere.
Raised by uvicorn, SIGTERM ended the process before `cluster()` stopped the workers: a stopped
(SIGSTOP) or hung worker then outlived the server with its shared-memory pool, since only its
own check of its parent would have ended it.
Why: a service manager's SIGTERM (systemd's control-group stop, `timeout`, `kill -- -PGID`)
reaches the workers at the same time as the server. Told first, the supervisor takes their deaths
as the stop's instead of restarting them (`Launcher.begin_stop`, workers/process/launcher.py).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Generator

import uvicorn


class StoppingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None], on_force: Callable[[], None] | None = None):
        super().__init__(config)
        self.on_stop, self.on_force = on_stop, on_force
        self._restore: dict[int, object] = {}

    def handle_exit(self, sig: int, frame) -> None:
        self.on_stop()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        """uvicorn's, but the signals it caught are kept for `raise_stop_signals` instead of
        re-raised when `serve()` returns."""
        self.stop_signals: list[int] = []
        with super().capture_signals():
            try:
                yield
            finally:
                captured = getattr(self, "_captured_signals", [])  # uvicorn's list (0.29+), re-raised after this
                self.stop_signals, captured[:] = list(captured), []
        if self.stop_signals and self.on_force is not None:  # stopping: a second signal forces it
            self._restore = {sig: signal.signal(sig, self._forced) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _forced(self, sig: int, frame) -> None:
        try:
            self.on_force()
        finally:  # the process ends as signalled whatever the kill met
            signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)

    def raise_stop_signals(self) -> None:
        """The caught signals, as uvicorn raises them (last first): the process ends as signalled."""
        for sig, handler in self._restore.items():
            signal.signal(sig, handler)
        for sig in reversed(getattr(self, "stop_signals", [])):
            signal.raise_signal(sig)

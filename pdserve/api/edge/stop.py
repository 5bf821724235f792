"""The HTTP server's stop signal, told to the supervisor before uvicorn acts on it.

Contract: `StoppingServer(config, on_stop)` is uvicorn's server; when SIGINT or SIGTERM arrives it
calls `on_stop()` first, then stops as uvicorn does (stops accepting, lets open requests end).
uvicorn then re-raises the signal as its `serve()` returns, so the process's exit status is the
signal's; here that is left to the caller, `raise_stop_signals()` once the cluster is stopped.
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
    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None]):
        super().__init__(config)
        self.on_stop = on_stop

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

    def raise_stop_signals(self) -> None:
        """The caught signals, as uvicorn raises them (last first): the process ends as signalled."""
        for sig in reversed(getattr(self, "stop_signals", [])):
            signal.raise_signal(sig)
